"""User SQL, safely: one read-only statement with a row cap and a timeout, on a RunStore reader (a
sandboxed instance that cannot touch host files, attach databases, install extensions or read
Python variables)."""

from __future__ import annotations

import re
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
        raise SqlError(f"cannot parse the query: {_one_line(e)}") from None
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
        raise SqlError(_one_line(e)) from None
    finally:
        timer.cancel()
    return QueryResult(columns, rows[:max_rows], len(rows) > max_rows)


def _one_line(e: duckdb.Error) -> str:
    """DuckDB's message in one line: what it says (a "did you mean" hint too), and where its caret points."""
    lines = str(e).split("\n")
    said = " ".join(x.strip() for x in lines if x.strip() and not x.startswith("LINE ") and x.strip("^ "))
    # DuckDB names its internal stage ("Binder Error: ", "Catalog Error: ") and ends its first clause with
    # "!": neither means anything to the reader, so one clause, then the hint after a semicolon.
    said = re.sub(r"^[A-Za-z]+ Error: ", "", said).replace("! ", "; ", 1).rstrip("!")
    said = re.sub(r'; Did you mean "(?:\w+\.)?(?:duckdb_|pg_|information_schema)[^"]*"\?', "", said)  # DuckDB's own
    for text, caret in zip(lines, lines[1:], strict=False):
        if text.startswith("LINE ") and "^" in caret:
            prefix = text[:text.index(": ") + 2]
            return f"{said} (line {prefix[5:-2]}, column {caret.index('^') - len(prefix) + 1})"
    return said
