"""The seed's memory utilisation: the paged pool's own live-slot count, the contiguous replay on
hand-computed arrivals, the recorded view, old files and traces, the figure and the benchmarks."""

from __future__ import annotations

import io
import random
import zipfile
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from kvviz.analysis.memory import FirstFit, RequestSpan, Usage, contiguous_replay, overall, run_memory, spans
from kvviz.engine.kv_cache import PoolSnapshot
from kvviz.engine.workload import Workload
from kvviz.models import load_model
from kvviz.runners.recorded import record_run
from kvviz.store import RunStore
from kvviz.store.trace import export_run, import_trace
from tests.cli import kvviz

from .apptest import AppTest

ROOT = Path(__file__).resolve().parent.parent


def snapshot(tables: dict, computed: dict, block_size: int = 4, blocks: int = 8) -> PoolSnapshot:
    refs = [0] * blocks
    for table in tables.values():
        for b in table:
            refs[b] += 1
    return PoolSnapshot(block_size, tuple(refs), (None,) * blocks, (1,) * blocks,
                        tuple(b for b in range(blocks) if not refs[b]), tables, computed)


def test_a_shared_block_counts_once_and_a_partial_block_by_its_tokens():
    # A holds blocks 0, 1 with 6 tokens computed; B shares block 0 and has 5 in blocks 0, 2.
    snap = snapshot({"A": (0, 1), "B": (0, 2)}, {"A": 6, "B": 5})
    assert snap.live_slots() == 4 + 2 + 1
    assert snapshot({"A": (0, 1, 3)}, {"A": 5}).live_slots() == 5  # block 3 allocated ahead, still empty


def test_first_fit_takes_the_lowest_hole_and_merges_on_release():
    space = FirstFit(10)
    assert [space.place(4), space.place(4), space.place(2), space.place(1)] == [0, 4, 8, None]
    space.release(0, 4)
    space.release(8, 2)
    assert space.holes == [(0, 4), (8, 2)] and space.free == 6
    assert space.place(5) is None  # enough in total, no region: fragmentation
    space.release(4, 4)
    assert space.holes == [(0, 10)] and space.place(5) == 0


def test_the_contiguous_replay_on_hand_computed_arrivals():
    """Ten slots. A, B and C fill them at step 0; D (5 slots) arrives at step 1 and must wait: first
    for memory, then (steps 4 and 5) for a region, with 6 slots free in two holes of 4 and 2."""
    reqs = [RequestSpan("A", 0, 4, (4, 4)), RequestSpan("B", 0, 4, (1, 2, 3, 4, 4, 4)),
            RequestSpan("C", 0, 2, (2, 2, 2, 2)), RequestSpan("D", 1, 5, (5, 5)), RequestSpan("E", 1, 11, (1,))]
    replay = contiguous_replay(reqs, 10)
    assert [(u.step, u.live, u.allocated, u.waiting) for u in replay.usage] == [
        (0, 7, 10, 0), (1, 4, 6, 1), (2, 5, 6, 1), (3, 4, 4, 1), (4, 4, 4, 1), (5, 0, 0, 1), (6, 5, 5, 0),
        (7, 0, 0, 0)]
    assert replay.fragmented_steps == 2 and replay.refused == ["E"]
    assert overall(replay.usage) == pytest.approx(29 / 35)


def test_the_replay_idles_until_the_next_arrival():
    replay = contiguous_replay([RequestSpan("A", 0, 2, (1, 2)), RequestSpan("B", 9, 2, (1, 2))], 4)
    assert [u.step for u in replay.usage] == [0, 1, 9, 10]


def test_a_step_that_only_recomputes_does_not_take_a_request_further():
    work = [(0, "A", 8), (1, "A", 9), (3, "A", 4), (4, "A", 9), (5, "A", 10), (0, "B", 3)]
    got = spans([("A", 0, 20), ("B", 0, 5), ("C", 2, 5)], work)
    assert [s.progress for s in got] == [(8, 9, 10), (3,), ()]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


def recorded(tiny, store: RunStore, requests: list[dict], **engine) -> tuple[str, dict[int, PoolSnapshot]]:
    snaps = {}
    wl = Workload.from_dict({"requests": requests, "engine": {"block_size": 4, "num_blocks": 40,
                                                               "max_batch_tokens": 24, **engine}})
    run = record_run(store, tiny, wl, on_step=lambda rec, _: snaps.__setitem__(rec.step, rec.snapshot))
    return run.result.run_id, snaps


def view(store: RunStore, run_id: str) -> dict[int, tuple[int, int]]:
    with store.read() as con:
        return {s: (live, alloc) for s, live, alloc in con.execute(
            "SELECT step, live_slots, allocated_slots FROM kv_slot_utilisation WHERE run_id = ?", [run_id]).fetchall()}


def computed_by_step_work(store: RunStore, run_id: str, step: int) -> int:
    """Positions computed by the requests holding blocks after `step`, from the recorded work alone."""
    with store.read() as con:
        return con.execute(
            "SELECT coalesce(sum(end_), 0) FROM (SELECT request_id, arg_max(start + tokens, step) AS end_ "
            "FROM step_work WHERE run_id = $1 AND step <= $2 GROUP BY request_id) "
            "WHERE request_id IN (SELECT request_id FROM page_tables WHERE run_id = $1 AND step = $2)",
            [run_id, step]).fetchone()[0]


def test_private_requests_hold_exactly_the_positions_they_computed(tiny, tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    run_id, snaps = recorded(tiny, store, [
        {"id": "A", "prompt_ids": list(range(100, 130)), "max_new_tokens": 9},
        {"id": "B", "prompt_ids": list(range(140, 161)), "max_new_tokens": 12, "arrival_step": 2}],
        prefix_caching=False)
    got = view(store, run_id)
    assert set(got) == set(snaps) and len(got) > 10
    for step, (live, allocated) in got.items():
        assert live == computed_by_step_work(store, run_id, step)
        assert allocated == sum(r > 0 for r in snaps[step].refcounts) * 4
        assert allocated - live < 4 * 2  # at most a partial last block each: paging wastes little


def test_a_shared_prefix_is_counted_once(tiny, tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    prompt = list(range(100, 132))  # eight full blocks of 4, cached by A and hit by B
    run_id, snaps = recorded(tiny, store, [{"id": "A", "prompt_ids": prompt, "max_new_tokens": 6},
                                           {"id": "B", "prompt_ids": prompt + [7], "max_new_tokens": 6,
                                            "arrival_step": 1}])
    got = view(store, run_id)
    both = [s for s in got if all(snaps[s].page_tables.get(r) for r in "AB")]
    assert both
    for step in both:
        assert got[step][0] == computed_by_step_work(store, run_id, step) - 32 == snaps[step].live_slots()


def test_run_memory_compares_the_pool_with_a_contiguous_replay(tiny, tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    run_id, _ = recorded(tiny, store, [
        {"id": "A", "prompt_ids": list(range(100, 140)), "max_new_tokens": 12},
        {"id": "B", "prompt_ids": list(range(100, 130)) + [7, 8, 9], "max_new_tokens": 30, "arrival_step": 1},
        {"id": "C", "parent": "A", "prompt_ids": [5, 6], "max_new_tokens": 5, "arrival_step": 3},
        {"id": "D", "prompt_ids": list(range(200, 245)), "max_new_tokens": 20, "arrival_step": 2}])
    with store.read() as con:
        mem = run_memory(con, run_id)
    assert mem.capacity == 160
    assert 0.9 < overall(mem.paged) <= 1 and overall(mem.contiguous.usage) < overall(mem.paged)
    assert len(mem.contiguous.usage) > len(mem.paged)  # requests waited for a region
    frame = mem.frame()
    assert set(frame.allocator) == {"paged", "contiguous"} and frame.waiting[frame.allocator == "paged"].isna().all()


def test_an_old_file_and_an_old_trace_have_no_counts_and_say_so(tiny, tmp_path):
    db = tmp_path / "k.duckdb"
    store = RunStore.open(db)
    run_id, _ = recorded(tiny, store, [{"id": "A", "prompt_ids": list(range(100, 120)), "max_new_tokens": 4}])
    trace = export_run(store, run_id, tmp_path / "t.kvviz")
    con = duckdb.connect(str(db))  # what a version 3 file looks like
    con.execute("DROP VIEW kv_slot_utilisation")
    con.execute("ALTER TABLE steps DROP COLUMN live_slots")
    con.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    con.close()
    with store.read() as con:  # upgraded in place: the column is there, empty
        assert con.execute("SELECT count(*), count(live_slots) FROM steps").fetchone()[0] > 0
        assert con.execute("SELECT count(live_slots) FROM steps").fetchone()[0] == 0
        assert run_memory(con, run_id) is None

    old = tmp_path / "old.kvviz"  # a trace written before the column existed
    with zipfile.ZipFile(trace) as src, zipfile.ZipFile(old, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "steps.parquet":
                buf = io.BytesIO()
                pq.write_table(pq.read_table(io.BytesIO(data)).drop(["live_slots"]), buf)
                data = buf.getvalue()
            dst.writestr(info, data)
    other = RunStore.open(tmp_path / "other.duckdb")
    imported = import_trace(old, other)
    with other.read() as con:
        assert run_memory(con, imported) is None
    again = import_trace(trace, RunStore.open(tmp_path / "third.duckdb"))
    with RunStore.open(tmp_path / "third.duckdb").read() as con:
        assert run_memory(con, again) is not None  # a current trace keeps the counts


def test_the_figure_draws_both_allocators_beside_the_article():
    from kvviz.analysis.memory import ARTICLE, MemoryComparison
    from kvviz.figures.blocks import memory_utilisation

    replay = contiguous_replay([RequestSpan("A", 0, 4, (1, 2, 3))], 8)
    fig = memory_utilisation(MemoryComparison([Usage(0, 3, 4), Usage(1, 4, 4)], replay, 8).frame(), ARTICLE, 1)
    names = [t.name for t in fig.data]
    assert names == ["paged", "contiguous", "contiguous: waiting"]
    assert list(fig.data[0].y) == [0.75, 1.0]
    assert sorted(s.y0 for s in fig.layout.shapes if s.y0 == s.y1) == [0.6, 0.9]  # the article's, dotted
    assert [a.text for a in fig.layout.annotations][1] == "requests waiting (contiguous): none waited"


def test_the_blocks_view_shows_the_comparison(tiny, tmp_path, monkeypatch):
    db = tmp_path / "k.duckdb"
    run_id, _ = recorded(tiny, RunStore.open(db), [
        {"id": "A", "prompt_ids": list(range(100, 140)), "max_new_tokens": 12},
        {"id": "B", "prompt_ids": list(range(150, 190)), "max_new_tokens": 12, "arrival_step": 1}])
    monkeypatch.setenv("KVVIZ_DB", str(db))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.session_state["run_id"] = run_id
    at.run()
    at.switch_page("kvviz/ui/pages/inspector.py").run()
    at.segmented_control(key="insp_view").set_value("Blocks").run()
    assert not at.exception
    assert "insp_memory" in {el.key for el in at.get("plotly_chart")}
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["paged"].endswith("%") and metrics["contiguous"].endswith("%")
    assert any("Contiguous: a replay" in c.value for c in at.caption)


def test_the_sharing_sweep_accounts_for_every_prefill_token(tiny):
    from kvviz.bench.sharing import NEW, PRIVATE, sweep

    n, length = 3, 128
    (p,) = sweep(tiny, (length,), n, progress=lambda s: None)
    prompt = length - NEW
    shared = length - PRIVATE - NEW  # 64: four full blocks of 16, computed once with caching on
    assert p.off.prefill_computed == p.off.prompt_tokens == n * prompt
    assert p.on.prefill_computed == prompt + (n - 1) * (prompt - shared)
    assert p.off.peak_blocks == n * (length // 16) and p.on.peak_blocks == shared // 16 + n * (PRIVATE + NEW) // 16
    assert p.memory_saved == pytest.approx(1 - 16 / 24) and p.shared_share == 0.5
    assert p.on.generated == p.off.generated == n * NEW


def test_the_memory_bench_measures_both_allocators(tiny):
    from kvviz.bench.memory import exact_workload, measure, memory_report

    reqs = exact_workload(tiny.config.vocab_size, 4, random.Random(0))
    r = measure(tiny, "exact-4", reqs)
    assert r.generated == sum(q.max_new_tokens for q in reqs)  # EOS ignored: exactly what was reserved
    assert 0.9 < r.paged_utilisation <= 1 and r.contiguous_utilisation < r.paged_utilisation
    assert r.capacity >= max(len(q.prompt_ids) + q.max_new_tokens for q in reqs)
    assert f"| exact-4 | 4 | {r.capacity} | {100 * r.paged_utilisation:.1f}% |" in memory_report(tiny, [r])




def test_the_cli_benchmarks_print_their_tables_and_refuse_bad_flags():
    p = kvviz("bench", "--model", "tiny-llama", "--memory", "--sizes", "4")
    assert p.returncode == 0, p.stderr
    assert "| chat-4 | 4 |" in p.stdout and "| exact-4 | 4 |" in p.stdout
    p = kvviz("bench", "--model", "tiny-llama", "--sharing-sweep", "--sizes", "2", "--lengths", "96")
    assert p.returncode == 0, p.stderr
    assert "| 96 | 33% |" in p.stdout and "article's gain" in p.stdout
    bad = kvviz("bench", "--model", "tiny-llama", "--sharing-sweep", "--lengths", "64")
    assert bad.returncode == 2 and "every length must exceed 64" in bad.stderr
    bad = kvviz("bench", "--model", "tiny-llama", "--memory", "--sizes", "4,x")
    assert bad.returncode == 2 and "--sizes takes positive integers" in bad.stderr
    both = kvviz("bench", "--memory", "--sharing-sweep")
    assert both.returncode == 2 and "not allowed with" in both.stderr
