"""A JSONL capture decoded by several processes, each taking chunks of lines in turn: the same rows as one
process, the same error (the earliest bad line, whichever process finds it), nothing left behind
when anything fails, and callable from a user's script without a main guard."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import msgpack
import pytest

from kvviz.capture.capture_file import CaptureWriter, Message
from kvviz.capture.dataset import MANIFEST
from kvviz.capture.events import CaptureError
from kvviz.capture.import_vllm import import_capture
from kvviz.capture.synthetic import fleet_messages
from kvviz.store import RunStore

ROWS = "SELECT * EXCLUDE (run_id) FROM kv_events WHERE run_id = ? ORDER BY step, event_index, block_index"


def fleet_capture(path: Path, events: int = 6000) -> Path:
    """Three replicas, the header naming two; one restarts its publisher and one clears its cache."""
    w = CaptureWriter(path, {"replica-0": "tcp://a", "replica-1": "tcp://b"})
    for i, m in enumerate(fleet_messages(events, replicas=3, capacity=64)):
        restart = int(m.replica == "replica-2" and i > 300)
        w.add(Message(m.replica, restart, m.seq, m.topic, m.payload, m.received))
        if i == 500:
            w.add(Message("replica-1", 0, 10_000, "kv-events", msgpack.packb([2e9, [{"type": "AllBlocksCleared"}], 0])))
    w.close()
    return path


def imported(store: RunStore, run: str) -> tuple[list, tuple]:
    with store.read() as con:
        return (con.execute(ROWS, [run]).fetchall(),
                con.execute("SELECT steps, findings, status FROM runs WHERE run_id = ?", [run]).fetchone())


def test_an_import_split_over_processes_writes_the_rows_of_one(tmp_path):
    cap = fleet_capture(tmp_path / "c.jsonl")
    store = RunStore.open(tmp_path / "k.duckdb")
    said = []
    runs = {n: import_capture(cap, store, progress=lambda done, total: said.append((done, total)), workers=n)
            for n in (1, 2, 3)}
    one, one_run = imported(store, runs[1])
    assert len(one) > 6000 and one_run[2] == "complete"
    with store.read() as con:
        assert con.execute("SELECT list(DISTINCT replica ORDER BY replica) FROM kv_events WHERE run_id = ?",
                           [runs[1]]).fetchone()[0] == ["replica-0", "replica-1", "replica-2"]
    for n in (2, 3):
        rows, run = imported(store, runs[n])
        assert run == one_run and rows == one, f"{n} processes wrote what one does"
    for manifest in store.captures_dir.glob(f"*/{MANIFEST}"):
        written = json.loads(manifest.read_text())
        assert written["complete"] and written["messages"] == one_run[0]
        assert list(written["replicas"]) == ["replica-0", "replica-1", "replica-2"], "in the order they first spoke"
    assert said[-1][0] == said[-1][1] == cap.stat().st_size, "progress reaches the whole file"


def bad_payload() -> bytes:
    """A hash no decoder reads (a wrong token count is no longer bad: it imports as a breach, tests/test_lint.py)."""
    return msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}], 0])


def capture_with_bad(path: Path, bad: dict[int, str]) -> Path:
    """Two replicas taking turns; the messages numbered in `bad` (line = number + 2) carry a float hash."""
    w = CaptureWriter(path, {"replica-0": "tcp://a", "replica-1": "tcp://b"})
    for i, m in enumerate(fleet_messages(3000, replicas=2)):
        assert m.replica == f"replica-{i % 2}"
        w.add(Message(m.replica, 0, m.seq, m.topic, bad_payload() if i in bad else m.payload, m.received))
    w.close()
    return path


@pytest.mark.parametrize("bad", [{41: "the helper's"}, {40: "this process's"}, {41: "the helper's", 90: "this one's"},
                                 {40: "this process's", 91: "the helper's"}],
                         ids=["helper", "here", "helper-first", "here-first"])
def test_a_split_import_names_the_earliest_bad_line_whichever_process_finds_it(tmp_path, bad):
    store, good = store_with_one_run(tmp_path)
    first = min(bad)
    with pytest.raises(CaptureError, match=rf"line {first + 2} \(seq {first // 2}\) event 0: a block hash must be"):
        import_capture(capture_with_bad(tmp_path / "c.jsonl", bad), store, workers=2)
    assert_only(store, good)


def store_with_one_run(tmp_path: Path) -> tuple[RunStore, str]:
    store = RunStore.open(tmp_path / "k.duckdb")
    return store, import_capture(capture_with_bad(tmp_path / "good.jsonl", {}), store, workers=2)


def assert_only(store: RunStore, good: str) -> None:
    """The store holds the good run alone, and nothing of the refused one is left on disk."""
    with store.read() as con:
        assert con.execute("SELECT list(run_id) FROM runs").fetchone()[0] == [good]
    assert [p.name for p in store.captures_dir.iterdir()] == [Path(source(store, good)).name]


def source(store: RunStore, run: str) -> str:
    """The dataset the store decoded a capture into."""
    with store.read() as con:
        return con.execute("SELECT path FROM capture_sources WHERE run_id = ?", [run]).fetchone()[0]


def test_a_line_that_is_not_json_is_named_by_every_process(tmp_path):
    path = capture_with_bad(tmp_path / "c.jsonl", {})
    lines = path.read_text().splitlines(keepends=True)
    lines[30] = "{not json\n"
    path.write_text("".join(lines))
    store, good = store_with_one_run(tmp_path)
    with pytest.raises(CaptureError, match="line 31: not valid JSON"):
        import_capture(path, store, workers=2)
    assert_only(store, good)


def test_a_helper_process_that_dies_fails_the_import_and_leaves_nothing(tmp_path, monkeypatch):
    store, good = store_with_one_run(tmp_path)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the helper exits 1 at once
    with pytest.raises(RuntimeError, match=r"the import's process 1 failed \(exit code 1\)"):
        import_capture(capture_with_bad(tmp_path / "c.jsonl", {}), store, workers=2)
    assert_only(store, good)


def test_a_script_without_a_main_guard_imports_a_capture_in_several_processes(tmp_path):
    cap = capture_with_bad(tmp_path / "c.jsonl", {})
    script = tmp_path / "mine.py"
    script.write_text(textwrap.dedent(f"""
        from kvviz.capture.import_vllm import import_capture
        from kvviz.store import RunStore
        store = RunStore.open({str(tmp_path / 'k.duckdb')!r})
        print(import_capture({str(cap)!r}, store, workers=2))
    """))
    root = str(Path(__file__).parents[1])
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": root})
    assert p.returncode == 0, p.stderr
    run = p.stdout.split()[-1]
    con = duckdb.connect(str(tmp_path / "k.duckdb"), read_only=True)
    messages = len(cap.read_text().splitlines()) - 1
    assert con.execute("SELECT status, steps FROM runs WHERE run_id = ?", [run]).fetchone() == ("complete", messages)
    assert con.execute("SELECT count(DISTINCT replica) FROM kv_events WHERE run_id = ?", [run]).fetchone()[0] == 2


def test_the_payloads_stay_whole_on_each_message_s_first_row(tmp_path):
    cap = capture_with_bad(tmp_path / "c.jsonl", {})
    store = RunStore.open(tmp_path / "k.duckdb")
    run = import_capture(cap, store, workers=2)
    sent = [base64.b64decode(json.loads(line)["payload"]) for line in cap.read_text().splitlines()[1:]]
    files = f"{source(store, run)}/*/*.parquet"
    con = duckdb.connect()
    kept = con.execute(f"SELECT payload FROM '{files}' WHERE payload IS NOT NULL ORDER BY step").fetchall()
    most = con.execute(f"SELECT max(n) FROM (SELECT count(payload) AS n FROM '{files}' GROUP BY step)").fetchone()[0]
    assert [k[0] for k in kept] == sent and most == 1, "each message's payload once, on its first row"


def test_a_large_capture_is_split_without_being_asked_of_one_replica_too(tmp_path, monkeypatch):
    from kvviz.capture import jsonl_dataset

    started, real = [], jsonl_dataset._Helper.__init__
    monkeypatch.setattr(jsonl_dataset, "SPLIT_FROM_BYTES", 0)  # every capture counts as large
    monkeypatch.setattr(jsonl_dataset._Helper, "__init__", lambda self, *a: (started.append(a[-2]), real(self, *a))[1])
    store = RunStore.open(tmp_path / "k.duckdb")
    cores = len(os.sched_getaffinity(0))
    import_capture(capture_with_bad(tmp_path / "c.jsonl", {}), store)
    assert started == (list(range(cores)) if cores > 1 else []), "a helper per core"
    started.clear()
    path = tmp_path / "one.jsonl"
    w = CaptureWriter(path, {"replica-0": "tcp://a"})
    for m in fleet_messages(2000, replicas=1):
        w.add(m)
    w.close()
    import_capture(path, store)
    assert started == (list(range(cores)) if cores > 1 else []), "a capture of one replica is split as well"
