"""The one error root: every refusal kvviz says to a user in one sentence is a KvvizError.

The CLI and the app each catch KvvizError in one place and show its message; anything else that
escapes is a bug and keeps its traceback (no broad ValueError turns an engine bug into a polite
refusal). Each subclass names the kind of input that was wrong.
"""


class KvvizError(Exception):
    """Bad input or an unusable resource, said in one sentence that names the file, field or place."""


class WorkloadError(KvvizError):
    """A workload, scenario, fault, scope or engine setting is malformed or cannot run."""


class ModelError(KvvizError):
    """A model could not be loaded."""


class StoreError(KvvizError):
    """The run store cannot be used: not a DuckDB file, another schema version, locked, no such run."""


class CaptureError(KvvizError):
    """A file brought in (a vLLM/SGLang capture or a kvviz trace) is malformed; nothing was imported."""


class SqlError(KvvizError):
    """A user's SQL query was refused or failed."""


class AuditError(KvvizError):
    """A timing audit cannot run: its settings are wrong or the server does not answer as an OpenAI API."""
