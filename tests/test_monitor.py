"""kvviz monitor's state and metrics, fed messages directly (no sockets): its figures agree with what
the capture views compute for the same stream imported (the same definitions), cross-tenant blocks
show on a stream that has them and not on one without, the tenant label stays bounded with counters
that never go down, and bad input is counted and survived."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvviz.analysis import capture_time
from kvviz.capture.capture_file import Message
from kvviz.capture.dataset import DatasetWriter
from kvviz.capture.events import decode_batch
from kvviz.capture.synthetic import fleet_messages
from kvviz.capture.zmq_capture import Endpoint, ReplicaState
from kvviz.errors import CaptureError
from kvviz.monitor.metrics import registry
from kvviz.monitor.state import MonitorState
from kvviz.monitor.stream import Losses
from kvviz.runners.uploads import import_file
from kvviz.store import RunStore
from tests.cli import kvviz
from tests.test_capture import batch, stored_map


def scrape(state: MonitorState) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, as Prometheus would read /metrics."""
    text = generate_latest(registry(lambda: state.snapshot)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def feed(state: MonitorState, messages: list[Message]) -> MonitorState:
    for m in messages:
        state.add(m, decode_batch(m.payload, f"{m.replica} seq {m.seq}"))
    state.flush()
    return state


@pytest.fixture(scope="module", params=[0.0, 0.05], ids=["clean", "unsalted prompt"])
def fleet(request, tmp_path_factory):
    """A synthetic two-replica fleet through the monitor (folded every 500 messages) and imported."""
    messages = list(fleet_messages(20_000, replicas=2, unsalted=request.param, capacity=512))
    state = feed(MonitorState(fold_messages=500), messages)
    folder = tmp_path_factory.mktemp("fleet") / "ds"
    writer = DatasetWriter(folder, {"replica-0": "x", "replica-1": "x"})
    for m in messages:
        writer.add(m, decode_batch(m.payload, "x"))
    writer.close()
    store = RunStore.open(tmp_path_factory.mktemp("store") / "k.duckdb")
    return request.param, scrape(state), store, import_file(folder, store)


def test_hit_tokens_stores_and_blocks_held_agree_with_the_capture_views(fleet):
    _, samples, store, run = fleet
    with store.read() as con:
        span = capture_time.span(con, run)
        churn = capture_time.churn(con, run, span.start, span.end, span.end - span.start + 1)
        held = dict(con.execute("SELECT replica, arg_max(cached_blocks, step) FROM kv_cache_blocks WHERE run_id = ? "
                                "GROUP BY replica", [run]).fetchall())
    for replica, row in churn.set_index("replica").iterrows():
        assert total(samples, "kvviz_prefix_cache_hit_tokens_total", replica=replica) == row.hit_tokens > 0
        assert total(samples, "kvviz_prefix_cache_miss_tokens_total", replica=replica) == row.miss_tokens
        assert total(samples, "kvviz_kv_blocks_stored_total", replica=replica) == row.stored
        assert total(samples, "kvviz_kv_blocks_removed_total", replica=replica) == row.evicted
        assert total(samples, "kvviz_kv_cache_blocks", replica=replica) == held[replica] > 0


def test_cross_tenant_blocks_show_where_the_stream_has_them_and_only_there(fleet):
    unsalted, samples, store, run = fleet
    with store.read() as con:
        span = capture_time.span(con, run)
        shared = capture_time.cross_tenant(con, run, span.start, span.end)
    named = total(samples, "kvviz_kv_cross_tenant_blocks_total")
    salts = total(samples, "kvviz_kv_salt_shared_blocks_total")
    assert (named, salts) == (shared.named, shared.named + shared.inferred)
    assert (named > 0) == (unsalted > 0)
    assert total(samples, "kvviz_kv_blocks_salted_total") > 0


def message(replica: str, seq: int, *events: dict, restart: int = 0, ts: float = 1.0) -> Message:
    return Message(replica, restart, seq, "", batch(*events, ts=ts), ts + 0.25)


def test_a_removal_of_a_block_never_stored_is_a_contract_breach_and_a_clean_stream_has_none():
    removal = {"type": "BlockRemoved", "block_hashes": [99], "medium": "GPU"}
    clean = [message("a", 0, stored_map([1, 2], None, [1, 2, 3, 4], salt="t1")),
             message("a", 1, {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"})]
    samples = scrape(feed(MonitorState(), clean))
    assert total(samples, "kvviz_kv_event_contract_breaches_total") == 0
    assert total(samples, "kvviz_kv_cache_blocks", replica="a") == 1
    assert total(samples, "kvviz_kv_event_lag_seconds_sum", replica="a") == pytest.approx(0.5)
    samples = scrape(feed(MonitorState(), [*clean, message("a", 2, removal)]))
    assert total(samples, "kvviz_kv_event_contract_breaches_total", replica="a", kind="remove_unstored") == 1


def whole_capture_breaches(messages: list[Message], tmp_path) -> dict[tuple[str, str], int]:
    """(replica, kind) -> count, as an import of the same stream lints it (advisory kinds left out)."""
    folder = tmp_path / "ds"
    writer = DatasetWriter(folder, {m.replica: "x" for m in messages})
    for m in messages:
        writer.add(m, decode_batch(m.payload, "x"))
    writer.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    run = import_file(folder, store)
    with store.read() as con:
        return {(r, k): n for r, k, n in con.execute(
            "SELECT replica, kind, count FROM capture_breaches WHERE run_id = ? AND kind <> 'never_removes'",
            [run]).fetchall()}


@pytest.mark.parametrize("fold", [1, 1000], ids=["a slice per message", "one slice"])
def test_breaches_that_span_slices_count_as_a_lint_of_the_whole_capture_does(fold, tmp_path):
    child = message("a", 0, stored_map([2], 1, [3, 4]))  # its parent 1 is stored only later
    unsalted = message("a", 1, stored_map([6], None, [7, 8]))  # an unsalted chain, then a salted one
    parent = message("a", 2, stored_map([1], None, [1, 2]))
    salted = message("a", 3, stored_map([5], None, [5, 6], salt="t1"))
    later = message("a", 4, stored_map([9], None, [9, 9]))
    stream = [child, unsalted, parent, salted, later]
    expected = whole_capture_breaches(stream, tmp_path)
    assert expected == {("a", "parent_after_child"): 1, ("a", "salt_mixed"): 3}
    samples = scrape(feed(MonitorState(fold_messages=fold), stream))
    for (replica, kind), n in expected.items():
        assert total(samples, "kvviz_kv_event_contract_breaches_total", replica=replica, kind=kind) == n
    assert total(samples, "kvviz_kv_event_contract_breaches_total") == sum(expected.values())
    control = [message("a", i, m) for i, m in enumerate([stored_map([1], None, [1, 2], salt="t1"),
                                                          stored_map([2], 1, [3, 4]),
                                                          stored_map([5], None, [5, 6], salt="t2")])]
    assert total(scrape(feed(MonitorState(fold_messages=fold), control)),
                 "kvviz_kv_event_contract_breaches_total") == 0


def test_a_child_waiting_for_its_parent_is_bounded_and_forgotten_on_restart():
    state = MonitorState(fold_messages=1)
    state.lint.waiting = 2
    feed(state, [message("a", i, stored_map([10 + i], i + 1, [1, 2])) for i in range(3)])
    assert len(state.lint.children) == 2 and state.lint.forgotten == 1
    feed(state, [message("a", 3, stored_map([1], None, [1, 2]))])  # the forgotten child's parent
    assert total(scrape(state), "kvviz_kv_event_contract_breaches_total") == 0
    assert total(scrape(state), "kvviz_monitor_waiting_children_forgotten_total") == 1
    feed(state, [message("a", 0, stored_map([2], None, [1, 2]), restart=1)])  # a new life: nothing waits
    assert not state.lint.children and not state.lint.parents  # nor their parents' hashes, looked for per slice
    assert total(scrape(state), "kvviz_kv_event_contract_breaches_total") == 0


def test_a_clear_and_a_restart_empty_the_replicas_cache():
    stores = [message("a", 0, stored_map([1, 2], None, [1, 2, 3, 4])), message("b", 0, stored_map([5], None, [1, 2]))]
    state = feed(MonitorState(), [*stores, message("a", 1, {"type": "AllBlocksCleared"}),
                                  message("a", 2, stored_map([3], None, [5, 6]))])
    samples = scrape(state)
    assert total(samples, "kvviz_kv_cache_blocks", replica="a") == 1
    assert total(samples, "kvviz_kv_cache_clears_total") == 1
    feed(state, [message("b", 0, stored_map([7, 8], None, [1, 2, 3, 4]), restart=1)])
    assert total(scrape(state), "kvviz_kv_cache_blocks", replica="b") == 2  # its first life's block is gone


def test_a_token_that_is_not_an_int_is_refused_before_it_reaches_the_rows():
    state = MonitorState()
    bad = batch(stored_map([1], None, [1, "x"]))
    with pytest.raises(CaptureError, match="token_ids"):
        state.add(Message("a", 0, 0, "", bad), decode_batch(bad, "a seq 0"))
    feed(state, [message("a", 1, stored_map([1], None, [1, 2]))])
    assert total(scrape(state), "kvviz_kv_blocks_stored_total") == 1


def test_lost_messages_count_once_no_replay_can_fill_them_and_never_go_down():
    st, losses = ReplicaState(Endpoint("a", "tcp://x:1")), Losses()
    for seq in (0, 1, 5):
        st.advance(seq)
    st.replaying = time.monotonic()
    losses.update(st)
    assert losses.counted == 0  # a replay may still fill 2..4
    st.replaying = None
    st.fill(3)
    losses.update(st)
    assert losses.counted == 2
    st.restarts, st.gaps, st.last = 1, [[0, 2]], 3  # the publisher restarted at seq 3: 0..2 of the new life lost
    losses.update(st)
    assert losses.counted == 5
    st.gaps = []
    losses.update(st)
    assert losses.counted == 5


def test_a_thousand_tenants_give_a_bounded_label_set_counters_that_only_grow_and_a_fast_scrape():
    state, seq, before = MonitorState(tenants=5), 0, {}
    for _ in range(3):
        for t in range(1000):
            busy = 1 + (t % 7 == 0) * 3  # every seventh tenant stores four chains
            for _ in range(busy):
                seq += 1
                state.add(m := message("a", seq, stored_map([seq], None, [1, 2], salt=f"tenant-{t}")),
                          decode_batch(m.payload, "x"))
        state.flush()
        t0 = time.perf_counter()
        samples = scrape(state)
        assert time.perf_counter() - t0 < 0.1
        tenants = {dict(ls)["tenant"]: v for (n, ls), v in samples.items()
                   if n == "kvviz_kv_tenant_blocks_stored_total"}
        assert len(tenants) == 6 and "other" in tenants
        assert sum(tenants.values()) == seq
        assert all(v >= before.get(k, 0) for k, v in tenants.items())
        before = tenants
    assert total(samples, "kvviz_tenants_seen") == 1000


def test_the_command_replays_a_capture_and_refuses_bad_flags_in_one_sentence(tmp_path):
    from kvviz.capture.capture_file import CaptureWriter, read_capture

    path = tmp_path / "c.jsonl"
    writer = CaptureWriter(path, {"replica-0": "x"})
    for m in fleet_messages(2_000, replicas=1):
        writer.add(m)
    writer.close()
    again = tmp_path / "again.jsonl"
    p = kvviz("monitor", "--from-capture", str(path), "--speed", "0", "--port", "0", "--out", str(again))
    assert p.returncode == 0, p.stderr
    assert "serving metrics on http://127.0.0.1:" in p.stderr and "kvviz: replica-0:" in p.stderr
    assert [m.payload for _, m in read_capture(again)] == [m.payload for _, m in read_capture(path)]  # recorded
    for args, said in ((["--port", "0"], "give --endpoint"),
                       (["--endpoint", "tcp://127.0.0.1:1", "--capacity", "x=4"], "no replica is named 'x'"),
                       (["--from-capture", str(tmp_path / "none.jsonl")], "no such file")):
        p = kvviz("monitor", *args)
        assert p.returncode == 2 and said in p.stderr, p.stderr


def test_tenants_past_the_table_go_to_other_counted_and_said_once(caplog):
    state = MonitorState(tenants=2, tracked_tenants=3)
    messages = [message("a", seq, stored_map([seq], None, [1, 2], salt=f"tenant-{seq}")) for seq in range(6)]
    with caplog.at_level("INFO", logger="kvviz.monitor"):
        feed(state, messages)
        feed(state, [message("a", 6, stored_map([6], None, [1, 2], salt="tenant-6"))])
    samples = scrape(state)
    assert total(samples, "kvviz_tenants_seen") == 3
    assert total(samples, "kvviz_tenant_untracked_blocks_total") == 4
    assert total(samples, "kvviz_kv_tenant_blocks_stored_total") == 7
    labels = {dict(ls)["tenant"] for (n, ls), _ in samples.items() if n == "kvviz_kv_tenant_blocks_stored_total"}
    assert len(labels) == 3 and "other" in labels
    said = [r.getMessage() for r in caplog.records]
    assert sum("later ones are counted" in m for m in said) == 1 and sum("busiest have" in m for m in said) == 1


def test_the_live_course_says_no_hit_rate_where_no_hit_was_ever_published():
    from kvviz.monitor.course import point

    state = feed(MonitorState(capacity={"*": 4}), [message("a", 0, stored_map([1, 2], None, [1, 2, 3, 4]))])
    first = point(state.snapshot, None, 1.0, 1.0)
    assert (first.hit_ratio, first.hits_reported, first.utilisation) == (None, False, 0.5)  # not a silent 0%
    before = state.snapshot
    feed(state, [message("a", 1, stored_map([1, 3], None, [1, 2, 5, 6]))])  # block 1 again: a hit
    second = point(state.snapshot, before, 2.0, 1.0)  # over the interval: 2 tokens hit, 2 computed
    assert (second.hit_ratio, second.hits_reported, second.blocks_cached) == (0.5, True, 3)
    assert point(state.snapshot, None, 2.0, 1.0).hit_ratio == 0.25  # since the start: 2 of 8
