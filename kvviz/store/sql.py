"""User SQL, safely: a separate read-only DuckDB instance that cannot touch host files, attach
databases, install extensions or read Python variables, and runs one read-only statement with a
row cap and a timeout."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb

from .db import GATE, StoreError, retry_locked

ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
LOCKDOWN = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "python_enable_replacements": False,
    "threads": 2,
    "memory_limit": "2GB",
}


class SqlError(ValueError):
    """The query was refused or failed; the message says why in plain words."""


@dataclass
class QueryResult:
    columns: list[str]
    rows: list[tuple]
    truncated: bool  # more rows existed than the cap


def open_sandbox(path: str | Path) -> duckdb.DuckDBPyConnection:
    path = Path(path)
    if not path.exists():
        raise SqlError(f"no database at {path}: run something first (python -m kvviz run ...)")
    try:
        con = duckdb.connect(str(path), read_only=True, config=LOCKDOWN)
    except duckdb.Error as e:
        raise SqlError(f"cannot open {path} read-only: {e}") from None
    if not con.execute("SELECT current_setting('lock_configuration')").fetchone()[0]:
        con.execute("SET lock_configuration = true")  # (a reopened instance in this process stays locked)
    return con


@contextmanager
def reading(path: str | Path) -> Iterator[duckdb.DuckDBPyConnection]:
    """A short-lived sandboxed connection for the UI's reads and user SQL alike; writers in this
    process wait until it closes, and another process's flush is waited out."""
    with GATE.read():
        try:
            con = retry_locked(lambda: open_sandbox(path), Path(path))
        except StoreError as e:
            raise SqlError(str(e)) from None
        try:
            yield con
        finally:
            con.close()


def run_query(con: duckdb.DuckDBPyConnection, sql: str, max_rows: int = 10_000, timeout_s: float = 30.0) -> QueryResult:
    """One SELECT (or EXPLAIN) statement; anything else is refused before it runs."""
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise SqlError(f"cannot parse the query: {e}") from None
    if len(statements) != 1:
        raise SqlError(f"give exactly one statement, got {len(statements)}")
    kind = statements[0].type
    if kind not in ALLOWED:
        raise SqlError(f"only SELECT queries are allowed here, not {kind.name}")
    timer = threading.Timer(timeout_s, con.interrupt)
    timer.start()
    try:
        cur = con.execute(sql)
        rows = cur.fetchmany(max_rows + 1)
        columns = [d[0] for d in cur.description] if cur.description else []
    except duckdb.InterruptException:
        raise SqlError(f"the query ran longer than {timeout_s:g} s and was stopped") from None
    except duckdb.Error as e:
        raise SqlError(str(e).split("\n")[0]) from None
    finally:
        timer.cancel()
    return QueryResult(columns, rows[:max_rows], len(rows) > max_rows)
