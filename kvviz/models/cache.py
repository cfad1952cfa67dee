"""Where fetched and converted weights live, and how a folder is published there atomically."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """KVVIZ_CACHE, else the user's cache folder (XDG_CACHE_HOME or ~/.cache) / kvviz."""
    root = os.environ.get("KVVIZ_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvviz"
    return Path(root).expanduser()


@contextmanager
def publish_dir(target: Path) -> Iterator[Path]:
    """Yield a scratch folder beside `target`; rename it into place only if the block succeeds,
    so a crash or Ctrl-C never leaves a half-written cache entry."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if target.exists():  # another process finished first: keep theirs
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
