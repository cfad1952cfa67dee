"""User SQL, safely: one read-only statement with a row cap and a timeout, on a RunStore reader (a
sandboxed instance that cannot touch host files, attach databases, install extensions or read
Python variables)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import duckdb

from ..errors import SqlError

ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


@dataclass
class QueryResult:
    columns: list[str]
    rows: list[tuple]
    truncated: bool  # more rows existed than the cap


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
