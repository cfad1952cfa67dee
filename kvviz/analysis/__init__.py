"""Reads for the UI: a run in the store as the frames and arrays the views and figures draw.

Everything here takes an open (read-only) connection and returns pandas frames, numpy arrays or
small dataclasses; nothing draws and nothing writes, except `delete_run`.
"""
