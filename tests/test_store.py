"""The run store: a recorded run round-trips through DuckDB, failures are marked, and user SQL is
read-only and locked down."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet
import pytest

from kvviz.catalogue.scenarios import SCENARIOS
from kvviz.engine.workload import Workload
from kvviz.models import load_model
from kvviz.oracle import ProvenanceOracle
from kvviz.runners.checked import run_checked
from kvviz.runners.recorded import save_run
from kvviz.store import SCHEMA_VERSION, RunStore, SqlError, StoreError, run_query, schema
from kvviz.store.attention import AttentionRecorder, AttentionSelection
from kvviz.store.recorder import RunRecorder
from kvviz.util.ids import new_run_id
from tests.cli import finish, kvviz

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def tiny():
    return load_model("tiny-llama")


def record(db: Path, scenario: str, fault: str | None = None):
    m = tiny()
    wl = Workload.from_dict(SCENARIOS[scenario].build(m.tokenizer))
    run_id, oracle = new_run_id(), ProvenanceOracle()
    attention = AttentionRecorder(oracle, m.config.num_hidden_layers, AttentionSelection(full_layers=frozenset({1})))
    rec = RunRecorder(RunStore.open(db), run_id, model=m, workload=wl, scenario=scenario, fault=fault, oracle=oracle,
                      attention=attention, flush_every=3, flush_seconds=0)
    run = run_checked(m, wl, fault, on_step=rec.on_step, run_id=run_id, oracle=oracle, probes=[attention])
    save_run(rec, run)
    return run


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "kvviz.duckdb"
    record(path, "boundary", "boundary")
    record(path, "control_forks")
    return path


@pytest.fixture
def con(db):
    """A sandboxed reader of the module's store: what user SQL gets (RunStore.read)."""
    with RunStore.open(db).read() as c:
        yield c


def test_a_recorded_run_round_trips(db):
    con = duckdb.connect(str(db), read_only=True)
    runs = con.execute("SELECT run_id, status, scenario, fault, steps, findings, max_foreign_mass FROM runs "
                       "ORDER BY created_at").fetchall()
    assert [(r[1], r[2], r[3]) for r in runs] == [("complete", "boundary", "boundary"),
                                                  ("complete", "control_forks", None)]
    faulty, clean = runs[0][0], runs[1][0]
    assert runs[0][5] > 0 and runs[0][6] > 0 and runs[1][5] == 0 and runs[1][6] == 0
    for run_id, steps in ((faulty, runs[0][4]), (clean, runs[1][4])):
        assert con.execute("SELECT count(*) FROM steps WHERE run_id = ?", [run_id]).fetchone()[0] == steps
        blocks = con.execute("SELECT count(DISTINCT block) FROM blocks WHERE run_id = ?", [run_id]).fetchone()[0]
        assert con.execute("SELECT count(*) FROM blocks WHERE run_id = ?", [run_id]).fetchone()[0] == steps * blocks
    layers, heads = tiny().config.num_hidden_layers, tiny().config.num_attention_heads
    per_step = con.execute("SELECT count(*) FROM step_work WHERE run_id = ?", [faulty]).fetchone()[0]
    assert con.execute("SELECT count(*) FROM leak_metrics WHERE run_id = ?", [faulty]).fetchone()[0] == \
        per_step * layers * heads
    n_findings = con.execute("SELECT count(*) FROM findings WHERE run_id = ?", [faulty]).fetchone()[0]
    assert n_findings == runs[0][5]
    assert con.execute("SELECT count(*) FROM findings WHERE run_id = ?", [clean]).fetchone()[0] == 0
    kinds = {r[0] for r in con.execute("SELECT DISTINCT kind FROM block_events WHERE run_id = ?", [clean]).fetchall()}
    assert {"allocate", "share", "cow", "free"} <= kinds
    reqs = con.execute("SELECT request_id, output_ids FROM requests WHERE run_id = ? ORDER BY request_id",
                       [clean]).fetchall()
    assert [r[0] for r in reqs] == ["F", "G", "P"] and all(len(r[1]) > 0 for r in reqs)
    # the views answer the common questions
    assert con.execute("SELECT max(max_foreign_mass) FROM leak_rate_per_step WHERE run_id = ?",
                       [faulty]).fetchone()[0] == pytest.approx(runs[0][6], abs=1e-6)
    assert con.execute("SELECT count(*) FROM top_leaking_heads WHERE run_id = ?", [faulty]).fetchone()[0] == \
        layers * heads
    used = con.execute("SELECT max(used) FROM block_occupancy WHERE run_id = ?", [clean]).fetchone()[0]
    assert used > 0
    assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == SCHEMA_VERSION


def test_a_failed_run_is_marked_with_its_error_and_keeps_its_steps(tmp_path):
    m = tiny()
    wl = Workload.from_dict(SCENARIOS["control_forks"].workload)
    run_id, db = new_run_id(), tmp_path / "k.duckdb"
    rec = RunRecorder(RunStore.open(db), run_id, model=m, workload=wl, flush_every=1, flush_seconds=0)

    def on_step(r):
        rec.on_step(r)
        if r.step == 2:
            raise RuntimeError("power cut")

    with pytest.raises(RuntimeError):
        try:
            run_checked(m, wl, on_step=on_step, run_id=run_id)
        except RuntimeError as e:
            rec.fail(e)
            raise
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT status, error FROM runs").fetchone() == ("failed", "RuntimeError: power cut")
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 3
    # it can be shared: its trace (steps, no requests: they were never finished) imports elsewhere
    from kvviz.store.trace import export_run, import_trace

    con.close()
    trace = export_run(RunStore.open(db), run_id, tmp_path / "failed.zip")
    assert not (tmp_path / "failed.zip.partial").exists()
    assert import_trace(trace, RunStore.open(tmp_path / "other.duckdb")) == run_id
    con = duckdb.connect(str(tmp_path / "other.duckdb"), read_only=True)
    assert con.execute("SELECT status FROM runs").fetchone() == ("failed",)
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 3
    assert con.execute("SELECT count(*) FROM requests").fetchone()[0] == 0
    con.close()


def test_wrong_schema_version_is_refused(tmp_path):
    db = tmp_path / "k.duckdb"
    with RunStore.open(db).write():
        pass
    con = duckdb.connect(str(db))
    con.execute("UPDATE meta SET value = '999'")
    con.close()
    for connect in (RunStore.open(db).write, RunStore.open(db).read):
        with pytest.raises(StoreError, match="schema version 999"), connect():
            pass


def test_attention_rows_hold_weights_and_key_classes(db):
    con = duckdb.connect(str(db), read_only=True)
    faulty, clean = [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY created_at").fetchall()]
    heads = dict(con.execute("SELECT layer, list_sort(list(DISTINCT head)) FROM attention WHERE run_id = ? "
                             "GROUP BY layer", [clean]).fetchall())
    assert heads == {0: [-1], 1: [-1, 0, 1, 2, 3]}  # head mean everywhere, all heads of layer 1
    # every query's row sums to one over its own keys in the clean run; no foreign or stale key has weight
    sums = con.execute("SELECT min(list_sum(weights)), max(list_sum(weights)), "
                       "max(list_count(list_filter(key_classes, lambda c: c > 0))) FROM attention WHERE run_id = ?",
                       [clean]).fetchone()
    assert sums[0] == pytest.approx(1, abs=1e-4) and sums[1] == pytest.approx(1, abs=1e-4) and sums[2] == 0
    leaked = con.execute(
        "SELECT max(list_sum(list_transform(list_zip(weights, key_classes), lambda p: CASE WHEN p[2] = 1 THEN p[1] "
        "ELSE 0 END))) FROM attention WHERE run_id = ? AND head >= 0", [faulty]).fetchone()[0]
    worst = con.execute("SELECT max(max_foreign) FROM leak_metrics WHERE run_id = ?", [faulty]).fetchone()[0]
    con.close()
    assert leaked == pytest.approx(worst, abs=1e-5) and leaked > 0  # every head of a leaking layer was kept
    # one row per (step, layer, head, request, query position)
    con = duckdb.connect(str(db), read_only=True)
    dup = con.execute("SELECT count(*) - count(DISTINCT (step, layer, head, request_id, position)) FROM attention "
                      "WHERE run_id = ?", [clean]).fetchone()[0]
    con.close()
    assert dup == 0



def test_attention_rows_read_exactly_the_slots_their_page_tables_address(db):
    """A clean paged run: each recorded query read positions 0..its own, each through its page table."""
    con = duckdb.connect(str(db), read_only=True)
    clean, engine = con.execute("SELECT run_id, engine FROM runs WHERE fault IS NULL").fetchone()
    B = json.loads(engine)["block_size"]
    rows = con.execute(
        "WITH pt AS (SELECT step, request_id, list(physical_block ORDER BY logical_block) AS blocks "
        "FROM page_tables WHERE run_id = $1 GROUP BY ALL) "
        "SELECT a.position, a.key_slots, a.key_classes, pt.blocks FROM attention a JOIN pt USING (step, request_id) "
        "WHERE a.run_id = $1 AND a.head >= 0", [clean]).fetchall()
    con.close()
    assert len(rows) > 100
    for position, slots, classes, blocks in rows:
        assert slots == [blocks[i // B] * B + i % B for i in range(position + 1)]
        assert classes == [0] * (position + 1)

ALL_TABLES = ["runs", "attention", "slot_writes", "kv_events", "kv_cache_blocks", "requests", "steps", "step_work",
              "page_tables", "blocks", "block_events",
              "leak_metrics", "findings", "divergence", "leak_rate_per_step", "top_leaking_heads", "block_occupancy",
              "meta"]


def test_selects_over_every_table_and_view_work(con):
    for t in ALL_TABLES:
        res = run_query(con, f"SELECT * FROM {t} LIMIT 5")
        assert res.columns and not res.truncated
    res = run_query(con, "SELECT layer, head, max_foreign_mass FROM top_leaking_heads ORDER BY 3 DESC", max_rows=3)
    assert len(res.rows) == 3 and res.truncated
    assert run_query(con, "EXPLAIN SELECT 1").rows


HOSTILE = [
    ("SELECT * FROM read_csv('/etc/passwd')", None),
    ("SELECT * FROM read_text('/etc/passwd')", None),
    ("COPY runs TO '/tmp/kvviz-stolen.csv'", "not COPY"),
    ("ATTACH '/tmp/other.duckdb' AS o", "not ATTACH"),
    ("INSTALL httpfs", "not LOAD"),  # DuckDB files INSTALL under LOAD
    ("LOAD httpfs", "not LOAD"),
    ("DELETE FROM runs", "not DELETE"),
    ("UPDATE runs SET status = 'x'", "not UPDATE"),
    ("DROP TABLE runs", "not DROP"),
    ("SET enable_external_access = true", "not SET"),
    ("CREATE TABLE t AS SELECT 1", "not CREATE"),
    ("SELECT 1; DROP TABLE runs", "exactly one statement"),
    ("SELECT 1; SELECT 2", "exactly one statement"),
    ("DETACH kvviz", "not DETACH"),
    ("PRAGMA enable_external_access", None),
    ("SELECT * FROM sys.modules", None),
    ("SELCT oops", "cannot parse"),
]


@pytest.mark.parametrize("sql,message", HOSTILE)
def test_hostile_sql_is_refused_and_changes_nothing(con, sql, message):
    before = run_query(con, "SELECT count(*), min(status) FROM runs").rows
    with pytest.raises(SqlError) as err:
        run_query(con, sql)
    if message:
        assert message in str(err.value)
    assert run_query(con, "SELECT count(*), min(status) FROM runs").rows == before
    assert not Path("/tmp/kvviz-stolen.csv").exists()


def test_sql_cli_formats_and_refusals(db):
    def sql(*args):
        return kvviz("sql", *args, "--db", str(db))

    ok = sql("SELECT scenario, status FROM runs ORDER BY created_at", "--format", "csv")
    assert ok.returncode == 0 and ok.stdout.splitlines()[:2] == ["scenario,status", "boundary,complete"]
    refused = sql("DELETE FROM runs")
    assert refused.returncode == 2 and "only SELECT queries are allowed" in refused.stderr
    missing = kvviz("sql", "SELECT 1", "--db", "/nonexistent/k.duckdb")
    assert missing.returncode == 2 and "no database at" in missing.stderr


def test_replay_shows_a_step_and_verify_catches_tampering(tmp_path):
    db = tmp_path / "k.duckdb"
    p = kvviz("run", "--scenario", "boundary", "--model", "tiny-llama", "--db", str(db), "--json", "--quiet")
    assert p.returncode == 0, p.stderr
    run_id = json.loads(p.stdout.splitlines()[-1])["run_id"]
    shown = kvviz("replay", run_id, "--step", "1", "--db", str(db))
    assert shown.returncode == 0 and "page table" in shown.stdout and "finding foreign" in shown.stdout
    ok = kvviz("replay", run_id, "--verify", "--db", str(db))
    assert ok.returncode == 0 and "replays identically" in ok.stdout, ok.stdout + ok.stderr
    con = duckdb.connect(str(db))
    con.execute("UPDATE requests SET output_ids = list_concat([0], output_ids[2:]) WHERE request_id = 'A'")
    con.execute("UPDATE leak_metrics SET max_foreign = 0.5 WHERE step = 0 AND layer = 1 AND head = 2 "
                "AND request_id = 'A'")
    con.close()
    bad = kvviz("replay", run_id, "--verify", "--db", str(db))
    assert bad.returncode == 1
    assert "request A: generated token 0 differs" in bad.stdout
    assert "step 0, request A, layer 1, head 2: foreign mass recorded 0.5" in bad.stdout
    missing = kvviz("replay", "nope", "--db", str(db))
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_run_killed_midway_leaves_a_readable_database(tmp_path, sig):
    """SIGKILL: no chance to say anything, the run stays 'running'. Ctrl-C: marked failed, one line."""
    db, wl = tmp_path / "k.duckdb", tmp_path / "long.json"
    wl.write_text(json.dumps({"requests": [{"id": f"r{i}", "prompt": f"{i} a long run", "max_new_tokens": 950,
                                            "ignore_eos": True} for i in range(16)],
                              "engine": {"num_blocks": 1024}}))
    proc = subprocess.Popen([sys.executable, "-m", "kvviz", "run", "--workload", str(wl), "--model", "tiny-llama",
                             "--db", str(db), "--quiet"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    from kvviz.store import RunStore

    deadline, stored = time.time() + 120, 0
    while time.time() < deadline and stored < 2 and proc.poll() is None:  # wait until flushes have landed
        time.sleep(0.5)
        if db.exists():
            with RunStore.open(db).read() as con:
                stored = con.execute("SELECT count(*) FROM steps").fetchone()[0]
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    con = duckdb.connect(str(db), read_only=True)
    status, steps = con.execute("SELECT status, (SELECT count(*) FROM steps) FROM runs").fetchone()
    assert steps > 0  # its steps so far readable
    if sig == signal.SIGKILL:
        assert status == "running"  # shown as incomplete
    else:
        assert status == "failed" and proc.returncode == 130
        assert b"kvviz: interrupted" in err and b"Traceback" not in err, err[-2000:]
    assert con.execute("SELECT count(*) FROM blocks").fetchone()[0] > 0
    attention = con.execute("SELECT count(*) FROM attention").fetchone()[0]  # a part left open stays hidden
    assert attention > 0 or sig == signal.SIGKILL  # Ctrl-C closes the open part


def test_attention_rows_are_parquet_parts_beside_the_store(db, con):
    """A recorded run's attention rows are closed Parquet parts in attention/RUN_ID beside the file (none
    in the file itself, no part left open), and the view reads exactly their rows."""
    for (run,) in con.execute("SELECT run_id FROM runs").fetchall():
        folder = db.parent / "attention" / run
        parts = sorted(folder.iterdir())
        assert parts and all(p.suffix == ".parquet" and not p.name.startswith(".") for p in parts)
        in_files = sum(pa.parquet.read_metadata(p).num_rows for p in parts)
        assert con.execute("SELECT count(*) FROM attention WHERE run_id = ?", [run]).fetchone()[0] == in_files > 0
        assert con.execute("SELECT count(*) FROM attention_rows WHERE run_id = ?", [run]).fetchone()[0] == 0
    assert not schema.datasets_gone(con, RunStore.open(db).attention_dir)  # so a reader never writes to refresh


def test_a_store_moved_with_its_parts_reads_the_same_and_one_moved_alone_says_what_is_gone(db, tmp_path):
    """The parts are found beside the file wherever it lies: moved together, every attention row reads
    as before; the file copied without them still opens, its runs saying where their rows were."""
    query = "SELECT * FROM attention ORDER BY ALL"
    with RunStore.open(db).read() as con:
        want = con.execute(query).fetchall()
    together, alone = tmp_path / "together", tmp_path / "alone"
    shutil.copytree(db.parent, together, ignore=shutil.ignore_patterns("*.wal"))
    alone.mkdir()
    shutil.copy(db, alone / db.name)
    with RunStore.open(together / db.name).read() as con:
        assert con.execute(query).fetchall() == want
    with RunStore.open(alone / db.name).read() as con:
        assert con.execute("SELECT count(*) FROM attention").fetchone()[0] == 0
        errors = [e for (e,) in con.execute("SELECT error FROM runs ORDER BY run_id").fetchall()]
        assert len(errors) == 2 and all("attention rows are no longer at" in e for e in errors)
        assert con.execute("SELECT count(*) FROM steps").fetchone()[0] > 0  # the rest reads as before


def test_parts_closed_at_every_flush_hold_the_same_rows_as_one_part(tmp_path, monkeypatch):
    """PART_SECONDS only decides when rows become readable: a run whose every flush closes a part
    records the rows of a run written as one part."""
    from kvviz.store import attention_parts

    def rows(db):
        with RunStore.open(db).read() as con:
            return con.execute("SELECT * EXCLUDE (run_id) FROM attention ORDER BY ALL").fetchall()

    one, many = tmp_path / "one" / "k.duckdb", tmp_path / "many" / "k.duckdb"
    record(one, "boundary", "boundary")
    monkeypatch.setattr(attention_parts, "PART_SECONDS", 0.0)
    record(many, "boundary", "boundary")
    parts = [len(list((db.parent / "attention").glob("*/*.parquet"))) for db in (one, many)]
    assert parts[0] == 1 < parts[1]
    assert rows(one) == rows(many)


def test_the_slot_write_log_reproduces_provenance(con):
    """Replaying slot_writes and copy-on-write events up to a step gives, for every position of every
    request, a slot holding that position: its page table points at its own keys."""
    clean = con.execute("SELECT run_id FROM runs WHERE fault IS NULL").fetchone()[0]
    last = con.execute("SELECT max(step) FROM steps WHERE run_id = ?", [clean]).fetchone()[0]
    step, B = last // 2, 64  # control_forks uses 64-token blocks
    writer: dict[int, tuple] = {}
    for s in range(step + 1):
        for dst, src in con.execute("SELECT block, source FROM block_events WHERE run_id = ? AND step = ? AND "
                                    "kind = 'cow' ORDER BY seq", [clean, s]).fetchall():
            for k in range(B):  # copy-on-write happens before the step's writes
                if src * B + k in writer:
                    writer[dst * B + k] = writer[src * B + k]
        for slot, req, pos in con.execute("SELECT slot, request_id, position FROM slot_writes WHERE run_id = ? "
                                          "AND step = ?", [clean, s]).fetchall():
            writer[slot] = (req, pos)
    tables = con.execute("SELECT request_id, list(physical_block ORDER BY logical_block) FROM page_tables "
                         "WHERE run_id = ? AND step = ? GROUP BY request_id", [clean, step]).fetchall()
    work = dict(con.execute("SELECT request_id, max(start + tokens) FROM step_work WHERE run_id = ? AND step <= ? "
                            "GROUP BY request_id", [clean, step]).fetchall())
    checked = 0
    for req, table in tables:
        for pos in range(work[req]):
            slot = table[pos // B] * B + pos % B
            assert writer[slot][1] == pos  # the slot holds this position (written by this request or a parent)
            checked += 1
    assert checked > 0


def test_the_database_can_be_read_between_flushes(tmp_path):
    """The recorder holds the file only while it writes, so a reader opens it mid-run."""
    m = tiny()
    wl = Workload.from_dict(SCENARIOS["control_forks"].workload)
    db, seen = tmp_path / "k.duckdb", []
    rec = RunRecorder(RunStore.open(db), new_run_id(), model=m, workload=wl, flush_every=2, flush_seconds=0,
                      background=False)

    def on_step(r):
        rec.on_step(r)
        if r.step == 5:
            con = duckdb.connect(str(db), read_only=True)
            seen.append(con.execute("SELECT status, (SELECT count(*) FROM steps) FROM runs").fetchone())
            con.close()

    run = run_checked(m, wl, on_step=on_step)
    save_run(rec, run)
    assert seen == [("running", 6)]


def test_attention_selection_by_request_step_and_layer(tmp_path):
    db = tmp_path / "k.duckdb"
    p = kvviz("run", "--scenario", "passphrase", "--model", "tiny-llama", "--db", str(db), "--quiet",
              "--attention-requests", "B", "--attention-steps", "1,2", "--attention-layers", "0")
    assert p.returncode == 0, p.stderr
    con = duckdb.connect(str(db), read_only=True)
    got = con.execute("SELECT list(DISTINCT request_id), list(DISTINCT step ORDER BY step), "
                      "list(DISTINCT head ORDER BY head) FILTER (layer = 1) FROM attention").fetchone()
    assert got == (["B"], [1, 2], [-1])
    assert con.execute("SELECT list(DISTINCT head ORDER BY head) FROM attention WHERE layer = 0").fetchone()[0] == \
        [-1, 0, 1, 2, 3]


@pytest.mark.slow
def test_another_process_reads_all_through_a_recording_run(tmp_path):
    """What the UI does while `kvviz run` records in another process: every read succeeds (a reader
    waits out a flush, and the recorder waits out a reader), and it sees the run grow."""
    from kvviz.store import RunStore

    db, wl = tmp_path / "k.duckdb", tmp_path / "w.json"
    wl.write_text(json.dumps({"requests": [{"id": f"r{i}", "prompt": "one two three " * (i + 1),
                                            "max_new_tokens": 400, "ignore_eos": True} for i in range(6)],
                              "engine": {"block_size": 4, "num_blocks": 800}}))
    # ~400 steps: several flushes 2 s apart even on a fast machine (at 120 steps a busy CI machine's
    # writer, which yields to the engine, wrote its one mid-run flush just before the end, and a reader
    # polling ten times a second missed it)
    proc = subprocess.Popen([sys.executable, "-m", "kvviz", "run", "--workload", str(wl), "--model", "tiny-llama",
                             "--db", str(db), "--quiet"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen, deadline = [], time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if db.exists():
            with RunStore.open(db).read() as con:
                seen.append(con.execute("SELECT status, (SELECT count(*) FROM steps) FROM runs").fetchall())
        time.sleep(0.1)  # a page that redraws ten times a second
    _, err = finish(proc, 1)
    assert proc.returncode == 0, err
    with RunStore.open(db).read() as con:
        final = con.execute("SELECT status, steps FROM runs").fetchall()
    assert final[0][0] == "complete", final
    mid = [s[0] for s in seen if s]
    assert any(status == "running" and 0 < n for status, n in mid), (final, mid)
    counts = [n for _, n in mid]
    assert counts == sorted(counts), f"a reader never sees steps disappear: {mid}"


@pytest.mark.parametrize("fault, kind", [("boundary", "foreign"), ("unsalted_prefix", "cross_tenant")])
def test_default_recording_keeps_every_head_where_a_leak_was_seen(tmp_path, fault, kind):
    """A finding's own head can always be shown; a cross-tenant read (every layer, no one head) has
    every head of every layer kept at each of its steps; a clean run keeps only the default layers'
    heads."""
    from kvviz.runners import live

    m = tiny()
    db = tmp_path / "k.duckdb"
    wl = live.scenario_workload(fault, m)
    faulty = live.run(RunStore.open(db), m, wl, fault,
                      selection=AttentionSelection(full_layers=frozenset())).run_id
    clean = live.run(RunStore.open(db), m, wl, None, selection=AttentionSelection(full_layers=frozenset())).run_id
    con = duckdb.connect(str(db), read_only=True)
    findings = con.execute("SELECT request_id, step, last_step, layer, head FROM findings WHERE run_id = ? AND "
                           "kind = ?", [faulty, kind]).fetchall()
    cells = con.execute("SELECT count(DISTINCT (layer, head)) FROM leak_metrics WHERE run_id = ?",
                        [faulty]).fetchone()[0]
    assert findings
    for request, step, last_step, layer, head in findings:
        if kind == "cross_tenant":
            assert layer is None and head is None
            for s in range(step, last_step + 1):
                assert con.execute("SELECT count(DISTINCT (layer, head)) FROM attention WHERE run_id = ? AND "
                                   "request_id = ? AND step = ? AND head >= 0", [faulty, request, s]).fetchone()[0] \
                    == cells
        else:
            assert con.execute("SELECT count(*) FROM attention WHERE run_id = ? AND step = ? AND layer = ? AND "
                               "head = ?", [faulty, step, layer, head]).fetchone()[0] > 0
    assert con.execute("SELECT list(DISTINCT head) FROM attention WHERE run_id = ?", [clean]).fetchone()[0] == [-1]


def test_a_version_1_store_is_upgraded_in_place_and_keeps_its_runs(tmp_path):
    db = tmp_path / "v1.duckdb"
    record(db, "boundary", "boundary")
    con = duckdb.connect(str(db))
    con.execute("DROP TABLE token_text")  # what a version 1 file lacks
    con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    runs_before = con.execute("SELECT count(*) FROM runs").fetchone()[0]
    con.close()
    with RunStore.open(db).read() as con:  # a reader upgrades it as well as a writer would
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == SCHEMA_VERSION
        assert con.execute("SELECT count(*) FROM token_text").fetchone()[0] == 0
        assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == runs_before == 1


def test_a_version_12_store_keeps_its_whole_attention_rows_and_records_new_ones_split(tmp_path):
    """Version 12 kept every row's keys in the table `attention`: the upgrade renames it to
    attention_rows, under the view that joins attention_keys, and the old rows read as before; a new
    run's rows are Parquet parts with null key lists, the view joining their keys back."""
    db = tmp_path / "v12.duckdb"
    record(db, "boundary", "boundary")
    con = duckdb.connect(str(db))
    (old,) = con.execute("SELECT run_id FROM runs").fetchone()
    want = con.execute("SELECT * FROM attention ORDER BY ALL").fetchall()
    con.execute("CREATE TABLE whole AS SELECT * FROM attention")
    con.execute("DROP VIEW attention")
    con.execute("DROP TABLE attention_rows")
    con.execute("DROP TABLE attention_keys")
    con.execute("DROP TABLE attention_parts")  # version 12 wrote every row into the file
    con.execute("ALTER TABLE whole RENAME TO attention")
    con.execute("UPDATE meta SET value = '12' WHERE key = 'schema_version'")
    con.close()
    record(db, "boundary", "boundary")
    with RunStore.open(db).read() as con:
        (new,) = con.execute("SELECT run_id FROM runs WHERE run_id <> ?", [old]).fetchone()
        assert con.execute("SELECT * FROM attention WHERE run_id = ? ORDER BY ALL", [old]).fetchall() == want
        assert con.execute("SELECT count(*) FILTER (key_slots IS NULL), count(*) FROM attention_rows WHERE run_id = ?",
                           [old]).fetchone()[0] == 0
        parts = str(tmp_path / "attention" / new / "*.parquet")  # a new run's rows: Parquet parts beside the file
        shared, rows = con.execute("SELECT count(*) FILTER (key_slots IS NULL), count(*) FROM read_parquet(?)",
                                   [parts]).fetchone()
        assert 0 < shared == rows
        assert con.execute("SELECT count(*) FROM attention WHERE run_id = ? AND key_slots IS NULL",
                           [new]).fetchone()[0] == 0


def test_only_the_run_store_opens_the_file():
    """RunStore owns every connection: no other module of kvviz calls duckdb.connect."""
    openers = [str(p.relative_to(ROOT)) for p in (ROOT / "kvviz").rglob("*.py")
               if "duckdb.connect(" in p.read_text()]
    assert openers == ["kvviz/store/run_store.py"]


def test_rows_are_cast_to_the_declared_types_or_refused_by_column(tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    with store.write() as con:
        store.insert(con, "steps", pa.table({"run_id": ["r"], "step": [1.0], "free_blocks": ["7"]}))
        assert con.execute("SELECT typeof(step), free_blocks FROM steps").fetchall() == [("INTEGER", 7)]
        with pytest.raises(StoreError, match="steps.free_blocks"):
            store.insert(con, "steps", pa.table({"run_id": ["r"], "free_blocks": ["seven"]}))
        with pytest.raises(StoreError, match="no column 'colour'"):
            store.insert(con, "steps", pa.table({"run_id": ["r"], "colour": ["red"]}))


def test_a_run_deleted_while_it_records_stops_writing_and_says_so(tmp_path):
    """Another session deletes a run that is still recording: the recorder writes no orphan rows and
    the run ends with the reason, instead of reporting success for a run that no longer exists."""
    from kvviz.analysis import runs
    from kvviz.runners.recorded import record_run

    m, store = tiny(), RunStore.open(tmp_path / "k.duckdb")
    wl = Workload.from_dict(SCENARIOS["control_forks"].workload)

    def delete_at_step_2(rec, _oracle):
        if rec.step == 2:
            with store.read() as con:
                run_id = con.execute("SELECT run_id FROM runs").fetchone()[0]
            runs.delete_run(store, run_id)

    with pytest.raises(StoreError, match="was deleted .* while it was recording"):
        record_run(store, m, wl, on_step=delete_at_step_2)
    with store.read() as con:
        left = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in runs.run_tables(con)}
    assert set(left.values()) == {0}, left


@pytest.mark.parametrize(
    "sql,said",
    [
        ("SELECT nope FROM runs", 'Referenced column "nope" not found in FROM clause; Candidate bindings:'),
        ("SELECT * FROM runz", 'Table with name runz does not exist; Did you mean "runs"?'),
        ("SELECT * FROM tabls", "Table with name tabls does not exist (line 1"),  # not DuckDB's own pg_tablespace
    ],
)
def test_sql_errors_read_as_a_sentence_without_duckdbs_stage_names(sql, said):
    con = duckdb.connect()
    con.execute("CREATE TABLE runs (run_id VARCHAR, status VARCHAR)")
    with pytest.raises(SqlError) as err:
        run_query(con, sql)
    message = str(err.value)
    assert message.startswith(said), message
    assert "Error:" not in message and "!" not in message
