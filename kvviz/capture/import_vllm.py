"""A vLLM/SGLang KV-event capture becomes a run: the prefix tree (hash chains with their tokens,
salts and LoRA names), blocks stored and evicted per step, cache occupancy over time, a
cross-tenant finding wherever one block hash is stored under two salts the stream names on one
replica and KV group, and a cross-tier salt finding wherever one is kept salted in one tier and
unsalted in another (tenants.py).
The events carry no physical block ids and no attention weights, so the run has neither.

A JSONL capture is decoded once into a capture dataset of the store's own (Parquet, beside the
database) that the run reads in place, as `import --in-place` reads a dataset folder; a dataset
imported without --in-place is copied in, a chunk at a time, each chunk committed, so memory is
bounded by the chunk whatever its length, and the writer is given up every second, so the app's
other users read while a long capture imports. The run says `running` until the end, and a bad
message anywhere leaves nothing of it (nothing half-imported, no files). A message that decodes but
breaks the KV-event contract is no bad message: the linter (lint.py) counts it in capture_breaches,
and the run's workload says how many kinds of breach it found (`breaches`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import __version__
from ..store import RunStore
from ..store.run_store import TURN_S, WriterTurns
from ..store.schema import DATASET_COLUMNS
from ..util.gcpause import paused_gc
from ..util.ids import new_run_id
from ..util.jsonio import parse_json
from .capture_file import DEFAULT_REPLICA
from .dataset import LATER, MANIFEST, check_files, dataset_files
from .events import CaptureError
from .jsonl_dataset import Progress, write_dataset
from .lint import Source, keep, lint_run
from .tenants import CROSS_TENANT, CROSS_TIER_SALT

CAPTURE_MODEL = "vllm capture"  # what an imported capture's run says its model was
TRACE_MODEL = "request trace"  # an imported request trace's (Mooncake's format: hashes, no model's events)
CAPTURE_MODELS = (CAPTURE_MODEL, TRACE_MODEL)


def import_capture(path: str | Path, store: RunStore, progress: Progress | None = None,
                   workers: int | None = None, sha256: str | None = None) -> str:
    """Import a JSONL capture as a new run and return its id. It is decoded once into a capture
    dataset of the store's own (STORE_FOLDER/captures/ID, the documented layout) that the run reads
    in place: Parquet is written faster than DuckDB inserts, and nothing is copied into the database.
    A large capture of several replicas is decoded by one process per core (`workers` overrides it).
    `sha256`, the file's, is kept in the run's workload, where a later import of the same bytes finds it; bytes
    another run holds (or another process is importing now) are refused before any work.
    CaptureError names the line that is wrong, and then nothing is registered or left on disk."""
    path = Path(path)
    said = {"capture": path.name} | ({"sha256": sha256} if sha256 else {})
    run_id = _begin(store, path, said)  # listed as running while its dataset is written
    folder = store.captures_dir / run_id
    try:
        written = write_dataset(path, folder, progress, workers)
        if not written.messages:
            raise CaptureError(f"{path}: the capture holds no messages")
        files = dataset_files(folder)
        return _import(path, store, (), said | {"files": len(files)}, steps=written.messages,
                       source=str(folder.resolve()), run_id=run_id, lint=Source.of(files, hive=True))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        with store.write() as con:
            _discard(store, con, run_id)
        raise


def import_dataset(path: str | Path, store: RunStore, progress: Progress | None = None,
                   in_place: bool = False) -> str:
    """Import a capture dataset folder (or one of its Parquet files) as a new run, a file at a time
    and a row group at a time, verifying every page's checksum: a damaged file is refused naming it,
    and nothing is imported. Steps are renumbered densely (one part alone skips other replicas')."""
    path = Path(path)
    files = dataset_files(path)
    try:
        check_files(files)
    except CaptureError as e:
        raise CaptureError(f"{path}: {e}") from None
    hive = ["replica=" in f.parent.name for f in files]
    if any(hive) and not all(hive):
        raise CaptureError(f"{path}: some files lie in replica=NAME folders and some do not; import one layout")
    steps = np.unique(np.concatenate([_read(f, ["step"]).column("step").to_numpy() for f in files]))
    if in_place:
        return _register(path, store, files, all(hive), steps, progress)

    def chunks() -> Iterator[pa.Table]:
        for f in _each(files, progress):
            replica = f.parent.name.partition("=")[2] if all(hive) else DEFAULT_REPLICA
            for table in _batches(f):
                for name, typ in LATER.items():
                    if name not in table.column_names:
                        table = table.append_column(name, pa.nulls(table.num_rows, typ))
                dense = pa.array(np.searchsorted(steps, table.column("step").to_numpy()))
                yield (table.set_column(table.schema.get_field_index("step"), "step", dense)
                       .append_column("replica", pa.array([replica] * table.num_rows, pa.string())))

    return _import(path, store, chunks(), {"capture": path.name, "files": len(files)},
                   lint=Source.of(files, all(hive), renumber=True))


def _register(path: Path, store: RunStore, files: list[Path], hive: bool, steps: np.ndarray,
              progress: Progress | None) -> str:
    """--in-place: a whole capture's folder stays where it is and kv_events reads it; every page is
    checked once now (its checksum), and nothing is copied."""
    manifest = path / MANIFEST
    if not path.is_dir() or not hive or not manifest.is_file():
        raise CaptureError(f"{path}: --in-place takes a whole capture dataset folder (with {MANIFEST} and "
                           "replica=NAME folders); import a part or another layout without --in-place")
    said = parse_json(manifest.read_bytes(), str(manifest), CaptureError)
    if not isinstance(said, dict) or not said.get("complete"):
        raise CaptureError(f"{path}: the capture is still being written (or was killed); wait for it to stop, or "
                           "import a copy without --in-place")
    if steps[0] != 0 or steps[-1] + 1 != len(steps):
        raise CaptureError(f"{path}: messages are missing from the dataset (its steps run from {steps[0]} to "
                           f"{steps[-1]} with {len(steps)} there); import it without --in-place")
    for f in _each(files, progress):
        for _ in _batches(f):
            pass
    return _import(path.resolve(), store, (), {"capture": path.name, "files": len(files), "in_place": True},
                   steps=len(steps), source=str(path.resolve()), lint=Source.of(files, hive))


def _each(files: list[Path], progress: Progress | None) -> Iterator[Path]:
    """The files, saying before each how many of their bytes are behind."""
    sizes = [f.stat().st_size for f in files]
    for i, f in enumerate(files):
        if progress is not None:
            progress(sum(sizes[:i]), sum(sizes))
        yield f


def _read(f: Path, columns: list[str]) -> pa.Table:
    return next(_batches(f, columns, whole=True))


def _batches(f: Path, columns: list[str] | None = None, whole: bool = False) -> Iterator[pa.Table]:
    """A file's rows a row group at a time (or all at once), every page's checksum verified."""
    try:
        pf = pq.ParquetFile(f, page_checksum_verification=True)
        if whole:
            yield pf.read(columns=columns)
            return
        for i in range(pf.num_row_groups):
            yield pf.read_row_group(i, columns=columns)
    except (OSError, pa.ArrowException) as e:
        raise CaptureError(f"{f}: damaged ({str(e).splitlines()[0]})") from None


def _begin(store: RunStore, path: Path, workload: dict, model: str = CAPTURE_MODEL) -> str:
    """A new capture run, `running` until its import ends. A capture whose bytes (its workload's sha256) another
    run holds, or another process is importing now, is refused: the check and the new run are one write."""
    run_id = new_run_id()
    with store.write() as con:
        other = con.execute("SELECT run_id, status FROM runs WHERE workload->>'sha256' = ? AND status <> 'failed' "
                            "ORDER BY created_at LIMIT 1", [workload.get("sha256")]).fetchone()
        if other is not None:
            raise CaptureError(f"{path}: " + (f"was imported before, as run {other[0]}" if other[1] == "complete" else
                               f"is being imported now, as run {other[0]} (if no process imports it any more, delete "
                               "that run or import with --again)"))
        con.execute("INSERT INTO runs (run_id, created_at, status, model, scenario, workload, engine, "
                    "kvviz_version) VALUES (?, ?, 'running', ?, ?, ?, '{}', ?)",
                    [run_id, datetime.now(UTC).replace(tzinfo=None), model, f"{model.split()[-1]} {path.name}",
                     json.dumps(workload), __version__])
    return run_id


def _import(path: Path, store: RunStore, chunks: Iterable[pa.Table], workload: dict,
            steps: int | None = None, source: str | None = None, hold_s: float = TURN_S,
            run_id: str | None = None, lint: Source | None = None) -> str:
    """Insert every chunk, then the steps (given, or up to the last chunk's), the findings, the
    contract's breaches (where `lint` says where the messages are) and totals, into `run_id` (begun by
    the caller) or a new run. Each chunk commits on its own, so memory stays
    bounded (DuckDB keeps a transaction's rows in memory until it commits); the run says `running`
    until the end, and a failure deletes everything of it: a bad line anywhere imports nothing."""
    run_id = run_id or _begin(store, path, workload)
    try:
        with store.in_turns(_limits, hold_s) as turns:
            if source is not None:  # registered in place: kv_events reads the files
                con = turns.con()
                con.execute("INSERT INTO capture_sources VALUES (?, ?, ?)", [run_id, source, workload["files"]])
                store.refresh_file_views(con)
            inserted = _insert_chunks(turns, run_id, chunks)
        steps = inserted if steps is None else steps
        if not steps:
            raise CaptureError(f"{path}: the capture holds no messages")
        with store.write() as con:
            _limits(con)
            con.execute("RESET threads")  # nothing decodes now: the findings' query takes every core
            con.execute("BEGIN TRANSACTION")
            con.execute("INSERT INTO steps (run_id, step, seconds) SELECT ?, range, 0.0 FROM range(?)", [run_id, steps])
            con.execute(CROSS_TENANT, {"run": run_id})
            con.execute(CROSS_TIER_SALT, {"run": run_id})
            if lint is not None:
                breaches = lint_run(con, run_id, lint)
                keep(con, run_id, breaches)
                workload = workload | {"breaches": len(breaches)}
            con.execute("UPDATE runs SET status = 'complete', steps = $steps, workload = $workload, findings = "
                        "(SELECT count(*) FROM findings WHERE run_id = $run) + "
                        "(SELECT count(*) FROM cross_tier_salts WHERE run_id = $run) WHERE run_id = $run",
                        {"steps": steps, "workload": json.dumps(workload), "run": run_id})
            con.execute("COMMIT")
    except BaseException:
        with store.write() as con:
            _discard(store, con, run_id)
        raise
    return run_id


def _limits(con: duckdb.DuckDBPyConnection) -> None:
    """A long capture spills to disk instead of growing, and DuckDB inserts on one core while Python
    decodes on the other."""
    con.execute("SET memory_limit = '512MB'")
    con.execute("SET threads = 1")


def _discard(store: RunStore, con: duckdb.DuckDBPyConnection, run_id: str) -> None:
    """Everything of a failed import, in one transaction."""
    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass  # no transaction was open
    con.execute("BEGIN TRANSACTION")
    for table in ("kv_event_rows", "capture_sources", "steps", "findings", "capture_breaches", "cross_tier_salts",
                  "runs"):
        con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
    store.refresh_file_views(con)
    con.execute("COMMIT")


def _insert_chunks(turns: WriterTurns, run_id: str, chunks: Iterable[pa.Table]) -> int:
    """Append every chunk's events, in the writer's turns; returns the number of messages (steps are
    dense). DuckDB inserts one chunk on a worker thread while Python decodes the next (the insert
    releases the GIL), and the cyclic garbage collector is paused meanwhile (5x slower otherwise)."""
    steps = 0
    with paused_gc(), ThreadPoolExecutor(1, thread_name_prefix="kvviz-import") as pool:
        pending: Future | None = None
        for table in chunks:
            steps = max(steps, pc.max(table.column("step")).as_py() + 1)
            if pending is not None:
                pending.result()
            pending = pool.submit(_insert_chunk, turns, run_id, table)
        if pending is not None:
            pending.result()
    return steps


def _insert_chunk(turns: WriterTurns, run_id: str, table: pa.Table) -> None:
    """One chunk's events (a message without events is only a step), then the writer's turn may end."""
    events = table.filter(pc.is_valid(table.column("kind"))).select(DATASET_COLUMNS)
    con = turns.con()
    con.register("_kvviz_events", events)
    try:
        con.execute(f"INSERT INTO kv_event_rows (run_id, {', '.join(DATASET_COLUMNS)}) "
                    f"SELECT ?, {', '.join(DATASET_COLUMNS)} FROM _kvviz_events", [run_id])
    finally:
        con.unregister("_kvviz_events")
    turns.release_if_due()


