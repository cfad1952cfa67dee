"""Bringing a file into the store: a kvviz trace (zip), a vLLM/SGLang KV-event capture (JSONL), a
Mooncake request trace (JSONL of hash_ids, imported as a capture) or a capture dataset (a folder of
Parquet), told apart by content; nothing is inserted unless all is."""

from __future__ import annotations

import hashlib
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..capture.events import CaptureError
from ..capture.import_vllm import Progress, import_capture, import_dataset
from ..capture.mooncake import import_mooncake, is_mooncake
from ..capture.synthetic import example_file
from ..store import RunStore
from ..store.trace import import_trace, trace_run_id


def import_file(path: str | Path, store: RunStore, progress: Progress | None = None, in_place: bool = False,
                sha256: str | None = None) -> str:
    """Import and return the new run id; a KvvizError names the problem (and nothing was imported).
    A folder (or .parquet file) is a capture dataset; a JSON-lines file whose first line is a request
    with hash_ids is a Mooncake trace, any other a vLLM/SGLang capture; `progress` follows a capture's
    bytes; a JSONL capture's or trace's run keeps `sha256` (its bytes', from `earlier_import`) so that it
    is not imported twice."""
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
    if is_mooncake(path):
        return import_mooncake(path, store, progress, sha256=sha256)
    return import_capture(path, store, progress, sha256=sha256)


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


def example_capture(folder: str | Path, events: int = 200_000) -> Path:
    """A synthetic fleet's capture (kvviz/capture/synthetic.py, not from a server) kept among the
    uploads, to try the capture views without a fleet: written once, the same every time."""
    return example_file(Path(folder) / "example", events)


@dataclass(frozen=True)
class Earlier:
    """What says whether a file was imported before: a capture's bytes (their sha256, which its run keeps)
    or the run a trace carries."""

    sha256: str | None
    run_id: str | None  # the complete run this very file was imported as, if that run is still in the store


def earlier_import(path: str | Path, store: RunStore) -> Earlier:
    """Whether this very file is in the store already: a trace by the run it carries, a capture by its
    bytes' sha256 (about a second a gigabyte); a dataset (folder or part) is not looked for."""
    path = Path(path)
    if not path.is_file() or path.suffix.lower() == ".parquet":
        return Earlier(None, None)
    if zipfile.is_zipfile(path):
        run_id = trace_run_id(path)
        if not run_id or not store.exists():
            return Earlier(None, None)
        with store.read() as con:
            return Earlier(None, run_id if RunStore.has_run(con, run_id) else None)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    if not store.exists():  # the import makes it
        return Earlier(sha256, None)
    with store.read() as con:
        row = con.execute("SELECT run_id FROM runs WHERE status = 'complete' AND workload->>'sha256' = ? "
                          "ORDER BY created_at DESC LIMIT 1", [sha256]).fetchone()
    return Earlier(sha256, row[0] if row else None)


def refused(saved: Path) -> None:
    """A refused upload is not kept: the user still has the file, and nothing of it was imported."""
    shutil.rmtree(saved.parent, ignore_errors=True)
