"""A capture on its time axis: churn, occupancy per replica, tier and tenant (through an eviction, an
AllBlocksCleared and a publisher restart), lifetimes, idle times and reuse gaps measured at import,
the most reused prefixes and a block's chain, each worked out by hand on a small capture."""

from __future__ import annotations

import msgpack
import pyarrow.parquet as pq
import pytest

from kvviz.analysis import capture_time
from kvviz.capture.capture_file import CaptureWriter, Message
from kvviz.capture.import_vllm import import_capture, import_dataset
from kvviz.store import RunStore
from tests.test_capture import stored_map
from tests.test_fleet_capture import write_dataset


def removed(*hashes):
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


# (ts, replica, restart, events): tenant a caches 1 -> 2, tenant b caches 5; a hits 1 twice (full report
# mode), 1 is evicted; the replica clears; after a restart of pod-b nothing of its old epoch is left.
TIMELINE = [
    (0.0, "pod-a", 0, [stored_map([1, 2], None, [1, 1, 2, 2], salt="a")]),
    (1.0, "pod-a", 0, [stored_map([5], None, [9, 9], salt="b")]),
    (2.5, "pod-a", 0, [stored_map([1], None, [1, 1], salt="a")]),  # a hit, 2.5 s after the store
    (3.0, "pod-a", 0, [stored_map([1], None, [1, 1], salt="a")]),  # again, 0.5 s later
    (4.0, "pod-a", 0, [removed(1)]),  # lived 4 s, idle 1 s
    (5.0, "pod-a", 0, [{"type": "AllBlocksCleared"}]),
    (6.0, "pod-a", 0, [stored_map([7], None, [4, 4], salt="a")]),
    (0.0, "pod-b", 0, [stored_map([1], None, [1, 1], salt="b")]),
    (3.0, "pod-b", 1, [stored_map([8], None, [3, 3], salt="b")]),  # restarted: 1 is gone from pod-b
]


@pytest.fixture
def run(tmp_path):
    path = tmp_path / "c.jsonl"
    w = CaptureWriter(path, {"pod-a": "tcp://a:1", "pod-b": "tcp://b:1"})
    seq = {}
    for ts, replica, restart, events in sorted(TIMELINE, key=lambda x: x[0]):
        seq[replica] = seq.get(replica, -1) + 1
        w.add(Message(replica, restart, seq[replica], "kv", msgpack.packb([1000.0 + ts, events, 0]), None))
    w.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    return store, import_capture(path, store)


def test_lifetimes_idle_times_and_reuse_gaps_are_measured_per_block(run):
    store, run_id = run
    with store.read() as con:
        d = capture_time.distributions(con, run_id, 1000.0, 1006.0)
    got = [(m, round(s, 3), n) for m, s, n in zip(d.measure, d.seconds, d["count"], strict=True)]
    # bins are tenths of a decade: 4 s falls in [3.981, 5.012), 2.5 s in [1.995, 2.512), 0.5 s in [0.398, 0.501)
    assert got == [("idle before eviction", 1.0, 1), ("lifetime", 3.981, 1), ("reuse gap", 0.398, 1),
                   ("reuse gap", 1.995, 1)]


def test_occupancy_per_tenant_replica_and_tier_through_evictions_clears_and_restarts(run):
    store, run_id = run
    with store.read() as con:
        tenant = capture_time.occupancy(con, run_id, 1000.0, 1006.0, 1.0, "tenant")
        replica = capture_time.occupancy(con, run_id, 1000.0, 1006.0, 1.0, "replica")
        tier = capture_time.occupancy(con, run_id, 1000.0, 1006.0, 1.0, "tier")
    a = tenant[tenant.series == "a"].set_index("interval_start").cached.to_dict()
    b = tenant[tenant.series == "b"].set_index("interval_start").cached.to_dict()
    assert [a[1000.0 + t] for t in range(7)] == [2, 2, 2, 2, 1, 0, 1]
    # pod-b's block 1 (tenant b) is gone at its restart (t=3), when block 8 comes
    assert [b[1000.0 + t] for t in range(7)] == [1, 2, 2, 2, 2, 1, 1]
    pods = replica.pivot(index="interval_start", columns="series", values="cached")
    assert list(pods["pod-a"]) == [2, 3, 3, 3, 2, 0, 1] and list(pods["pod-b"]) == [1, 1, 1, 1, 1, 1, 1]
    assert list(tier[tier.series == "GPU"].cached) == list(pods.sum(axis=1))
    # a later range starts from the level before it
    with store.read() as con:
        late = capture_time.occupancy(con, run_id, 1004.0, 1006.0, 1.0, "tenant")
    assert list(late[late.series == "a"].cached) == [1, 0, 1]


def test_occupancy_counts_a_store_at_the_very_end_of_the_range(tmp_path):
    """Timestamps of a real capture (the publisher's clock, 20 ms long): the intervals are a millisecond
    wide, and a grid of seconds added up drifted below the last store's interval, which never showed."""
    start, end = 1796371672.7924254, 1796371672.8129652
    path = tmp_path / "c.jsonl"
    w = CaptureWriter(path, {"pod-a": "tcp://a:1"})
    for seq, (ts, events) in enumerate([(start, [stored_map([1, 2], None, [1, 1, 2, 2], salt="a")]),
                                        (start + 0.0077, [stored_map([3], 2, [3, 3])]),
                                        (end, [stored_map([4], 3, [4, 4])])]):
        w.add(Message("pod-a", 0, seq, "kv", msgpack.packb([ts, events, 0]), None))
    w.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    run_id = import_capture(path, store)
    width = capture_time.interval_s(start, end)
    with store.read() as con:
        df = capture_time.occupancy(con, run_id, start, end, width, "replica")
    assert width == 0.001 and list(df.cached)[-1] == 4, "every stored block, the last one included"
    assert df.interval_start.iloc[-1] == pytest.approx(end, abs=width)


def test_churn_hits_and_the_most_reused_prefix_with_its_chain(run):
    store, run_id = run
    with store.read() as con:
        churn = capture_time.churn(con, run_id, 1000.0, 1006.0, 1.0)
        top = capture_time.shared_prefixes(con, run_id, 1000.0, 1006.0)
        chain = capture_time.chain(con, run_id, "pod-a", 2)
        assert capture_time.reports_hits(con, run_id), "pod-a's repeated stores of block 1"
    a = churn[churn.replica == "pod-a"].set_index("interval_start")
    assert a.stored.sum() == 4 and a.hits.sum() == 2 and a.evicted.sum() == 1
    assert a.hit_tokens.sum() == 4 and a.miss_tokens.sum() == 8
    first = top.iloc[0]
    assert (first.replica, first.block_hash, first.uses, first.hits, first.tenants) == ("pod-a", 1, 3, 2, 1)
    assert list(chain.block_hash) == [1, 2] and [list(t) for t in chain.token_ids] == [[1, 1], [2, 2]]


def test_intervals_begin_at_the_first_event_not_at_a_multiple_of_their_width(tmp_path):
    """A capture whose first event is 0.6 s past a whole second: its first bar begins at that event
    (0 s since the capture began), and a second store 0.8 s after it falls in the same bar, not the next."""
    path = tmp_path / "c.jsonl"
    w = CaptureWriter(path, {"pod-a": "tcp://a:1"})
    for seq, (ts, events) in enumerate([(1000.6, [stored_map([1], None, [1, 1], salt="a")]),
                                        (1001.4, [stored_map([2], 1, [2, 2])]),
                                        (1001.7, [stored_map([1], None, [1, 1], salt="a")])]):  # a hit
        w.add(Message("pod-a", 0, seq, "kv", msgpack.packb([ts, events, 0]), None))
    w.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    run_id = import_capture(path, store)
    with store.read() as con:
        span = capture_time.span(con, run_id)
        churn = capture_time.churn(con, run_id, span.start, span.end, 1.0)
        occupancy = capture_time.occupancy(con, run_id, span.start, span.end, 1.0, "replica")
    assert span.start == pytest.approx(1000.6)
    assert list((churn.interval_start - span.start).round(6)) == [0.0, 1.0]
    assert list(churn.stored) == [2, 0] and list(churn.hits) == [0, 1]
    assert list((occupancy.interval_start - span.start).round(6)) == [0.0, 1.0]
    assert list(occupancy.cached) == [2, 2]


def test_intervals_are_round_and_at_most_the_most():
    assert capture_time.interval_s(0, 60) == 0.2
    assert capture_time.interval_s(0, 3600) == 15
    assert capture_time.interval_s(0, 86400 * 400) == 86400 * 2
    for length in (0.01, 7, 1234.5, 99999):
        assert length / capture_time.interval_s(0, length) <= capture_time.MAX_INTERVALS


def test_a_dataset_written_before_lifetimes_imports_with_them_null(tmp_path):
    """A version 1 part (no lifetime_s, idle_s, reuse_gap_s) imports both ways, those columns null."""
    msgs = [Message("pod", 0, i, "kv", msgpack.packb([float(i), [stored_map([i + 1], None, [i, i])], 0]), None)
            for i in range(4)]
    folder = tmp_path / "ds"
    write_dataset(folder, msgs, rotate_rows=100)
    for part in folder.glob("replica=*/*.parquet"):
        table = pq.read_table(part)
        pq.write_table(table.drop_columns(["lifetime_s", "idle_s", "reuse_gap_s"]), part)
    store = RunStore.open(tmp_path / "k.duckdb")
    for run_id in (import_dataset(folder, store), import_dataset(folder, store, in_place=True)):
        with store.read() as con:
            got = con.execute("SELECT count(*), count(lifetime_s), count(reuse_gap_s) FROM kv_events "
                              "WHERE run_id = ?", [run_id]).fetchone()
            assert not capture_time.reports_hits(con, run_id), "every block stored once: no hit reported"
        assert got == (4, 0, 0)


def test_the_reuse_tree_collapses_single_child_chains_and_keeps_the_busiest_subtrees(tmp_path):
    """Tenant a uses the chain 1-2-3 four times and forks it at 3 into 4 and 5; tenant b uses 1 once
    (a hit on a's block); 9 is used once. Top 2 subtrees: [1-2-3] over 4 and 5, then [9]."""
    from kvviz.analysis import captures

    def chain(hashes, parent, salt, ts):
        return msgpack.packb([ts, [stored_map(hashes, parent, [h for h in hashes for _ in (0, 1)], salt=salt)], 0])

    payloads = [chain([1, 2, 3], None, "a", 1.0), chain([1, 2, 3], None, "a", 2.0), chain([1, 2, 3], None, "a", 3.0),
                chain([1, 2, 3], None, "a", 4.0), chain([4], 3, None, 5.0), chain([5], 3, None, 6.0),
                chain([1], None, "b", 7.0), chain([9], None, "c", 8.0), chain([8], None, "d", 8.5)]
    path = tmp_path / "c.jsonl"
    w = CaptureWriter(path, {"replica-0": "tcp://x:1"})
    for i, p in enumerate(payloads):
        w.add(Message("replica-0", 0, i, "kv", p))
    w.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    run_id = import_capture(path, store)
    with store.read() as con:
        tree = captures.reuse_tree(con, run_id, 0.0, 10.0, roots=2)
        late = captures.reuse_tree(con, run_id, 6.5, 10.0, roots=5)
        folded = captures.reuse_tree(con, run_id, 0.0, 10.0, roots=2, fanout=1)
    rows = {r.first: r for r in tree.itertuples()}
    top = rows[f"{1:016x}"]
    assert (top.blocks, top.uses, top.hits, top.tenants, top.parent) == (3, 5, 4, 2, "")
    assert top.id == f"{3:016x}" and top.tokens == 6
    assert {rows[f"{h:016x}"].parent for h in (4, 5)} == {top.id}
    assert len(tree) == 4, "[1-2-3], 4, 5 and one more root of the two busiest"
    assert sorted(late["first"]) == [f"{h:016x}" for h in (1, 8, 9)] and set(late.blocks) == {1}
    assert not tree.folded.any()
    kept, rest = folded[folded.parent == top.id].sort_values("folded").itertuples()
    assert (kept.first, kept.folded) == (f"{4:016x}", 0), "the busier child (4 before 5 on a tie) stays"
    assert (rest.first, rest.folded, rest.blocks, rest.uses, rest.parent) == ("", 1, 1, 1, top.id)


def test_every_sql_page_example_runs_on_a_store_with_a_capture(run):
    from kvviz.analysis.explained import explained
    from kvviz.store import run_query
    from kvviz.ui.sql_page import EXAMPLES

    store, run_id = run
    reasons = {e.reason for e in explained(store, run_id)}
    with store.read() as con:
        for sql in EXAMPLES.values():
            run_query(con, sql)  # raises SqlError naming what is wrong
        got = run_query(con, EXAMPLES["Capture lifetimes, idle times and reuse gaps (s)"])
        why = run_query(con, EXAMPLES["Why lookups missed, by reason (runs explained so far)"])
    assert {r[2] for r in why.rows} == reasons and reasons
    rows = {r[1]: dict(zip(got.columns, r, strict=True)) for r in got.rows}
    assert list(rows["pod-a"]["lifetime_p50_p99"]) == [4.0, 4.0]
    assert list(rows["pod-a"]["reuse_gap_p50_p99"]) == [1.5, 2.48], "gaps of 0.5 and 2.5 s"


def test_cross_tenant_blocks_are_those_one_replica_stored_under_two_salts(run, tmp_path):
    store, run_id = run
    with store.read() as con:  # 1 is a's on pod-a and b's on pod-b: two replicas, two blocks, no sharing
        shared = capture_time.cross_tenant(con, run_id, 1000.0, 1010.0)
        assert shared.named == shared.inferred == 0 and shared.events.empty
    path = tmp_path / "shared.jsonl"
    w = CaptureWriter(path, {"pod-a": "tcp://a:1"})
    for seq, (ts, events) in enumerate([(0.0, [stored_map([1, 2], None, [1, 1, 2, 2], salt="a")]),
                                        (1.0, [stored_map([1], None, [1, 1], salt="b")]),  # b hits a's block 1
                                        (2.0, [stored_map([3], None, [3, 3], salt="b")]),
                                        (3.0, [stored_map([1], None, [1, 1], salt="a")])]):
        w.add(Message("pod-a", 0, seq, "kv", msgpack.packb([1000.0 + ts, events, 0]), None))
    w.close()
    shared_id = import_capture(path, store)
    with store.read() as con:
        shared = capture_time.cross_tenant(con, shared_id, 1000.0, 1010.0)
        events = shared.events
        assert (shared.named, shared.inferred) == (1, 0) and set(events.block_hash) == {1}
        assert list(zip(events.ts - 1000.0, events.salt, events.repeat, strict=True)) == [
            (0.0, "a", False), (1.0, "b", True), (3.0, "a", True)]
        assert capture_time.cross_tenant(con, shared_id, 1000.0, 1000.5).named == 0  # only a's store in range
    from kvviz.figures import capture_time as drawn

    figure = drawn.cross_tenant(events, 1000.0)  # the block named as the findings table names it, 16 digits
    assert {y for t in figure.data for y in t.y} == {"0000000000000001"}
