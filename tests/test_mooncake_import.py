"""Mooncake traces (hash ids without tokens) imported as capture runs: the rows counted by hand on a
small trace written here, the capture views' hit figures, explain on a capture without tokens, the
upload path telling a trace from a vLLM capture, every refusal naming its line with nothing imported,
and the public conversation trace where ../shared/traces has it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvviz.analysis import capture_time, captures
from kvviz.analysis.explained import explained
from kvviz.capture.dataset import MANIFEST
from kvviz.capture.events import CaptureError
from kvviz.capture.mooncake import is_mooncake
from kvviz.runners.uploads import earlier_import, import_file
from kvviz.store import RunStore
from tests.cli import kvviz

TRACES = Path("/work/shared/traces")
B = 512

# A shared first block, a conversation of three turns (each the whole chain before it, and more), a
# request whose last block is partial, one shorter than a block, and one served entirely from cache.
REQUESTS = [
    {"timestamp": 0, "input_length": 3 * B, "output_length": 10, "hash_ids": [1, 2, 3]},  # cold: 3 new
    {"timestamp": 1000, "input_length": 2 * B + 176, "output_length": 5, "hash_ids": [1, 4, 5]},  # 5 is partial
    {"timestamp": 2000, "input_length": 4 * B + 100, "output_length": 7, "hash_ids": [1, 2, 3, 6, 7]},  # turn 2: 3 hits
    {"timestamp": 2000, "input_length": 300, "output_length": 1, "hash_ids": [8]},  # no full block: a message alone
    {"timestamp": 3500, "input_length": 5 * B, "output_length": 9, "hash_ids": [1, 2, 3, 6, 9]},  # turn 3: 4 hits
    {"timestamp": 4000, "input_length": 2 * B, "output_length": 2, "hash_ids": [1, 2]},  # all from cache
]
BLOCKS, HITS = 3 + 2 + 4 + 0 + 5 + 2, 0 + 1 + 3 + 0 + 4 + 2  # full blocks, and those an earlier request stored


def write_trace(path: Path, requests: list[dict] = REQUESTS, extra: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests) + extra)
    return path


@pytest.fixture
def imported(tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    trace = write_trace(tmp_path / "trace.jsonl")
    return store, import_file(trace, store, sha256=earlier_import(trace, store).sha256), trace


def rows(store: RunStore, run_id: str, query: str) -> list[tuple]:
    with store.read() as con:
        return con.execute(query.replace("$run", f"'{run_id}'")).fetchall()


def test_a_trace_becomes_a_capture_dataset_counted_by_hand(imported):
    store, run_id, _ = imported
    folder = store.captures_dir / run_id
    manifest = json.loads((folder / MANIFEST).read_text())
    assert (manifest["replicas"], manifest["messages"], manifest["complete"]) == ({"mooncake": ""}, 6, True)
    part = pq.read_table(folder / "replica=mooncake" / "part-00000.parquet")
    assert part.num_rows == BLOCKS + 1, "a row for every full block, and one for the request without any"
    empty = [r for r in part.to_pylist() if r["kind"] is None]
    assert [(r["step"], r["ts"], r["block_hash"]) for r in empty] == [(3, 2.0, None)]
    (status, steps, workload), = rows(store, run_id, "SELECT status, steps, workload FROM runs WHERE run_id = $run")
    workload = json.loads(workload)
    assert (status, steps) == ("complete", 6)
    assert {k: workload[k] for k in ("capture", "format", "block_size", "requests", "blocks", "files")} == {
        "capture": "trace.jsonl", "format": "mooncake", "block_size": B, "requests": 6, "blocks": BLOCKS, "files": 1}
    assert len(workload["sha256"]) == 64
    got = rows(store, run_id, "SELECT step, ts, event_index, block_index, block_hash, parent_hash, repeat, "
                              "reuse_gap_s FROM kv_events WHERE run_id = $run ORDER BY step, event_index, block_index")
    assert got == [  # one event a request: its whole chain, the hits first
        (0, 0.0, 0, 0, 1, None, False, None), (0, 0.0, 0, 1, 2, 1, False, None), (0, 0.0, 0, 2, 3, 2, False, None),
        (1, 1.0, 0, 0, 1, None, True, 1.0), (1, 1.0, 0, 1, 4, 1, False, None),
        (2, 2.0, 0, 0, 1, None, True, 1.0), (2, 2.0, 0, 1, 2, 1, True, 2.0), (2, 2.0, 0, 2, 3, 2, True, 2.0),
        (2, 2.0, 0, 3, 6, 3, False, None),
        (4, 3.5, 0, 0, 1, None, True, 1.5), (4, 3.5, 0, 1, 2, 1, True, 1.5), (4, 3.5, 0, 2, 3, 2, True, 1.5),
        (4, 3.5, 0, 3, 6, 3, True, 1.5), (4, 3.5, 0, 4, 9, 6, False, None),
        (5, 4.0, 0, 0, 1, None, True, 0.5), (5, 4.0, 0, 1, 2, 1, True, 0.5)]
    (kinds, sizes, media, tokens, salts, named, lives), = rows(
        store, run_id, "SELECT list(DISTINCT kind), list(DISTINCT block_size), list(DISTINCT medium), "
                       "count(token_ids), count(salt), list(DISTINCT salt_named), count(lifetime_s) + count(idle_s) "
                       "FROM kv_events WHERE run_id = $run")
    assert (kinds, sizes, media, tokens, salts, named, lives) == (["BlockStored"], [B], ["GPU"], 0, 0, [False], 0)
    assert rows(store, run_id, "SELECT DISTINCT replica, restart FROM kv_events WHERE run_id = $run") == [
        ("mooncake", 0)]


def test_the_capture_views_count_the_unbounded_caches_hits(imported):
    store, run_id, _ = imported
    with store.read() as con:
        span = capture_time.span(con, run_id)
        assert (span.start, span.end) == (0.0, 4.0)
        churn = capture_time.churn(con, run_id, span.start, span.end, capture_time.interval_s(span.start, span.end))
        assert capture_time.reports_hits(con, run_id)
    total = churn.sum(numeric_only=True)
    # the Activity view: 6 new blocks, 10 hits, nothing evicted, hit rate (tokens) 10 / 16
    assert (total.stored, total.hits, total.evicted) == (BLOCKS - HITS, HITS, 0)
    assert (total.hit_tokens, total.miss_tokens) == (HITS * B, (BLOCKS - HITS) * B)
    assert total.hit_tokens / (total.hit_tokens + total.miss_tokens) == 0.625
    assert rows(store, run_id, "SELECT replica, tokens, hit_tokens, hit_rate FROM hit_rate_per_interval "
                               "WHERE run_id = $run") == [("mooncake", BLOCKS * B, HITS * B, 0.625)]
    # nothing is evicted: the cache holds every distinct block at the end
    assert rows(store, run_id, "SELECT max(cached_blocks) FROM kv_cache_blocks WHERE run_id = $run") == [(6,)]
    with store.read() as con:  # the prefix tree's segments count 512 tokens a block though none are known
        tree = captures.reuse_tree(con, run_id, span.start, span.end)
    assert sorted(zip(tree["first"], tree.blocks, tree.tokens, tree.uses, strict=True)) == [
        (f"{1:016x}", 1, B, 5), (f"{2:016x}", 4, 4 * B, 4), (f"{4:016x}", 1, B, 1)]


def test_explain_says_what_a_trace_without_tokens_can_tell(imported):
    """Each request that stored a new block is a lookup: its hits and the block it stopped at, counted in
    512-token blocks; with no evictions and no tokens every miss is cold (never diverged, evicted or
    'cached when it ran'); requests that stored nothing are no lookups."""
    store, run_id, _ = imported
    said = [(e.request, e.step, e.hit_tokens, e.stop_block, e.reason, e.evidence) for e in explained(store, run_id)]
    assert said == [(f"chain-{1:016x}", 0, 0, 0, "cold", {"new_from_token": 0}),
                    (f"chain-{4:016x}", 1, B, 1, "cold", {"new_from_token": B}),
                    (f"chain-{6:016x}", 2, 3 * B, 3, "cold", {"new_from_token": 3 * B}),
                    (f"chain-{9:016x}", 4, 4 * B, 4, "cold", {"new_from_token": 4 * B})]
    p = kvviz("explain", run_id, "--db", store.path, "--summary")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["reason", "lookups", "share", "cold", "4", "100.0%"]
    assert "contradict" not in p.stderr


def test_the_cli_imports_a_trace_once(tmp_path):
    trace, db = write_trace(tmp_path / "trace.jsonl"), tmp_path / "k.duckdb"
    p = kvviz("import", trace, "--db", db)
    assert p.returncode == 0, p.stderr
    run_id = p.stdout.split()[-1]
    assert f"imported {BLOCKS} block events from 6 messages of 1 replica" in p.stderr
    again = kvviz("import", trace, "--db", db)
    assert again.returncode == 0 and again.stdout.split()[-1] == run_id
    assert f"was imported before, as run {run_id}" in again.stderr
    assert earlier_import(trace, RunStore.open(db)).run_id == run_id
    assert kvviz("import", trace, "--db", db, "--again").stdout.split()[-1] != run_id


def test_a_trace_is_told_from_a_vllm_capture_by_content(tmp_path):
    from kvviz.capture.capture_file import CaptureWriter, Message
    from tests.test_capture import batch, stored_map

    capture = tmp_path / "c.jsonl"
    w = CaptureWriter(capture, {"replica-0": "x"})
    w.add(Message("replica-0", 0, 0, "kv", batch(stored_map([1], None, [10, 11]))))
    w.close()
    assert not is_mooncake(capture)
    assert is_mooncake(write_trace(tmp_path / "t.txt", extra="\n"))  # any name; a blank line is no line
    (tmp_path / "lead.jsonl").write_text("\n  \n" + json.dumps(REQUESTS[0]) + "\n")
    assert is_mooncake(tmp_path / "lead.jsonl")
    assert not is_mooncake(write_trace(tmp_path / "v1.jsonl", [{"seq": 0, "payload": "", "hash_ids": []}]))
    store = RunStore.open(tmp_path / "k.duckdb")
    assert rows(store, import_file(capture, store), "SELECT DISTINCT replica FROM kv_events WHERE run_id = $run") == [
        ("replica-0",)]


BAD = [  # (lines after the first good one, what the refusal says)
    ('{"timestamp": 5, "input_length": 10, "output_length": 1}', "line 2: hash_ids is missing"),
    ('{"timestamp": 5, "input_length": -5, "output_length": 1, "hash_ids": []}',
     "line 2: input_length is -5, a length cannot be negative"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "line 2: timestamp -1 goes back"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}',
     "line 2: hash_ids has 3 blocks, more than the 2 that input_length 600 needs"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1, "2"]}',
     "line 2: hash_ids must hold only integers"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [18446744073709551616]}',
     "line 2: hash_ids holds an id that does not fit in 64 bits"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 6, "input_',
     "line 3: not valid JSON"),
    ('\n[1, 2]', "line 3: not a JSON object"),
    ('{"timestamp": 5, "input_length": 1.5, "output_length": 1, "hash_ids": []}',
     "line 2: input_length must be an integer"),
]


def nothing_imported(store: RunStore, db: Path) -> None:
    if db.exists():
        assert rows(store, "", "SELECT count(*) FROM runs") == [(0,)]
        assert rows(store, "", "SELECT count(*) FROM kv_event_rows") == [(0,)]
    assert not any(store.captures_dir.glob("*")) if store.captures_dir.exists() else True


@pytest.mark.parametrize(("lines", "said"), BAD, ids=[s.split(": ", 1)[1][:24] for _, s in BAD])
def test_a_bad_line_anywhere_is_refused_naming_it_and_imports_nothing(tmp_path, lines, said):
    trace = write_trace(tmp_path / "trace.jsonl", REQUESTS[:1], lines + "\n")
    db = tmp_path / "k.duckdb"
    p = kvviz("import", trace, "--db", db)
    assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, p.stderr
    store = RunStore.open(db)
    nothing_imported(store, db)
    with pytest.raises(CaptureError, match=said.split(": ", 1)[1][:30].replace("(", r"\(")):
        import_file(trace, store)
    nothing_imported(store, db)


def test_a_partly_valid_trace_and_an_empty_file_import_nothing(tmp_path):
    """The last of many good lines goes back in time: no run, no dataset; an empty file is refused."""
    good = [dict(r, timestamp=r["timestamp"] + 10_000 * i) for i in range(20) for r in REQUESTS]
    trace = write_trace(tmp_path / "trace.jsonl", good, json.dumps(dict(REQUESTS[0], timestamp=1)) + "\n")
    db = tmp_path / "k.duckdb"
    p = kvviz("import", trace, "--db", db)
    assert p.returncode == 2 and f"line {len(good) + 1}: timestamp 1 goes back" in p.stderr, p.stderr
    store = RunStore.open(db)
    with pytest.raises(CaptureError, match="goes back"):
        import_file(trace, store, sha256="0" * 64)
    nothing_imported(store, db)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    p = kvviz("import", tmp_path / "empty.jsonl", "--db", db)
    assert p.returncode == 2 and "the file is empty" in p.stderr
    with pytest.raises(CaptureError, match="the file is empty"):
        import_file(tmp_path / "empty.jsonl", store)
    nothing_imported(store, db)


def test_a_failure_while_writing_leaves_no_run_and_no_files(tmp_path, monkeypatch):
    from kvviz.capture import mooncake

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(mooncake, "write_manifest", broken)
    store = RunStore.open(tmp_path / "k.duckdb")
    with pytest.raises(OSError, match="disk full"):
        import_file(write_trace(tmp_path / "trace.jsonl"), store)
    nothing_imported(store, store.path)


@pytest.mark.spark
def test_spark_explains_a_trace_without_tokens_as_duckdb_does(tmp_path, spark, imported):
    from kvviz.capture import explain_sql
    from tests.test_explain_sql import duck_explain, normalise

    store, run_id, _ = imported
    folder = store.captures_dir / run_id
    want = duck_explain(folder)
    spark.read.parquet(str(folder)).createOrReplaceTempView("capture_events")
    sql = explain_sql.SparkSql(spark)
    explain_sql.capture_inputs(sql.table)
    explain_sql.explain(sql)
    got = sql.rows(f"SELECT {', '.join(explain_sql.RESULT_COLUMNS)} FROM explain_result")
    assert normalise(got) == normalise(want) and len(want) == 4


@pytest.mark.skipif(not TRACES.is_dir(), reason="the public Mooncake traces are in ../shared/traces only")
def test_the_public_conversation_trace_imports_in_seconds(tmp_path):
    from kvviz.whatif import read_mooncake

    path = TRACES / "conversation_trace.jsonl"
    store = RunStore.open(tmp_path / "k.duckdb")
    started = time.perf_counter()
    run_id = import_file(path, store)
    took = time.perf_counter() - started
    trace = read_mooncake(path)
    (events, hits, messages), = rows(store, run_id, "SELECT count(*), count(*) FILTER (repeat), count(DISTINCT step) "
                                                    "FROM kv_events WHERE run_id = $run")
    assert (events, messages) == (276_491, 12_031) == (trace.lookups, trace.requests)
    assert hits == trace.lookups - trace.distinct_blocks, "the unbounded cache's hits, as the what-if replay counts"
    assert took < 10, f"{took:.1f} s"


def test_a_trace_of_short_requests_and_a_long_one_in_parts(tmp_path, monkeypatch):
    """Requests without a full block are messages alone (none of their rows is an event); a trace past
    a part's rows is written in several parts, as a capture rotates them, and read as one."""
    from kvviz.capture import mooncake

    store = RunStore.open(tmp_path / "k.duckdb")
    short = [{"timestamp": i, "input_length": 511, "output_length": 1, "hash_ids": [i]} for i in range(3)]
    run_id = import_file(write_trace(tmp_path / "short.jsonl", short), store)
    assert pq.read_table(store.captures_dir / run_id).num_rows == 3
    assert rows(store, run_id, "SELECT status, steps, (SELECT count(*) FROM kv_events WHERE run_id = $run) "
                               "FROM runs WHERE run_id = $run") == [("complete", 3, 0)]
    monkeypatch.setattr(mooncake, "PART_ROWS", 5)
    monkeypatch.setattr(mooncake, "GROUP_ROWS", 2)
    run_id = import_file(write_trace(tmp_path / "trace.jsonl"), store)
    parts = sorted((store.captures_dir / run_id / "replica=mooncake").iterdir())
    assert [p.name for p in parts] == [f"part-{i:05d}.parquet" for i in range(4)]  # 17 rows, 5 a part
    assert {pq.ParquetFile(p).metadata.row_group(0).num_rows for p in parts} == {2}
    assert rows(store, run_id, "SELECT count(*), count(*) FILTER (repeat) FROM kv_events WHERE run_id = $run") == [
        (BLOCKS, HITS)]


def test_the_inspector_says_what_an_imported_request_trace_is_and_replays_it(tmp_path, monkeypatch):
    from .apptest import AppTest

    store = RunStore.open(tmp_path / "k.duckdb")
    rid = import_file(write_trace(tmp_path / "t.jsonl"), store)
    monkeypatch.setenv("KVVIZ_DB", str(store.path))
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=60)
    at.session_state["run_id"] = rid
    at.run()
    at.switch_page("kvviz/ui/pages/inspector.py").run()
    assert any("imported request trace (Mooncake's format)" in i.value for i in at.info)
    assert any("from the trace's start" in c.value for c in at.caption)  # not 1970 on a publisher's clock
    at.segmented_control(key="insp_view").set_value("What if").run()
    at.button(key="wi_go").click().run()
    assert not at.exception
    # unbounded, every policy serves the blocks an earlier request stored: HITS of them, 512 tokens each
    with store.read() as con:
        hits = con.execute("SELECT DISTINCT hits FROM whatif_points WHERE run_id = ? AND capacity = "
                           "(SELECT max(capacity) FROM whatif_points WHERE run_id = ?)", [rid, rid]).fetchall()
    assert hits == [(HITS,)]
    assert any("an unbounded cache" in m.value and "this run's cache" not in m.value for m in at.markdown)


def test_what_if_on_an_imported_trace_counts_its_prompt_tokens_as_the_file_replay_does(tmp_path):
    """The capture keeps full blocks only; the share is still of every prompt token, partial blocks too,
    so `whatif RUN` on the import and `whatif FILE` agree."""
    from kvviz.analysis.runs import run_info
    from kvviz.analysis.whatif_runs import compute
    from kvviz.whatif import curve, read_mooncake

    path = write_trace(tmp_path / "t.jsonl")
    store = RunStore.open(tmp_path / "k.duckdb")
    rid = import_file(path, store)
    with store.read() as con:
        info = run_info(con, rid)
    imported = compute(store, info, ["lru"], points=4)
    direct = curve(read_mooncake(path), ["lru"], [p.capacity for p in imported])
    assert [(p.hits, p.prompt_tokens, p.hit_rate) for p in imported] == [(p.hits, p.prompt_tokens, p.hit_rate)
                                                                        for p in direct]
