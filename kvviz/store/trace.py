"""The kvviz trace format: one run as a zip of Parquet tables with a JSON manifest.

Export writes a recorded run; import validates everything (format and version, the manifest, each
table's columns and types, sizes before decompressing, references between tables) and inserts the
run in one transaction, so a bad file changes nothing. Parquet and JSON only: nothing is unpickled.
docs/trace-format.md documents the format with a stand-alone writer.
"""

from __future__ import annotations

import io
import json
import zipfile
import zlib
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import CaptureError, StoreError
from ..util.jsonio import parse_json
from .run_store import RunStore
from .schema import TABLES as DECLARED
from .schema import TRACE_TABLES as TABLES  # table -> its trace columns; run_id is the manifest's

FORMAT, VERSION = "kvviz-trace", 1
REQUIRED = ("runs", "requests", "steps")
MAX_MEMBER_BYTES = 1 << 30  # 1 GiB uncompressed per table
MAX_TOTAL_BYTES = 4 << 30
MAX_RATIO = 200  # uncompressed / compressed: beyond this a member is treated as a zip bomb


class TraceError(CaptureError):
    """The trace file is malformed or hostile; the message names the problem. Nothing was imported."""


def export_run(store: RunStore, run_id: str, out: str | Path) -> Path:
    """Write one run as a kvviz trace (.zip)."""
    out, partial = Path(out), Path(f"{out}.partial")  # renamed into place only when complete
    try:
        with store.read() as con:
            store.require_run(con, run_id)
            _write_trace(con, run_id, partial)
        partial.replace(out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return out


def _write_trace(con: duckdb.DuckDBPyConnection, run_id: str, partial: Path) -> None:
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as z:
        tables = {}
        for table, cols in TABLES.items():
            query = f"SELECT {', '.join(cols)} FROM {table} WHERE run_id = $1"
            arrow = con.sql(query, params=[run_id]).to_arrow_table()
            buf = io.BytesIO()
            pq.write_table(arrow, buf)
            z.writestr(f"{table}.parquet", buf.getvalue())
            tables[table] = {"file": f"{table}.parquet", "rows": arrow.num_rows}
        z.writestr("manifest.json", json.dumps({"format": FORMAT, "version": VERSION, "run_id": run_id,
                                                "tables": tables}, indent=1))


def read_trace(path: str | Path) -> tuple[str, dict[str, pa.Table]]:
    """Validate a trace and return its run id and tables; raises TraceError naming the problem."""
    path = Path(path)
    try:
        z = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise TraceError(f"{path}: not a kvviz trace (expected a zip file: {e})") from None
    with z:
        infos = {i.filename: i for i in z.infolist()}
        total = 0
        for i in infos.values():
            if i.file_size > MAX_MEMBER_BYTES or (i.compress_size and i.file_size / i.compress_size > MAX_RATIO
                                                  and i.file_size > 1 << 20):
                raise TraceError(f"{path}: member {i.filename} declares {i.file_size} bytes uncompressed: too large")
            total += i.file_size
        if total > MAX_TOTAL_BYTES:
            raise TraceError(f"{path}: {total} bytes uncompressed in all: too large")
        manifest = _manifest(z, infos, path)
        run_id = manifest["run_id"]
        tables = {}
        for name, entry in manifest["tables"].items():
            tables[name] = _table(z, infos, path, name, entry)
    for name in REQUIRED:
        if name not in tables:
            raise TraceError(f"{path}: the required table {name!r} is missing")
    if tables["runs"].num_rows != 1:
        raise TraceError(f"{path}: table 'runs' must hold exactly one run, holds {tables['runs'].num_rows}")
    known = set(tables["requests"].column("request_id").to_pylist())
    if tables["runs"].column("status")[0].as_py() != "complete":
        known = None  # a run that died midway never wrote its requests: its steps are what it has
    for name in ("step_work", "slot_writes", "page_tables", "leak_metrics", "attention", "findings", "divergence"):
        if name in tables and known is not None:
            unknown = set(tables[name].column("request_id").to_pylist()) - known
            if unknown:
                raise TraceError(f"{path}: table {name!r} refers to request {sorted(unknown)[0]!r}, "
                                 "which is not in 'requests'")
    return run_id, tables


def _manifest(z: zipfile.ZipFile, infos: dict, path: Path) -> dict:
    if "manifest.json" not in infos:
        raise TraceError(f"{path}: no manifest.json: not a kvviz trace")
    m = parse_json(_member(z, "manifest.json", path), f"{path}: manifest.json", TraceError)
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise TraceError(f"{path}: manifest format must be {FORMAT!r}")
    if m.get("version") != VERSION:
        raise TraceError(f"{path}: trace format version {m.get('version')!r} is not supported (this kvviz reads "
                         f"version {VERSION})")
    if not isinstance(m.get("run_id"), str) or not m["run_id"]:
        raise TraceError(f"{path}: manifest.run_id must be a non-empty string")
    if not isinstance(m.get("tables"), dict):
        raise TraceError(f"{path}: manifest.tables must be an object")
    for name in m["tables"]:
        if name not in TABLES:
            raise TraceError(f"{path}: unknown table {name!r} in the manifest")
    return m


def _table(z: zipfile.ZipFile, infos: dict, path: Path, name: str, entry: object) -> pa.Table:
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
        raise TraceError(f"{path}: manifest entry for {name!r} must name its file")
    if entry["file"] not in infos:
        raise TraceError(f"{path}: table {name!r}: file {entry['file']} is missing from the archive")
    data = _member(z, entry["file"], path)
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError) as e:  # pyarrow's text: "Could not open ... '<Buffer>': WHY. Either ..."
        why = str(e).split(": ", 1)[-1].split(". ")[0].rstrip(".")
        raise TraceError(f"{path}: table {name!r} is not readable Parquet ({why})") from None
    missing = [c for c in DECLARED[name].required_in_trace() if c not in table.column_names]
    if missing:
        raise TraceError(f"{path}: table {name!r} lacks column {missing[0]!r}")
    if isinstance(entry.get("rows"), int) and entry["rows"] != table.num_rows:
        raise TraceError(f"{path}: table {name!r} has {table.num_rows} rows, the manifest says {entry['rows']}")
    return table.select([c for c in TABLES[name] if c in table.column_names])  # a newer column left out: null


def _member(z: zipfile.ZipFile, name: str, path: Path) -> bytes:
    """One archive member's bytes; a corrupt member is a refusal naming it."""
    try:
        return z.read(name)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError) as e:
        raise TraceError(f"{path}: member {name} cannot be read ({e})") from None


def trace_run_id(path: str | Path) -> str | None:
    """The run a trace carries, read from its manifest alone; None when it is no readable trace (its
    import says why)."""
    try:
        with zipfile.ZipFile(path) as z:
            return _manifest(z, {i.filename: i for i in z.infolist()}, Path(path))["run_id"]
    except (TraceError, zipfile.BadZipFile, OSError):
        return None


def import_trace(path: str | Path, store: RunStore) -> str:
    """Validate and insert a trace in one transaction; returns the run id. A bad file changes nothing."""
    run_id, tables = read_trace(path)
    with store.write() as con:
        if store.has_run(con, run_id):
            raise TraceError(f"{path}: run {run_id} is already in {store.path}")
        con.execute("BEGIN TRANSACTION")
        try:
            for name, table in tables.items():
                store.insert(con, name, table.append_column("run_id", pa.array([run_id] * table.num_rows,
                                                                                pa.string())))
            con.execute("COMMIT")
        except (duckdb.Error, StoreError) as e:
            con.execute("ROLLBACK")
            raise TraceError(f"{path}: a table does not fit the schema: {str(e).splitlines()[0]}") from None
    return run_id
