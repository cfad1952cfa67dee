"""The run store: one DuckDB file, one writer. Opening creates or checks the versioned schema."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb

SCHEMA_VERSION = "2"
UPGRADABLE = {"1"}  # versions whose files the idempotent schema script brings up to date
SCHEMA = Path(__file__).with_name("schema.sql")
DEFAULT_DB = Path("runs") / "kvviz.duckdb"


class StoreError(RuntimeError):
    """The database cannot be used: wrong schema version, not a DuckDB file, locked by a writer."""


def open_writer(path: str | Path = DEFAULT_DB) -> duckdb.DuckDBPyConnection:
    """The read-write connection (one per process): creates the file and schema on first use."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = duckdb.connect(str(path))
    except duckdb.Error as e:
        raise StoreError(f"cannot open {path} for writing: {e}") from None
    found = _version(con)
    if found is None or found in UPGRADABLE:
        con.execute(SCHEMA.read_text())
        con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [SCHEMA_VERSION])
    elif found != SCHEMA_VERSION:
        con.close()
        raise StoreError(f"{path} has schema version {found}; this kvviz reads version {SCHEMA_VERSION}")
    return con


def require_run(con: duckdb.DuckDBPyConnection, run_id: str) -> None:
    """Refuse a run id this database does not hold, in the same words for every reader."""
    if not con.execute("SELECT count(*) FROM runs WHERE run_id = ?", [run_id]).fetchall()[0][0]:
        raise StoreError(f"no run {run_id!r} in this database")


def _version(con: duckdb.DuckDBPyConnection) -> str | None:
    has_meta = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'meta'").fetchone()[0]
    if not has_meta:
        return None
    row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return row[0] if row else None


class _Gate:
    """Readers or one writer at a time within this process: DuckDB refuses to hold a file open
    read-only and read-write in one process at once, and the UI reads while a run records."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


GATE = _Gate()
LOCK_WAIT_S = 15.0  # how long to wait for another process's writer to let go of the file


def retry_locked(open_fn, path: Path):
    """Open, waiting while another process holds the file (a recorder flushes for milliseconds)."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            return open_fn()
        except Exception as e:
            if "lock" not in str(e).lower():
                raise
            if time.monotonic() > deadline:
                raise StoreError(f"{path} is held by another process for longer than {LOCK_WAIT_S:g} s "
                                 f"({str(e).splitlines()[0]})") from None
            time.sleep(0.01)


@contextmanager
def writing(path: str | Path = DEFAULT_DB) -> Iterator[duckdb.DuckDBPyConnection]:
    """A short-lived read-write connection, exclusive within this process, closed on exit (closing
    checkpoints the file, about 0.1 s: writers that repeat, like the recorder, space their writes)."""
    with GATE.write():
        con = retry_locked(lambda: open_writer(path), Path(path))
        try:
            yield con
        finally:
            con.close()
