"""The run store: every step of every run in DuckDB, and safe SQL over it."""

from .db import DEFAULT_DB, SCHEMA_VERSION, StoreError, open_writer
from .recorder import RunRecorder
from .sql import QueryResult, SqlError, open_sandbox, run_query

__all__ = ["DEFAULT_DB", "SCHEMA_VERSION", "QueryResult", "RunRecorder", "SqlError", "StoreError", "open_sandbox",
           "open_writer", "run_query"]
