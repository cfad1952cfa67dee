"""kvviz traces: export -> import is the identity; malformed and hostile files are refused with a
specific error and change nothing; Chrome trace JSON for Perfetto."""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvviz.store import RunStore
from kvviz.store.chrome import chrome_trace
from kvviz.store.trace import TABLES, TraceError, export_run, import_trace

from .test_store import record


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace")
    db = d / "src.duckdb"
    run = record(db, "boundary", "boundary")
    trace = export_run(RunStore.open(db), run.result.run_id, d / "run.zip")
    return db, run.result.run_id, trace


def tables(db, run_id, names=tuple(TABLES)) -> dict[str, list[tuple]]:
    """Every row of the run in each named table, read through one connection (a connection costs
    more than the reads)."""
    with duckdb.connect(str(db), read_only=True) as con:
        return {
            t: con.execute(f"SELECT {', '.join(TABLES[t])} FROM {t} WHERE run_id = ? ORDER BY ALL", [run_id]).fetchall()
            for t in names
        }


def test_export_then_import_is_the_identity(source, tmp_path):
    db, run_id, trace = source
    target = tmp_path / "target.duckdb"
    assert import_trace(trace, RunStore.open(target)) == run_id
    imported, recorded = tables(target, run_id), tables(db, run_id)
    for table in TABLES:
        assert imported[table] == recorded[table], table
    assert len(imported["attention"]) > 0 and len(imported["findings"]) > 0


def rewrite(trace, out, *, drop=(), replace=None, manifest=None):
    """A copy of a valid trace with members dropped or replaced, or the manifest edited."""
    replace = replace or {}
    with zipfile.ZipFile(trace) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            if name in drop:
                continue
            data = replace.get(name, src.read(name))
            if name == "manifest.json" and manifest is not None:
                data = manifest(json.loads(data))
                data = data if isinstance(data, bytes) else json.dumps(data).encode()
            dst.writestr(name, data)
    return out


def parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def table_of(trace, name) -> pa.Table:
    with zipfile.ZipFile(trace) as z:
        return pq.read_table(io.BytesIO(z.read(f"{name}.parquet")))


def bomb(out):
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("manifest.json", json.dumps({"format": "kvviz-trace", "version": 1, "run_id": "x", "tables": {}}))
        z.writestr("steps.parquet", b"\0" * (64 << 20))
    return out


def m(fn):
    """A manifest edit applied in place; the edited manifest is written back."""
    return lambda d: (fn(d), d)[1]


CASES = {
    "missing file": (lambda t, o: o.parent / "nope.zip", "no such file"),
    "empty file": (lambda t, o: (o.write_bytes(b""), o)[1], "expected a zip file"),
    "truncated zip": (lambda t, o: (o.write_bytes(t.read_bytes()[: t.stat().st_size // 2]), o)[1], "expected a zip"),
    "a pickle": (lambda t, o: (o.write_bytes(pickle.dumps({"run": 1})), o)[1], "expected a zip file"),
    "no manifest": (lambda t, o: rewrite(t, o, drop={"manifest.json"}), "no manifest.json"),
    "manifest not utf-8": (lambda t, o: rewrite(t, o, manifest=lambda d: b"\xff\xfe{"), "not UTF-8"),
    "manifest not json": (lambda t, o: rewrite(t, o, manifest=lambda d: b"{oops"), "not valid JSON"),
    "manifest a list": (lambda t, o: rewrite(t, o, manifest=lambda d: [d]), "format must be"),
    "other format": (lambda t, o: rewrite(t, o, manifest=m(lambda d: d.update(format="vllm"))), "format must be"),
    "unknown version": (lambda t, o: rewrite(t, o, manifest=m(lambda d: d.update(version=2))),
                        "version 2 is not supported"),
    "no run id": (lambda t, o: rewrite(t, o, manifest=m(lambda d: d.pop("run_id"))), "run_id must be"),
    "tables not an object": (lambda t, o: rewrite(t, o, manifest=m(lambda d: d.update(tables=[]))),
                             "tables must be an object"),
    "unknown table": (lambda t, o: rewrite(t, o, manifest=m(lambda d: d["tables"].update(secrets={"file": "x"}))),
                      "unknown table 'secrets'"),
    "entry without file": (lambda t, o: rewrite(t, o, manifest=m(lambda d: d["tables"].update(steps={}))),
                           "must name its file"),
    "member missing": (lambda t, o: rewrite(t, o, drop={"blocks.parquet"}), "missing from the archive"),
    "not parquet": (lambda t, o: rewrite(t, o, replace={"steps.parquet": b"PAR1 garbage"}), "not readable Parquet"),
    "missing column": (lambda t, o: rewrite(t, o, replace={"steps.parquet": parquet(
        table_of(t, "steps").drop_columns(["free_blocks"]))}), "lacks column 'free_blocks'"),
    "row count lies": (lambda t, o: rewrite(t, o, manifest=m(lambda d: d["tables"]["steps"].update(rows=10 ** 6))),
                       "the manifest says 1000000"),
    "required table missing": (lambda t, o: rewrite(t, o, drop={"steps.parquet"}, manifest=m(
        lambda d: d["tables"].pop("steps"))), "required table 'steps' is missing"),
    "two runs": (lambda t, o: rewrite(t, o, replace={"runs.parquet": parquet(pa.concat_tables(
        [table_of(t, "runs")] * 2))}, manifest=m(lambda d: d["tables"]["runs"].update(rows=2))), "exactly one run"),
    "unknown request": (lambda t, o: rewrite(t, o, replace={"requests.parquet": parquet(
        table_of(t, "requests").slice(0, 1))}, manifest=m(lambda d: d["tables"]["requests"].update(rows=1))),
        "refers to request"),
    "zip bomb": (lambda t, o: bomb(o), "too large"),
    # a new run id, so that the import gets as far as inserting: the failure rolls back every table
    "wrong column type": (lambda t, o: rewrite(t, o, replace={"steps.parquet": parquet(
        table_of(t, "steps").set_column(0, "step", pa.array(["zero"] * table_of(t, "steps").num_rows)))},
        manifest=m(lambda d: d.update(run_id="other-run"))), "does not fit the schema"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_and_hostile_traces_are_refused_and_change_nothing(source, tmp_path, name):
    db, run_id, trace = source
    make, message = CASES[name]
    bad = make(trace, tmp_path / "bad.zip")
    target = tmp_path / "target.duckdb"
    import_trace(trace, RunStore.open(target))  # the database already holds one run
    before = tables(target, run_id)
    with pytest.raises(TraceError, match=message):
        import_trace(bad, RunStore.open(target))
    assert tables(target, run_id) == before
    con = duckdb.connect(str(target), read_only=True)
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 1


def test_importing_the_same_run_twice_is_refused(source, tmp_path):
    target = tmp_path / "t.duckdb"
    import_trace(source[2], RunStore.open(target))
    with pytest.raises(TraceError, match="already in"):
        import_trace(source[2], RunStore.open(target))


def test_chrome_trace_has_tracks_slices_and_counters(source):
    db, run_id, _ = source
    trace = chrome_trace(duckdb.connect(str(db), read_only=True), run_id)
    ev = trace["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"engine steps", "request A", "request B"} <= names
    slices = [e for e in ev if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    assert {e["name"] for e in slices} >= {"prefill", "decode"}
    assert {e["name"] for e in ev if e["ph"] == "C"} == {"free blocks", "prefix hits", "leak rate"}
    json.dumps(trace)  # serialisable as is


def test_the_documented_stand_alone_writer_imports(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "trace-format.md").read_text()
    code = re.search(r"## A stand-alone writer\n\n```python\n(.*?)```", doc, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(code, {})
    assert import_trace(tmp_path / "capture.zip", RunStore.open(tmp_path / "k.duckdb")) == "prod-0001"
    assert tables(tmp_path / "k.duckdb", "prod-0001", ["page_tables"]) == {"page_tables": [(0, "r1", 0, 7)]}


def test_the_documented_trace_tables_are_the_declared_ones():
    """docs/trace-format.md lists each table's columns; the schema declaration is the truth (drift fails)."""
    import re

    from kvviz.store.schema import TRACE_TABLES

    doc = (Path(__file__).resolve().parent.parent / "docs" / "trace-format.md").read_text()
    listed = {}
    for table, cols in re.findall(r"^\| (\w+) \| ([^|]+) \| [^|]+ \|$", doc, re.M):
        if table != "table":
            listed[table] = [c.strip() for c in re.sub(r"\([^)]*\)", "", cols).split(",")]
    assert listed == TRACE_TABLES
