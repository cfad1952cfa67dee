"""RunStore: the one way into a run store file. Nothing else in kvviz opens it.

One object per file per process (`RunStore.open`), made from `--db` / `$KVVIZ_DB`, owns:
- the writer: short-lived read-write connections, exclusive within the process, that create the
  schema on first use and upgrade an older version in place;
- the readers: short-lived sandboxed read-only connections (no host files, no extensions, no
  Python variables: safe for user SQL too);
- the in-process gate between them (DuckDB refuses to hold one file read-only and read-write in
  one process at once, and the app reads while a run records);
- the wait for another process (a recorder holds the file only while it flushes).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeVar

import duckdb
import pyarrow as pa

from ..errors import StoreError
from . import schema

DEFAULT_DB = Path("runs") / "kvviz.duckdb"
LOCK_WAIT_S = 15.0  # how long to wait for another process's writer to let go of the file
LOCK_POLL_S = 0.01  # how often a connection waiting for another process tries again
TURN_S = 1.0  # how long a long writer (WriterTurns) holds the file before it lets others in
READER = {  # read-only connections; the first one of an instance also turns off host files (_connect_reader)
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "python_enable_replacements": False,
    "threads": 2,
    "memory_limit": "2GB",
}
T = TypeVar("T")


def working_db() -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB of no store, for working tables that live as long as their owner (a live
    monitor folds each slice of a stream in one): still opened here, where every connection is."""
    return duckdb.connect(":memory:")


def default_path() -> Path:
    """$KVVIZ_DB, or runs/kvviz.duckdb: what the app and every CLI command use without --db."""
    return Path(os.environ.get("KVVIZ_DB") or DEFAULT_DB)


class _Gate:
    """Readers, or one writer, at a time within this process. A writer lets readers that are already
    waiting go first, so one that writes in turns (a long import) never shuts the app out."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._waiting = 0  # readers waiting for a writer to finish
        self._writing = False

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._writing)
            self._waiting -= 1
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
            self._cond.wait_for(lambda: not self._writing and self._readers == 0 and self._waiting == 0)
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class RunStore:
    _open: dict[Path, RunStore] = {}
    _registry = threading.Lock()

    def __init__(self, path: Path):
        self.path = path
        self._gate = _Gate()
        self._reader_setup = threading.Lock()  # concurrent readers share one DuckDB instance per file

    @classmethod
    def open(cls, path: str | Path | None = None) -> RunStore:
        """The store for a file (default: $KVVIZ_DB or runs/kvviz.duckdb), one object per file per process."""
        key = Path(path if path is not None else default_path()).expanduser().resolve()
        with cls._registry:
            if key not in cls._open:
                cls._open[key] = cls(key)
            return cls._open[key]

    def __repr__(self) -> str:
        return f"RunStore({str(self.path)!r})"

    @property
    def captures_dir(self) -> Path:
        """Where the store keeps the capture datasets it owns (JSONL captures, decoded on import):
        beside the database file; deleting the run deletes its dataset."""
        return self.path.parent / "captures"

    @property
    def attention_dir(self) -> Path:
        """Where recorders write runs' attention rows as Parquet parts (attention/RUN_ID/*.parquet): beside
        the database file, moved with it; deleting the run deletes its folder."""
        return self.path.parent / "attention"

    def owns(self, dataset: str | Path) -> bool:
        return Path(dataset).parent == self.captures_dir.resolve()

    def exists(self) -> bool:
        return self.path.is_file()

    def _not_a_folder(self) -> None:
        if self.path.is_dir():
            raise StoreError(f"{self.path} is a folder, not a run store: give a .duckdb file")

    # -- connections ---------------------------------------------------------------------------
    @contextmanager
    def write(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-write connection, exclusive within this process, closed (checkpointed, ~0.1 s) on exit:
        writers that repeat, like the recorder, space their writes."""
        with self._gate.write():
            con = self._wait_out_lock(self._connect_writer)
            try:
                yield con
            finally:
                con.close()

    def in_turns(self, setup: Callable[[duckdb.DuckDBPyConnection], None] = lambda con: None,
                 hold_s: float = TURN_S) -> WriterTurns:
        """A writer for long work (an import), given up every `hold_s` seconds so other readers and
        writers, in this process and others, get the file between its turns; `setup` runs on each
        new connection."""
        return WriterTurns(self, setup, hold_s)

    @contextmanager
    def read(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A sandboxed read-only connection; writers in this process wait until it closes. An older
        file is upgraded first (through the writer)."""
        self._not_a_folder()
        if not self.exists():
            raise StoreError(f"no database at {self.path}: run something first (python -m kvviz run ...)")
        for attempt in range(2):
            with self._gate.read():
                con = self._wait_out_lock(self._connect_reader)
                found = _version(con)
                if found == schema.SCHEMA_VERSION and not (attempt == 0
                                                           and schema.datasets_gone(con, self.attention_dir)):
                    try:
                        yield con
                    finally:
                        con.close()
                    return
                con.close()
            if found != schema.SCHEMA_VERSION and (attempt or not (found is None or found in schema.UPGRADABLE)):
                raise self._wrong_version(found)
            with self.write():  # upgrades in place, or drops a dataset that has gone from kv_events
                pass

    @contextmanager
    def scratch(self, threads: int = 2, memory_limit: str = "1GB") -> Iterator[duckdb.DuckDBPyConnection]:
        """An in-memory DuckDB that holds nothing of the store (long work over a dataset registered in
        place, so the store's readers and writers go on), spilling into a folder beside the store that
        is removed with it (or in the system's temporary folder, beside a store this user may only read)."""
        try:
            beside = tempfile.TemporaryDirectory(dir=self.path.parent, prefix=".scratch-")
        except OSError:
            beside = tempfile.TemporaryDirectory(prefix="kvviz-scratch-")
        with beside as spill:
            con = duckdb.connect(":memory:", config={"threads": threads, "memory_limit": memory_limit,
                                                     "temp_directory": spill})
            try:
                yield con
            finally:
                con.close()

    @contextmanager
    def scratch_over(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A scratch DuckDB (its own memory limit and spill folder) with this store attached read-only as
        `store`: long work over rows the store holds, as a reader (writers in this process wait)."""
        with self._gate.read(), self.scratch() as con:

            def attach() -> None:
                try:
                    con.execute("ATTACH '" + str(self.path).replace("'", "''") + "' AS store (READ_ONLY)")
                except duckdb.Error as e:
                    raise StoreError(f"cannot open {self.path} read-only: {_first_line(e)}") from None

            self._wait_out_lock(attach)
            yield con

    @staticmethod
    def insert(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table) -> None:
        """Append an Arrow table to a declared table, by column name, cast to the declared types
        (inside the caller's transaction); rows that do not fit are a StoreError naming the column."""
        if table not in schema.TABLES:
            raise StoreError(f"no table {table!r} in the run store's schema")
        try:
            rows = schema.conform(table, rows)
        except ValueError as e:
            raise StoreError(str(e)) from None
        con.register("_kvviz_rows", rows)
        try:
            con.execute(f"INSERT INTO {schema.TABLES[table].base} BY NAME SELECT * FROM _kvviz_rows")
        finally:
            con.unregister("_kvviz_rows")

    @staticmethod
    def has_run(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
        return bool(con.execute("SELECT count(*) FROM runs WHERE run_id = ?", [run_id]).fetchall()[0][0])

    @classmethod
    def require_run(cls, con: duckdb.DuckDBPyConnection, run_id: str) -> None:
        """Refuse a run id this database does not hold, in the same words for every reader."""
        if not cls.has_run(con, run_id):
            raise StoreError(f"no run {run_id!r} in this database")

    # -- internals -----------------------------------------------------------------------------
    def _connect_writer(self) -> duckdb.DuckDBPyConnection:
        self._not_a_folder()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            con = duckdb.connect(str(self.path))
        except (duckdb.Error, OSError) as e:
            raise StoreError(f"cannot open {self.path} for writing: {_first_line(e)}") from None
        try:
            self._ensure_schema(con)
        except BaseException:
            con.close()
            raise
        return con

    def _ensure_schema(self, con: duckdb.DuckDBPyConnection) -> None:
        """Create the schema in a new file, upgrade an older one, refuse an unknown version (a cheap
        check on every connection: another process may have replaced the file)."""
        found = _version(con)
        if found is None or found in schema.UPGRADABLE:
            schema.rename_old_tables(con)
            con.execute(schema.ddl())
            schema.refresh_file_views(con, self.attention_dir)
            con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [schema.SCHEMA_VERSION])
        elif found != schema.SCHEMA_VERSION:
            raise self._wrong_version(found)
        elif schema.datasets_gone(con, self.attention_dir):
            schema.refresh_file_views(con, self.attention_dir)

    def _wrong_version(self, found: str | None) -> StoreError:
        return StoreError(f"{self.path} has schema version {found}; this kvviz reads version {schema.SCHEMA_VERSION}")

    def _connect_reader(self) -> duckdb.DuckDBPyConnection:
        """The first reader of a DuckDB instance sandboxes it for every later one: no host files but the
        capture datasets registered in place and the store's attention parts, then the configuration locked
        (user SQL cannot undo it)."""
        with self._reader_setup:
            try:
                con = duckdb.connect(str(self.path), read_only=True, config=READER)
            except duckdb.Error as e:
                raise StoreError(f"cannot open {self.path} read-only: {_first_line(e)}") from None
            if not con.execute("SELECT current_setting('lock_configuration')").fetchone()[0]:
                dirs = [*schema.capture_dirs(con), str(self.attention_dir) + "/"]
                con.execute("SET allowed_directories = [" + ", ".join("'" + d.replace("'", "''") + "'"
                                                                      for d in dirs) + "]")
                con.execute("SET enable_external_access = false")
                con.execute("SET lock_configuration = true")  # the instance stays locked for later readers
        return con

    def refresh_file_views(self, con: duckdb.DuckDBPyConnection) -> None:
        """After a dataset is registered in place, a run's first attention part written or a run deleted:
        kv_events and attention cover what is there."""
        schema.refresh_file_views(con, self.attention_dir)

    def _wait_out_lock(self, connect: Callable[[], T]) -> T:
        """Connect, waiting while another process holds the file (a recorder flushes for milliseconds)."""
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                return connect()
            except StoreError as e:
                if "lock" not in str(e).lower():
                    raise
                if time.monotonic() > deadline:
                    raise StoreError(f"{self.path} is held by another process for longer than {LOCK_WAIT_S:g} s "
                                     f"({e})") from None
                time.sleep(LOCK_POLL_S)


class WriterTurns:
    """`con()` is a writer connection, the same one until `hold_s` has passed since it was taken;
    `release_if_due()` (called when a piece of work is done) then closes it, committed, so others
    get the file until the next `con()`. Work between two calls must be complete in itself: whatever
    reads the file between turns sees it."""

    def __init__(self, store: RunStore, setup: Callable[[duckdb.DuckDBPyConnection], None], hold_s: float):
        self._store, self._setup, self._hold_s = store, setup, hold_s
        self._turn: ExitStack | None = None
        self._con: duckdb.DuckDBPyConnection | None = None
        self._until = self._released = 0.0

    def con(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            time.sleep(max(0.0, self._released + 3 * LOCK_POLL_S - time.monotonic()))  # another process's
            self._turn = ExitStack()                                  # next try lands in the gap
            self._con = self._turn.enter_context(self._store.write())
            self._setup(self._con)
            self._until = time.monotonic() + self._hold_s
        return self._con

    def release_if_due(self) -> None:
        if self._con is not None and time.monotonic() >= self._until:
            self.close()

    def close(self) -> None:
        if self._turn is not None:
            self._turn.close()
            self._released = time.monotonic()
        self._turn = self._con = None

    def __enter__(self) -> WriterTurns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _version(con: duckdb.DuckDBPyConnection) -> str | None:
    """The file's schema version; None for a new file (asking is a tenth of looking in the catalog)."""
    try:
        row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except duckdb.CatalogException:
        return None
    return row[0] if row else None


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
