"""A stored run replayed under other prefix caches: an engine run's requests keyed by their tokens and
salts, a capture's events as chains through their parent hashes, each replica its own cache; the points
kept in whatif_points for SQL, `kvviz whatif RUN`, and the inspector's What if view."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pandas as pd
import pytest

from kvviz.analysis.runs import run_info
from kvviz.analysis.whatif_capture import capture_trace
from kvviz.analysis.whatif_isolation import isolation_costs
from kvviz.analysis.whatif_runs import compute, run_traces
from kvviz.models import load_model
from kvviz.runners import live
from kvviz.store import RunStore
from kvviz.whatif import curve, request_hits

from .apptest import AppTest
from .cli import kvviz

APP = str(Path(__file__).resolve().parent.parent / "app.py")
A = list(range(1, 13))  # three full blocks of 4
WORKLOAD = {"requests": [
    {"id": "A", "prompt_ids": A, "max_new_tokens": 2},
    {"id": "B", "prompt_ids": A[:8] + [50, 51, 52, 53], "max_new_tokens": 2, "arrival_step": 4},
    {"id": "C", "prompt_ids": A, "max_new_tokens": 2, "cache_salt": "t2", "arrival_step": 5}],
    "engine": {"block_size": 4, "num_blocks": 32}}


@functools.cache
def tiny():
    return load_model("tiny-llama", device="cpu")


@pytest.fixture
def engine_run(tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    return store, live.run(store, tiny(), WORKLOAD).run_id


def test_an_engine_run_is_replayed_by_its_requests_blocks_and_salts(engine_run):
    """B shares A's first two blocks; C has A's tokens under another salt, so it shares nothing. Counted
    by hand: a cache of one block serves B one block (A stored only its first), two blocks or more serve
    both; an unbounded cache serves 8 of the 36 prompt tokens."""
    store, rid = engine_run
    with store.read() as con:
        info = run_info(con, rid)
        traces = run_traces(con, info)
    trace = traces.traces[""]
    assert trace.requests == 3 and trace.lookups == 9 and trace.distinct_blocks == 7
    assert [p.hits for p in curve(trace, ["lru", "belady"], [1, 2, 7])] == [1, 2, 2, 1, 2, 2]
    points = compute(store, info, ["lru", "seed"], points=4)
    with store.read() as con:
        rows = con.execute("SELECT policy, capacity, hits, tokens_saved, prompt_tokens, hit_rate FROM whatif_points "
                           "WHERE run_id = ? AND capacity = 32 ORDER BY policy", [rid]).fetchall()
    assert rows == [("lru", 32, 2, 8, 36, 8 / 36), ("seed", 32, 2, 8, 36, 8 / 36)]  # the run's own pool is a point
    with store.read() as con:  # replayed salted, as the run kept its blocks, and said so
        assert con.execute("SELECT DISTINCT keying FROM whatif_points WHERE run_id = ?", [rid]).fetchall() == [
            ("tenant",)]
    assert len(points) == 2 * len({p.capacity for p in points})
    costs, reads = isolation_costs(traces, 32)  # C's salt: shared, C would have read A's three blocks
    assert costs.set_index("tenant")[["hit rate shared", "hit rate salted"]].to_dict("index") == {
        "(no salt)": {"hit rate shared": 8 / 24, "hit rate salted": 8 / 24}, "t2": {"hit rate shared": 1.0,
                                                                                  "hit rate salted": 0.0}}
    assert reads.to_dict("records") == [{"reader": "t2", "would read blocks of": "(no salt)", "blocks": 3,
                                         "tokens": 12}]
    compute(store, info, ["lru"], points=4)  # computed again: the kept points are replaced, not added to
    with store.read() as con:
        assert con.execute("SELECT DISTINCT policy FROM whatif_points WHERE run_id = ?", [rid]).fetchall() == [("lru",)]


def test_a_capture_s_events_are_chains_through_their_parents():
    """e0 stores h1 h2 from the root, e1 stores h3 after h2, e2 stores h4 after h1: their lookups are
    h1 h2 / h1 h2 h3 / h1 h4, so an unbounded cache serves 2 + 1 blocks, and a cache of one block (each
    event stores its first block only) serves e1 and e2 their h1."""
    part = pd.DataFrame({"step": [0, 0, 1, 2], "event_index": [0, 0, 0, 0], "block_hash": [11, 12, 13, 14],
                         "parent_hash": [0, 11, 12, 11], "root": [True, False, False, False], "block_size": [16] * 4})
    trace = capture_trace(part)
    assert trace.lookups == 7 and trace.distinct_blocks == 4 and trace.block_size == 16
    assert [p.hits for p in curve(trace, ["lru"], [1, 4])] == [2, 3]


def test_a_capture_is_replayed_per_replica_and_the_cli_keeps_the_points(tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    cap = tmp_path / "cap.jsonl"
    assert kvviz("capture-example", cap, "--events", "2000", "--replicas", "2").returncode == 0
    rid = kvviz("import", cap, "--db", store.path).stdout.strip()
    out = kvviz("whatif", rid, "--db", store.path, "--policy", "lru,belady", "--points", "6")
    assert out.returncode == 0, out.stderr
    assert "points kept in whatif_points" in out.stderr and "belady" in out.stdout.splitlines()[0]
    with store.read() as con:
        info = run_info(con, rid)
        traces = run_traces(con, info).traces
        kept = con.execute("SELECT capacity, hits, lookups FROM whatif_points WHERE run_id = ? AND policy = 'lru' "
                           "ORDER BY capacity", [rid]).fetchall()
    assert len(traces) == 2  # each replica its own cache
    for capacity, hits, lookups in kept:  # the fleet's point: each replica at that capacity, summed
        each = [curve(t, ["lru"], [capacity])[0] for t in traces.values()]
        assert (hits, lookups) == (sum(p.hits for p in each), sum(p.lookups for p in each))
    gone = kvviz("whatif", tmp_path / "missing.jsonl", "--db", store.path)
    assert gone.returncode == 2
    assert f"missing.jsonl: no such trace file, and no run of that id in {store.path}" in gone.stderr


def what_if_view(store: RunStore, rid: str, monkeypatch) -> AppTest:
    """The inspector's What if view of a run, not computed yet."""
    monkeypatch.setenv("KVVIZ_DB", str(store.path))
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["run_id"] = rid
    at.run()
    at.switch_page("kvviz/ui/pages/inspector.py").run()
    return at.segmented_control(key="insp_view").set_value("What if").run()


def test_the_inspector_s_what_if_view_computes_with_progress_and_draws_the_curve(engine_run, monkeypatch):
    at = what_if_view(*engine_run, monkeypatch)
    assert any("Not computed yet" in i.value for i in at.info)
    at.button(key="wi_go").click().run()
    assert not at.exception
    assert any("At **32 blocks** (this run's cache)" in m.value and "LRU serves 22.2%" in m.value for m in at.markdown)
    assert at.get("plotly_chart")
    assert any("**What isolation costs** at 32 blocks" in m.value for m in at.markdown)
    at.run()  # kept: the next visit draws it at once, and offers to compute again
    assert at.get("plotly_chart") and at.button(key="wi_go").label == "Compute again"


def test_bench_whatif_times_each_policy_against_the_exact_lru_peer(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {i}, "input_length": 2048, "output_length": 1, '
                             f'"hash_ids": [0, {i % 5 + 1}, {i + 10}, {i + 100}]}}\n' for i in range(40)))
    out = kvviz("bench", "--whatif", trace)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| t.jsonl"))
    assert row.split("|")[2].strip() == "40" and row.split("|")[3].strip() == "160" and row.endswith("x |")
    bad = kvviz("bench", "--whatif", tmp_path / "missing.jsonl")
    assert bad.returncode == 2 and "--whatif: no trace" in bad.stderr


@pytest.mark.parametrize("eviction", ["lru", "lfu", "seed", "newcomer"])
def test_the_replay_predicts_the_hits_kvviz_s_engine_had(tmp_path, eviction):
    """The simulator checked against a real cache: requests one after another (each arrives after the one
    before has ended), multi-turn prefixes over shared system prompts, a pool small enough to evict.
    Each request holds its full prompt blocks and one partial block while it runs, and the partial block
    is freed first, so the engine's pool of N blocks caches as the replay's LRU of N - 1 blocks does:
    every request's cached tokens are the replay's, exactly."""
    rng = random.Random(7)
    systems = [[rng.randrange(1, 200) for _ in range(8)] for _ in range(3)]
    conversations, requests = [], []
    for i in range(40):
        if conversations and rng.random() < 0.5:  # a conversation goes on: its prompt and a new turn
            c = rng.randrange(len(conversations))
            conversations[c] = conversations[c][:-1] + [rng.randrange(1, 200) for _ in range(4)]
        else:
            conversations.append(rng.choice(systems) + [rng.randrange(1, 200) for _ in range(4 * rng.randrange(1, 3))])
            c = len(conversations) - 1
        prompt = conversations[c] + [rng.randrange(1, 200)]  # full blocks of 4 and one token more
        conversations[c] = prompt
        requests.append({"id": f"r{i}", "prompt_ids": prompt[:4 * 9 + 1], "max_new_tokens": 3,
                         "arrival_step": 5 * i})
    store = RunStore.open(tmp_path / "k.duckdb")
    engine = {"block_size": 4, "num_blocks": 12, "compute": "fast", "eviction": eviction}
    wl = {"requests": requests, "engine": engine}
    rid = live.run(store, tiny(), wl).run_id
    with store.read() as con:
        trace = run_traces(con, run_info(con, rid)).traces[""]
        cached = [c for (c,) in con.execute("SELECT r.cached_tokens FROM requests r JOIN cache_lookups l USING "
                                            "(run_id, request_id) WHERE run_id = ? ORDER BY l.step", [rid]).fetchall()]
    predicted = (request_hits(trace, eviction, 11) * 4).tolist()
    assert sum(cached) > 0 and predicted == cached
    for other in (10, 12):  # one block more or less would have served other requests: the test tells them apart
        assert (request_hits(trace, eviction, other) * 4).tolist() != cached
    others = [p for p in ("lru", "lfu", "seed", "newcomer") if p != eviction]  # and so would another policy
    assert any((request_hits(trace, p, 11) * 4).tolist() != cached for p in others)


@pytest.mark.spark
def test_a_capture_dataset_replayed_in_spark_gives_the_curve_duckdb_gives(tmp_path, spark):
    """Each replica a Spark task: the fleet's points equal the ones `whatif RUN` keeps for the same dataset."""
    from kvviz.analysis.whatif_spark import spark_curve

    folder = tmp_path / "capture"
    assert kvviz("capture-example", folder, "--events", "3000", "--replicas", "2").returncode == 0
    store = RunStore.open(tmp_path / "k.duckdb")
    rid = kvviz("import", folder, "--in-place", "--db", store.path).stdout.strip()
    with store.read() as con:
        info = run_info(con, rid)
    here = compute(store, info, ["lru", "belady"], points=6)
    there = spark_curve(spark.read.parquet(str(folder)), ["lru", "belady"], sorted({p.capacity for p in here}))
    assert there == here and sum(p.hits for p in here) > 0


def test_an_eviction_kvviz_s_pool_has_not_or_on_another_engine_is_one_sentence():
    from kvviz.engine.workload import Workload
    from kvviz.errors import WorkloadError

    req = [{"id": "A", "prompt": "hi"}]
    with pytest.raises(WorkloadError,
                       match=r"^engine.eviction: must be one of lru, lfu, seed, newcomer, got 'belady'$"):
        Workload.from_dict({"requests": req, "engine": {"eviction": "belady"}})
    with pytest.raises(WorkloadError, match=r"^engine.eviction: 'seed' is an order of kvviz's own block pool; llama"):
        Workload.from_dict({"requests": req, "engine": {"eviction": "seed", "backend": "llama.cpp"}})


def salted_capture(tmp_path, tokens: bool = True) -> tuple[RunStore, str]:
    """Blocks of 2 tokens. a stores 1-2 | 3-4; b the same tokens under its salt (other hashes); c 1-2 | 9-9
    (the first block's tokens); a again 9-9 | 3-4 (a second block like a's, after another prefix); b
    continues its chain with 5-6 (no salt named: its chain's); d stores 1-2 with one token only (a breach:
    imported without tokens). Without tokens (the control) no event carries any."""
    from kvviz.capture.import_vllm import import_capture
    from tests.test_capture import batch, stored_map, write_capture

    def t(*ids):
        return list(ids) if tokens else None

    events = [stored_map([1, 2], None, t(1, 2, 3, 4), salt="a"), stored_map([11, 12], None, t(1, 2, 3, 4), salt="b"),
              stored_map([21, 22], None, t(1, 2, 9, 9), salt="c"), stored_map([41, 42], None, t(9, 9, 3, 4), salt="a"),
              stored_map([13], 12, t(5, 6)), stored_map([51], None, t(1), salt="d")]
    store = RunStore.open(tmp_path / "k.duckdb")
    return store, import_capture(write_capture(tmp_path / "c.jsonl", [batch(e) for e in events]), store)


def test_a_capture_s_tokens_say_what_sharing_across_salts_would_have_merged(tmp_path):
    """Counted by hand, unbounded: as captured (hashes salted), only b's continuation hits (its own two
    blocks); keyed by content, b's first store hits a's two blocks and c hits a's first, so sharing gives
    exactly 3 more hits; a's 3-4 after 9-9 is another prefix and d's block has no tokens: neither merges."""
    store, rid = salted_capture(tmp_path)
    with store.read() as con:
        rt = run_traces(con, run_info(con, rid), content=True)
    own, shared = rt.traces["replica-0"], rt.unsalted["replica-0"]
    assert rt.tenants == ["a", "b", "c", "d"] and own.tenant.tolist() == [0, 1, 2, 0, 1, 3]
    assert rt.untokened == 1 and shared.lookups == own.lookups == 12
    cap = own.distinct_blocks
    assert request_hits(own, "lru", cap).tolist() == [0, 0, 0, 0, 2, 0]
    assert request_hits(shared, "lru", cap).tolist() == [0, 2, 1, 0, 2, 0]
    costs, reads = isolation_costs(rt, cap)
    assert costs.to_dict("list") == {
        "tenant": ["a", "b", "c", "d"], "prompt tokens": [8, 10, 4, 2], "hit rate shared": [0, 0.8, 0.5, 0],
        "hit rate salted": [0, 0.4, 0, 0], "loss": [0, 0.4, 0.5, 0], "hit rate per conversation": [0, 0.4, 0, 0]}
    assert reads.values.tolist() == [["b", "a", 4, 8], ["c", "a", 1, 2]]
    with store.read() as con:  # the curve is still the capture's own keying: content is asked for, not assumed
        assert run_traces(con, run_info(con, rid)).unsalted == {}


def test_a_capture_without_tokens_has_no_isolation_counterfactual(tmp_path):
    store, rid = salted_capture(tmp_path, tokens=False)
    with store.read() as con:
        rt = run_traces(con, run_info(con, rid), content=True)
    assert rt.tenants == ["a", "b", "c", "d"] and rt.unsalted == {} and isolation_costs(rt, 100) is None


def test_a_capture_s_own_capacity_is_at_least_the_most_blocks_it_held_at_once(tmp_path, engine_run):
    """The GPU holds 1 2 3, then 5 in another KV group, then 2 and 3 are removed, then 4 is stored: 3, 4,
    2, 3 blocks held, so the cache held at least 4 (not the 5 ever stored, nor the 3 left at the end, nor
    one group's most, 3); 4 blocks on the CPU tier are another medium. An engine run's pool is known."""
    from kvviz.analysis.whatif_capacity import OwnCapacity, own_capacity
    from kvviz.capture.import_vllm import import_capture
    from tests.test_capture import batch, stored_map, write_capture

    cpu = stored_map([7, 8, 9, 10], None, list(range(8))) | {"medium": "CPU"}
    store = RunStore.open(tmp_path / "c.duckdb")
    rid = import_capture(write_capture(tmp_path / "c.jsonl", [
        batch(stored_map([1, 2, 3], None, [1, 2, 3, 4, 5, 6])),
        batch(stored_map([5], None, [9, 9]) | {"group_idx": 1}), batch(cpu),
        batch({"type": "BlockRemoved", "block_hashes": [3, 2], "medium": "GPU"}),
        batch(stored_map([4], None, [7, 8]))]), store)
    with store.read() as con:
        held = own_capacity(con, run_info(con, rid))
    assert (held.blocks, held.known, held.held) == (4, False, (("replica-0", "CPU", 4), ("replica-0", "GPU", 4)))
    assert held.label == "at least 4 blocks held at once" and held.where == ""  # one replica: no need to name it
    fleet = (("a", "GPU", 5), ("b", "GPU", 3), ("b", "CPU", 9))
    assert OwnCapacity(5, False, fleet).where == "a" and OwnCapacity(5, False, (*fleet, ("c", "GPU", 5))).where == ""
    engine_store, engine_rid = engine_run
    with engine_store.read() as con:
        pool = own_capacity(con, run_info(con, engine_rid))
    assert (pool.blocks, pool.known, pool.label) == (32, True, "this run's cache")


def test_whatif_run_prints_what_a_capture_s_isolation_costs_and_its_least_capacity(tmp_path):
    store, rid = salted_capture(tmp_path)
    out = kvviz("whatif", rid, "--db", store.path, "--policy", "lru", "--points", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.split()[:4] == ["10", "(at", "least", "own)"] for line in lines)  # nothing removed: all 10 held
    assert "it held at most 10 blocks at once on the GPU, so it was at least that large" in out.stdout
    assert "salting at capacity 10 (unbounded) (lru)" in out.stdout
    b = next(line.split() for line in lines if line.split()[:1] == ["b"])
    assert b == ["b", "10", "80.00%", "40.00%", "40.00%", "40.00%", "40.00%"]
    assert "blocks without tokens in the events: 1 " in out.stdout
    assert "cross-tenant reads a shared cache allows: 5 blocks" in out.stdout


def test_the_what_if_view_marks_a_capture_s_least_capacity_and_its_isolation_costs(tmp_path, monkeypatch):
    at = what_if_view(*salted_capture(tmp_path), monkeypatch)
    at.button(key="wi_go").click().run()
    assert not at.exception
    assert any("At **10 blocks** (the least this capture's cache can have been" in m.value for m in at.markdown)
    assert any("held at most 10 blocks at once on the GPU" in c.value for c in at.caption)
    assert any("**What isolation costs** at 10 blocks (at least this capture's cache, LRU)" in m.value
               for m in at.markdown)
    assert any("Blocks without tokens in the events: 1 " in c.value for c in at.caption)
