"""Explanations kept in the run store. Explaining a capture's misses (SQL over every event,
kvviz/capture/explain_sql.py) takes about 5 s per million events on a 2-core machine, so a complete
run is explained once (by `kvviz explain` or the app) and read back after, whatever its size; the rows
are the table lookup_explanations for SQL too. A run still recording is explained but not kept: its
lookups are not all there yet."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import duckdb
import pandas as pd
import pyarrow as pa

from ..capture import explain_sql
from ..capture.events import CaptureError
from ..capture.import_vllm import CAPTURE_MODELS
from ..store import RunStore, StoreError
from ..store.claims import alive, claimed
from ..store.schema import dataset_query
from .explain import (
    COLUMNS,
    READING,
    Explanations,
    contradictions,
    explain_capture,
    explain_from_result,
    explain_run,
    is_capture,
)

EXPLAIN_BYTES_PER_EVENT = 32  # of memory DuckDB may hold (see memory_mb)
EXPLAIN_S_PER_EVENT = 7e-6  # 4.3 s a million events at 1M, 5.4 s at 10M on 2 cores: a busy machine's, rounded up
KEEPING = "keeping it in the run store"
WAITING = "waiting for another process that is explaining this run"
COUNTING = "counting what the capture's events contradict"
STAGES = (WAITING, *explain_sql.STAGES, READING, KEEPING, COUNTING)  # explaining a run, in order; the callers
# count (contradiction_sentence) once the answer is kept, and say so as its last stage
POLL_S = 1.0  # how often a process waiting for another's answer looks for it


class Watch(Protocol):
    """Who follows an explanation being worked out (a progress bar)."""

    def stage(self, stage: str, detail: str) -> None:
        """A stage of STAGES begins (detail: which round of it, or "")."""

    def running_on(self, con: duckdb.DuckDBPyConnection | None) -> None:
        """The connection its statements run on now (None: none), for DuckDB's own progress."""


def memory_mb(events: int) -> int:
    """The memory a capture's explain may hold: 1 GB, and more for a capture over about 30 million events,
    up to half the machine's. DuckDB spills most of what its statements hold beyond its limit, but not all
    of it: 10M events ran out of 130 MB and finished in 200 MB, 100M ran out of 1 GB."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    return int(min(max(1024, events * EXPLAIN_BYTES_PER_EVENT / 2**20), machine // 2))


def explain_seconds(events: int) -> int:
    """What to tell a user about to wait for a capture to be explained."""
    return max(1, round(events * EXPLAIN_S_PER_EVENT))


def kept(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """Has this run been explained and kept (an explanation of no lookups counts)?"""
    row = con.execute("SELECT explained_at FROM runs WHERE run_id = ?", [run_id]).fetchone()
    return row is not None and row[0] is not None


def explained(store: RunStore, run_id: str, watch: Watch | None = None) -> Explanations:
    """The run's explanations: read back if kept, else worked out and kept (when the run is complete).
    StoreError names a run that is not there, has nothing to explain, or whose dataset cannot be read."""
    with store.read() as con:
        RunStore.require_run(con, run_id)
        if kept(con, run_id):
            return read_kept(con, run_id)
        status, model, error = con.execute("SELECT status, model, error FROM runs WHERE run_id = ?",
                                           [run_id]).fetchone()
        if status == "failed" and model in CAPTURE_MODELS:  # its dataset has gone: nothing of it can be read
            raise StoreError(f"capture {run_id} cannot be read: {error}")
        complete = status == "complete"
        source = con.execute("SELECT path FROM capture_sources WHERE run_id = ?", [run_id]).fetchone()
        capture = source is None and is_capture(con, run_id)
        if source is None and not capture:
            found = _worked_out(con, lambda: explain_run(con, run_id, _stage(watch)), watch)
    if source is not None or capture:
        with claimed(store.path, f"explain-{run_id}") as other:
            if other is not None:  # another process is at it: its answer, once kept
                return _answer_of(store, run_id, other, watch)
            found = _from_capture(store, run_id, Path(source[0]) if source else None, watch)
            if complete:
                _keep_if_allowed(store, run_id, found, watch)
        return found
    if complete:
        _keep_if_allowed(store, run_id, found, watch)
    return found


def _keep_if_allowed(store: RunStore, run_id: str, found: Explanations, watch: Watch | None) -> None:
    if watch:
        watch.stage(KEEPING, "")
    try:
        _keep(store, run_id, found)
    except StoreError:
        pass  # a store this user may read but not write: the answer stands, it is only not kept


def _answer_of(store: RunStore, run_id: str, pid: int, watch: Watch | None) -> Explanations:
    """The explanations process pid is working out, read once it has kept them; if it dies first, the
    work is done here."""
    if watch:
        watch.stage(WAITING, f"process {pid}")
    while alive(pid):
        with store.read() as con:
            if kept(con, run_id):
                return read_kept(con, run_id)
        time.sleep(POLL_S)
    return explained(store, run_id, watch)


def _stage(watch: Watch | None) -> explain_sql.Progress | None:
    return watch.stage if watch else None


def _worked_out(con: duckdb.DuckDBPyConnection, explain: Callable[[], Explanations], watch: Watch | None
                ) -> Explanations:
    """explain() on con, followed by the watch."""
    if watch:
        watch.running_on(con)
    try:
        return explain()
    finally:
        if watch:
            watch.running_on(None)


def _from_capture(store: RunStore, run_id: str, path: Path | None, watch: Watch | None) -> Explanations:
    """A capture explained on a DuckDB of its own, which spills beside the store rather than grow past its
    memory limit: a dataset registered in place (path; the store is not held while it works, its readers
    and writers, here and in other processes, go on), or the rows the store copied (path None)."""
    with _own_connection(store, run_id, path) as con:
        return _worked_out(con, lambda: explain_capture(con, run_id, _stage(watch)), watch)


@contextmanager
def _own_connection(store: RunStore, run_id: str, path: Path | None) -> Iterator[duckdb.DuckDBPyConnection]:
    """A DuckDB of its own whose kv_events is the run's: a dataset's (a read of it that fails: StoreError),
    or the store's copied rows (path None)."""
    own = store.scratch() if path is not None else store.scratch_over()
    with own as con:
        try:
            con.execute("SET enable_progress_bar = true; SET enable_progress_bar_print = false")  # measured, unsaid
            con.execute("SET preserve_insertion_order = false")  # every answer is ordered where it is read
            run = "'" + run_id.replace("'", "''") + "'"
            rows = (f"SELECT * FROM store.kv_event_rows WHERE run_id = {run}" if path is None
                    else dataset_query(run_id, path))
            con.execute(f"CREATE VIEW kv_events AS {rows}")
            events = con.execute("SELECT count(*) FROM kv_events").fetchone()[0]
            con.execute(f"SET memory_limit = '{memory_mb(events)}MB'")
            yield con
        except duckdb.Error as e:
            if path is None:
                raise StoreError(f"capture {run_id} could not be read from {store.path} "
                                 f"({str(e).splitlines()[0]})") from None
            gone = "" if path.is_dir() else ": it is no longer there"
            raise StoreError(f"the capture's dataset at {path} could not be read{gone} "
                             f"({str(e).splitlines()[0]})") from None


CLUSTER_RESULT = "_explained"  # in a capture dataset's folder: the explain_result a cluster wrote back (README)


def keep_cluster_result(store: RunStore, run_id: str, path: Path) -> int | None:
    """A dataset registered in place that carries explain's answer (DIR/_explained/*.parquet, written by
    Spark on a cluster, say) is kept with those reasons, as if explained here: how many lookups (None:
    it carries none). One that is not an explain_result kvviz reads is a CaptureError naming it."""
    folder = path / CLUSTER_RESULT
    if not folder.is_dir():
        return None
    with _own_connection(store, run_id, path) as con:
        try:
            found = explain_from_result(con, run_id, str(folder / "*.parquet"))
        except (duckdb.Error, KeyError, TypeError, ValueError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CaptureError(f"{folder}: not an explain_result kvviz can read ({first}); its columns are "
                               "explain_sql.RESULT_COLUMNS") from None
    _keep(store, run_id, found)
    return len(found)


def contradiction_sentence(store: RunStore, run_id: str) -> str | None:
    """What a capture's events say that cannot be so, in a sentence (None: nothing); a dataset registered
    in place is read on a DuckDB of its own, as explain reads it."""
    with store.read() as con:
        source = con.execute("SELECT path FROM capture_sources WHERE run_id = ?", [run_id]).fetchone()
        if source is None:
            return contradictions(con, run_id).sentence()
    with _own_connection(store, run_id, Path(source[0])) as con:
        return contradictions(con, run_id).sentence()


def reasons_per_interval(con: duckdb.DuckDBPyConnection, run_id: str, start: float, end: float,
                         width: float) -> pd.DataFrame:
    """interval_start, reason, lookups: a kept capture explanation on its time axis (a scan of the
    kept rows, not a replay), in churn's intervals (from `start`)."""
    return con.execute("SELECT $a + floor((ts - $a) / $w) * $w AS interval_start, reason, count(*) AS lookups "
                       "FROM lookup_explanations WHERE run_id = $run AND ts BETWEEN $a AND $b "
                       "GROUP BY ALL ORDER BY interval_start, reason",
                       {"run": run_id, "w": width, "a": start, "b": end}).df()


def explained_in(con: duckdb.DuckDBPyConnection, run_id: str, start: float, end: float,
                 most: int = 1000) -> tuple[int, Explanations]:
    """How many lookups a kept capture explanation holds in a time range, and the first `most` of them
    with their evidence (a capture's can be millions: a table shows a page of them)."""
    args = {"run": run_id, "a": start, "b": end}
    where = "run_id = $run AND ts BETWEEN $a AND $b"
    n = con.execute(f"SELECT count(*) FROM lookup_explanations WHERE {where}", args).fetchone()[0]
    return n, _kept_rows(con, where, args, most)


def read_kept(con: duckdb.DuckDBPyConnection, run_id: str) -> Explanations:
    return _kept_rows(con, "run_id = $run", {"run": run_id})


def _kept_rows(con: duckdb.DuckDBPyConnection, where: str, args: dict, most: int | None = None) -> Explanations:
    """Kept explanations, in the order they were said (the first `most` of them)."""
    limit = "" if most is None else f"LIMIT {int(most)}"
    with con.cursor() as own:  # a relation of its own: the connection may hold a result not fetched to its end
        return Explanations(own.sql(
            f"SELECT {', '.join(COLUMNS).replace('evidence', 'evidence::VARCHAR AS evidence')} FROM "
            f"lookup_explanations WHERE {where} ORDER BY step, rowid {limit}", params=args).to_arrow_table())


def _keep(store: RunStore, run_id: str, found: Explanations) -> None:
    """Replace whatever was kept of the run, in one transaction, as the columns it was worked out in. A
    run deleted meanwhile keeps nothing."""
    rows = found.table.append_column("run_id", pa.array([run_id] * len(found), pa.string()))
    with store.write() as con:
        con.execute("BEGIN TRANSACTION")
        if not RunStore.has_run(con, run_id):
            con.execute("ROLLBACK")
            return
        con.execute("DELETE FROM lookup_explanations WHERE run_id = ?", [run_id])
        if found:
            RunStore.insert(con, "lookup_explanations", rows)
        con.execute("UPDATE runs SET explained_at = now()::TIMESTAMP WHERE run_id = ?", [run_id])
        con.execute("COMMIT")
