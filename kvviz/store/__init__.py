"""The run store: every step of every run in DuckDB, reached only through RunStore, and safe SQL
over it. Importing it loads no model code (`kvviz sql` stays light); the recorder lives in
kvviz.store.recorder."""

from ..errors import SqlError, StoreError
from .run_store import DEFAULT_DB, RunStore, default_path, working_db
from .schema import SCHEMA_VERSION
from .sql import QueryResult, run_query

__all__ = ["DEFAULT_DB", "SCHEMA_VERSION", "QueryResult", "RunStore", "SqlError", "StoreError", "default_path",
           "run_query", "working_db"]
