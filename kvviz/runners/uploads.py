"""Bringing a file into the store: a kvviz trace (zip), a vLLM/SGLang KV-event capture (JSONL) or a
capture dataset (a folder of Parquet), told apart by content; nothing is inserted unless all is."""

from __future__ import annotations

import hashlib
import re
import shutil
import uuid
import zipfile
from pathlib import Path

from ..capture.events import CaptureError
from ..capture.import_vllm import Progress, import_capture, import_dataset
from ..capture.synthetic import write_example
from ..store import RunStore
from ..store.trace import import_trace

_RUN_MARKER = ".run_id"  # beside an upload that was imported: its run


def import_file(path: str | Path, store: RunStore, progress: Progress | None = None, in_place: bool = False) -> str:
    """Import and return the new run id; a KvvizError names the problem (and nothing was imported).
    A folder (or .parquet file) is a capture dataset; `progress` follows a capture's bytes."""
    path = Path(path)
    if path.is_dir() or path.suffix.lower() == ".parquet":
        if not path.exists():
            raise CaptureError(f"{path}: no such file or folder")
        run_id = import_dataset(path, store, progress, in_place)
        if in_place:
            _with_cluster_result(store, run_id, path)
        return run_id
    if not path.is_file():
        raise CaptureError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise CaptureError(f"{path}: the file is empty")
    if in_place:
        raise CaptureError(f"{path}: --in-place takes a capture dataset folder; a file is always copied in")
    if path.suffix.lower() == ".zip" or zipfile.is_zipfile(path):
        return import_trace(path, store)  # a .zip that is no zip gets the trace reader's "not a zip" error
    return import_capture(path, store, progress)


def _with_cluster_result(store: RunStore, run_id: str, path: Path) -> None:
    """Keep the reasons a cluster wrote back beside the dataset; a result that cannot be read undoes the
    import (all or nothing, as for the dataset itself)."""
    from ..analysis.explained import keep_cluster_result
    from ..analysis.runs import delete_run

    try:
        keep_cluster_result(store, run_id, path)
    except Exception:
        delete_run(store, run_id)
        raise


def save_upload(name: str, data: bytes, folder: str | Path) -> Path:
    """Keep the uploaded bytes under the uploads folder, by content (the same file uploaded twice is
    one copy, two files of one name are two) and by the name the user gave it, which names the run."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name).lstrip(".")[-100:] or "upload"
    path = Path(folder) / hashlib.sha256(data).hexdigest()[:32] / safe
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


EXAMPLE = "example-fleet.jsonl"


def example_capture(folder: str | Path, events: int = 200_000) -> Path:
    """A synthetic fleet's capture (kvviz/capture/synthetic.py, not from a server) kept among the
    uploads, to try the capture views without a fleet: written once, the same every time."""
    path = Path(folder) / "example" / EXAMPLE
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.parent / f"_{uuid.uuid4().hex}.{EXAMPLE}"  # another session may be writing it too
        write_example(partial, events)
        partial.replace(path)
    return path


def earlier_import(saved: Path, store: RunStore) -> str | None:
    """The run this very file was imported as before, if that run is still in the store."""
    marker = saved.parent / _RUN_MARKER
    run_id = marker.read_text().strip() if marker.is_file() else ""
    if not run_id:
        return None
    with store.read() as con:
        return run_id if RunStore.has_run(con, run_id) else None


def imported(saved: Path, run_id: str) -> None:
    (saved.parent / _RUN_MARKER).write_text(run_id)


def refused(saved: Path) -> None:
    """A refused upload is not kept: the user still has the file, and nothing of it was imported."""
    shutil.rmtree(saved.parent, ignore_errors=True)
