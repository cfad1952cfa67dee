"""Reads for the views: a run in the store as the frames and arrays the views and figures draw.

Everything here takes an open (read-only) connection and returns pandas frames, numpy arrays or
small dataclasses; nothing draws, runs a model or starts a thread (kvviz.runners does). The only
writes are data: explanations kept for the next reader (`explained`) and `delete_run`.
"""
