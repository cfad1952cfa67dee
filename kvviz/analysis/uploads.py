"""Bringing a file into the store: a kvviz trace (zip) or a vLLM/SGLang KV-event capture (JSONL),
told apart by content, validated whole before anything is inserted."""

from __future__ import annotations

import re
import zipfile
from datetime import UTC, datetime
from pathlib import Path

from ..capture.events import CaptureError
from ..capture.import_vllm import import_capture
from ..store import RunStore
from ..store.trace import import_trace


def import_file(path: str | Path, store: RunStore) -> str:
    """Import and return the new run id; a KvvizError names the problem (and nothing was imported)."""
    path = Path(path)
    if path.is_dir():
        raise CaptureError(f"{path}: is a folder; give a kvviz trace (.zip) or a capture file")
    if not path.is_file():
        raise CaptureError(f"{path}: no such file")
    if path.suffix.lower() == ".zip" or zipfile.is_zipfile(path):
        return import_trace(path, store)  # a .zip that is no zip gets the trace reader's "not a zip" error
    return import_capture(path, store)


def save_upload(name: str, data: bytes, folder: str | Path) -> Path:
    """Keep the uploaded bytes under the uploads folder (a refused file stays there to fix and retry)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name)[-100:] or "upload"
    path = folder / f"{datetime.now(UTC):%Y%m%d-%H%M%S-%f}-{safe}"
    path.write_bytes(data)
    return path
