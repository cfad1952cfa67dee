"""Bringing a file into the store: a kvviz trace (zip), a vLLM/SGLang KV-event capture (JSONL) or a
capture dataset (a folder of Parquet), told apart by content; nothing is inserted unless all is."""

from __future__ import annotations

import re
import zipfile
from datetime import UTC, datetime
from pathlib import Path

from ..capture.events import CaptureError
from ..capture.import_vllm import Progress, import_capture, import_dataset
from ..store import RunStore
from ..store.trace import import_trace


def import_file(path: str | Path, store: RunStore, progress: Progress | None = None, in_place: bool = False) -> str:
    """Import and return the new run id; a KvvizError names the problem (and nothing was imported).
    A folder (or .parquet file) is a capture dataset; `progress` follows a capture's bytes."""
    path = Path(path)
    if path.is_dir() or path.suffix.lower() == ".parquet":
        if not path.exists():
            raise CaptureError(f"{path}: no such file or folder")
        return import_dataset(path, store, progress, in_place)
    if not path.is_file():
        raise CaptureError(f"{path}: no such file")
    if in_place:
        raise CaptureError(f"{path}: --in-place takes a capture dataset folder; a file is always copied in")
    if path.suffix.lower() == ".zip" or zipfile.is_zipfile(path):
        return import_trace(path, store)  # a .zip that is no zip gets the trace reader's "not a zip" error
    return import_capture(path, store, progress)


def save_upload(name: str, data: bytes, folder: str | Path) -> Path:
    """Keep the uploaded bytes under the uploads folder (a refused file stays there to fix and retry)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name)[-100:] or "upload"
    path = folder / f"{datetime.now(UTC):%Y%m%d-%H%M%S-%f}-{safe}"
    path.write_bytes(data)
    return path
