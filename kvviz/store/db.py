"""The run store: one DuckDB file, one writer. Opening creates or checks the versioned schema."""

from __future__ import annotations

from pathlib import Path

import duckdb

SCHEMA_VERSION = "1"
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
    if found is None:
        con.execute(SCHEMA.read_text())
        con.execute("INSERT INTO meta VALUES ('schema_version', ?)", [SCHEMA_VERSION])
    elif found != SCHEMA_VERSION:
        con.close()
        raise StoreError(f"{path} has schema version {found}; this kvviz reads version {SCHEMA_VERSION}")
    return con


def _version(con: duckdb.DuckDBPyConnection) -> str | None:
    has_meta = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'meta'").fetchone()[0]
    if not has_meta:
        return None
    row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return row[0] if row else None
