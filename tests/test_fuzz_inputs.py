"""Every importer, fed random and mutated versions of valid files: each file is imported whole or
refused with a KvvizError naming it; never another exception, never a partial import."""

from __future__ import annotations

import functools
import io
import json
import tempfile
import zipfile
from pathlib import Path

import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvviz.analysis.runs import delete_run
from kvviz.capture.capture_file import CaptureWriter, Message
from kvviz.catalogue.scenarios import scenario
from kvviz.cli import main
from kvviz.engine import Engine
from kvviz.engine.workload import Workload
from kvviz.errors import KvvizError, WorkloadError
from kvviz.models import load_model
from kvviz.runners.uploads import import_file
from kvviz.store import RunStore
from kvviz.store.schema import TRACE_TABLES
from kvviz.store.trace import export_run

from .test_store import record

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                    max_leaves=12)
WORK = Path(tempfile.mkdtemp(prefix="kvviz-fuzz-"))
DEEP = b"[" * 200_000 + b"]" * 200_000  # the file of issue 13: a RecursionError traceback before


@functools.cache
def tiny():
    return load_model("tiny-llama")


@functools.cache
def valid_trace() -> bytes:
    db = WORK / "source.duckdb"
    run = record(db, "boundary", "boundary")
    return export_run(RunStore.open(db), run.result.run_id, WORK / "valid.zip").read_bytes()


@functools.cache
def valid_capture() -> bytes:
    ev = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
          "block_size": 2, "medium": "GPU", "extra_keys": [["tenant-a"], None]}
    w = CaptureWriter(WORK / "valid.jsonl", {"replica-0": "tcp://test"})
    for seq, events in enumerate([[ev], [{"type": "BlockRemoved", "block_hashes": [12]}], [{"type":
                                                                                            "AllBlocksCleared"}]]):
        w.add(Message("replica-0", 0, seq, "kv-events", msgpack.packb([1.0 + seq, events, 0])))
    w.close()
    return (WORK / "valid.jsonl").read_bytes()


def counts(store: RunStore) -> dict[str, int]:
    if not store.exists():
        return {}
    with store.read() as con:
        return {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in (*TRACE_TABLES, "kv_events")}


def owned_datasets(store: RunStore) -> set[str]:
    return {p.name for p in store.captures_dir.iterdir()} if store.captures_dir.is_dir() else set()


def imported_whole_or_refused(data: bytes, suffix: str) -> None:
    """Import one file into a fresh copy of a store; a refusal must leave every table as it was."""
    path = WORK / f"input{suffix}"
    path.write_bytes(data)
    store = RunStore.open(WORK / "target.duckdb")
    before, datasets = counts(store), owned_datasets(store)
    try:
        run_id = import_file(path, store)
    except KvvizError as e:
        assert str(path) in str(e), e  # the sentence names the file
        assert counts(store) == before
        assert owned_datasets(store) == datasets, "a refused capture leaves no files"
        return
    with store.read() as con:
        assert con.execute("SELECT count(*) FROM runs WHERE run_id = ?", [run_id]).fetchone()[0] == 1
    delete_run(store, run_id)  # keep the target small: remove what the example added


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for at, byte in edits:
        out[at % len(out)] = byte
    return bytes(out[:cut] if cut is not None else out)


EDITS = st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), max_size=8)


@pytest.mark.slow
@FUZZ
@given(edits=EDITS, cut=st.none() | st.integers(0, 4000))
def test_mutated_captures_import_whole_or_are_refused(edits, cut):
    imported_whole_or_refused(mutate(valid_capture(), edits, cut), ".jsonl")


@pytest.mark.slow
@FUZZ
@given(line=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()), at=st.integers(1, 4))
def test_captures_with_a_random_line_are_refused_or_imported(line, at):
    lines = valid_capture().split(b"\n")
    lines.insert(min(at, len(lines)), line)
    imported_whole_or_refused(b"\n".join(lines), ".jsonl")


@pytest.mark.slow
@FUZZ
@given(edits=EDITS, cut=st.none() | st.integers(0, 100_000))
def test_mutated_traces_import_whole_or_are_refused(edits, cut):
    imported_whole_or_refused(mutate(valid_trace(), edits, cut), ".zip")


MOONCAKE = b"".join(json.dumps(r).encode() + b"\n" for r in [  # a Mooncake trace: hash ids, 512 tokens each
    {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 1024, "output_length": 9, "hash_ids": [0, 1]},
    {"timestamp": 250, "input_length": 100, "output_length": 1, "hash_ids": [3]}])


@pytest.mark.slow
@FUZZ
@given(edits=EDITS, cut=st.none() | st.integers(0, len(MOONCAKE)))
def test_mutated_mooncake_traces_import_whole_or_are_refused(edits, cut):
    imported_whole_or_refused(mutate(MOONCAKE, edits, cut), ".jsonl")


def rezip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


@pytest.mark.slow
@FUZZ
@given(data=st.data())
def test_traces_with_a_replaced_manifest_field_or_table_are_refused_or_imported(data):
    with zipfile.ZipFile(io.BytesIO(valid_trace())) as z:
        members = {n: z.read(n) for n in z.namelist()}
    manifest = json.loads(members["manifest.json"])
    if data.draw(st.booleans()):  # a manifest field becomes any JSON value
        key = data.draw(st.sampled_from(["format", "version", "run_id", "tables"]))
        manifest[key] = data.draw(JSON)
        members["manifest.json"] = json.dumps(manifest).encode()
    else:  # a table's column becomes another type, or the table garbage
        name = data.draw(st.sampled_from(sorted(manifest["tables"])))
        file = manifest["tables"][name]["file"]
        table = pq.read_table(io.BytesIO(members[file]))
        if data.draw(st.booleans()) and table.num_columns:
            col = data.draw(st.sampled_from(table.column_names))
            value = data.draw(st.none() | st.text(max_size=5) | st.integers(-(1 << 70), 1 << 70) | st.floats())
            table = table.set_column(table.column_names.index(col), col,
                                     pa.array([value] * table.num_rows) if value is not None else
                                     pa.nulls(table.num_rows))
            buf = io.BytesIO()
            pq.write_table(table, buf)
            members[file] = buf.getvalue()
        else:
            members[file] = data.draw(st.binary(max_size=64))
    imported_whole_or_refused(rezip(members), ".zip")


@FUZZ
@given(data=st.data())
def test_mutated_workload_files_are_refused_with_a_sentence_or_run(data):
    wl = scenario("boundary").build(tiny().tokenizer)
    target = data.draw(st.sampled_from(["top", "request", "engine"]))
    holder = wl if target == "top" else wl["requests"][0] if target == "request" else wl.setdefault("engine", {})
    key = data.draw(st.sampled_from(sorted(holder) + ["extra"]))
    holder[key] = data.draw(JSON)
    text = json.dumps(wl).encode()
    if data.draw(st.booleans()):
        text = mutate(text, data.draw(EDITS), data.draw(st.none() | st.integers(0, len(text))))
    path = WORK / "workload.json"
    path.write_bytes(text)
    try:
        loaded = Workload.from_file(path)
        Engine(tiny(), loaded.engine).check(loaded)
    except WorkloadError as e:
        assert str(e)


def test_deeply_nested_json_is_refused_by_every_importer(capsys):
    for suffix in (".json", ".jsonl"):
        (WORK / f"deep{suffix}").write_bytes(DEEP)
        assert main(["import", str(WORK / f"deep{suffix}"), "--db", str(WORK / "deep.duckdb")]) == 2
        assert "deep" in capsys.readouterr().err
    header = json.dumps({"format": "kvviz-vllm-capture", "version": 1}).encode()
    (WORK / "deep-line.jsonl").write_bytes(header + b"\n" + DEEP + b"\n")
    assert main(["import", str(WORK / "deep-line.jsonl"), "--db", str(WORK / "deep.duckdb")]) == 2
    assert "line 2: JSON nested too deeply" in capsys.readouterr().err
    (WORK / "deep-workload.json").write_bytes(DEEP)
    try:
        Workload.from_file(WORK / "deep-workload.json")
    except WorkloadError as e:
        assert "nested too deeply" in str(e)
    else:
        raise AssertionError("a 200,000-deep workload file was accepted")
    zipped = rezip({"manifest.json": DEEP})
    (WORK / "deep.zip").write_bytes(zipped)
    assert main(["import", str(WORK / "deep.zip"), "--db", str(WORK / "deep.duckdb")]) == 2
    assert "manifest.json: JSON nested too deeply" in capsys.readouterr().err


def test_other_encodings_and_endless_lines_are_refused_with_the_place(monkeypatch):
    from kvviz.capture import capture_file

    monkeypatch.setattr(capture_file, "MAX_LINE", 1000)
    header = json.dumps({"format": "kvviz-vllm-capture", "version": 1}).encode()
    cases = {"latin-1": (header + b"\n" + '{"seq": 1, "payload": "é"}'.encode("latin-1"), "line 2: not UTF-8"),
             "utf-16": ('{"format": "kvviz-vllm-capture"}'.encode("utf-16"), "capture version None"),
             "binary": (bytes(range(256)) * 4, "line 1"),
             "endless": (header + b"\n" + b"x" * 5000, "line 2 is longer than")}
    for name, (data, place) in cases.items():
        path = WORK / f"{name}.jsonl"
        path.write_bytes(data)
        try:
            import_file(path, RunStore.open(WORK / "enc.duckdb"))
        except KvvizError as e:
            assert place in str(e) and str(path) in str(e), (name, e)
        else:
            raise AssertionError(f"{name} was imported")
