"""A JSONL capture written as a capture dataset by one process per core, each taking whole replicas.

A replica's rows depend only on its own earlier messages (rows.py keeps the cache state per replica)
and the dataset keeps each replica in its own folder, so the work splits by replica with nothing to
merge: every process reads every line, counts every message (a step is the capture's message
count), and decodes and writes only its own replicas' messages. Errors stay those of a one-process
import: each process stops at its first bad message, and the earliest in the file is the capture's;
whichever process finds one tells the others not to read past it.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..util.gcpause import paused_gc
from .capture_file import CaptureReader
from .dataset import DatasetWriter, check_name, write_manifest
from .events import CaptureError, decode_batch

Progress = Callable[[int, int], None]  # (bytes read, bytes in all)
SPLIT_FROM_BYTES = 32 << 20  # a smaller capture is written faster than a second process starts
CHECK_EVERY = 1024  # messages between looks at whether another process found an earlier error


@dataclass(frozen=True)
class Written:
    """What one process wrote: the capture's message count and, per replica, its first step."""
    messages: int
    first: dict[str, int]


@dataclass(frozen=True)
class Failed:
    """A process's first bad message: its place among the capture's messages, and what is wrong."""
    at: int
    message: str


@dataclass(frozen=True)
class Plan:
    """Which process writes which replica: the header's replicas in turn, any other by its name's hash."""
    workers: int
    named: dict[str, int]

    def owner(self, replica: str) -> int:
        owner = self.named.get(replica)
        return zlib.crc32(replica.encode()) % self.workers if owner is None else owner


def write_dataset(path: Path, folder: Path, progress: Progress | None = None, workers: int | None = None) -> Written:
    """Decode the capture at `path` into a dataset at `folder` (which the caller removes on failure);
    CaptureError names the first bad line, as a one-process import would."""
    replicas = CaptureReader(path).replicas
    n = workers or _workers(path, len(replicas))
    plan = Plan(n, {name: i % n for i, name in enumerate(replicas)})
    if n == 1:
        got = _write_share(path, folder, plan, 0, progress)
    else:
        got = _write_shares(path, folder, plan, progress)
    write_manifest(folder, {name: "" for name in sorted(got.first, key=got.first.get)}, got.messages, complete=True)
    return got


def _workers(path: Path, replicas: int) -> int:
    """One process per core this process may use, up to one per replica the header names; one for a
    small capture, and off Linux (the children are told to stop through a pipe that select watches)."""
    if replicas < 2 or path.stat().st_size < SPLIT_FROM_BYTES or not hasattr(os, "sched_getaffinity"):
        return 1
    return max(1, min(replicas, len(os.sched_getaffinity(0))))


def _write_shares(path: Path, folder: Path, plan: Plan, progress: Progress | None) -> Written:
    """This process writes share 0 while child processes write the rest."""
    children = [_Child(path, folder, plan, index) for index in range(1, plan.workers)]
    try:
        results = [_outcome(lambda: _write_share(path, folder, plan, 0, progress, lambda: _earliest(children)))]
        for child in children:
            if isinstance(results[0], Failed):
                child.tell(results[0].at)
            results.append(child.result())
    finally:
        for child in children:
            child.close()
    failed = [r for r in results if isinstance(r, Failed)]
    if failed:
        raise CaptureError(min(failed, key=lambda f: f.at).message)
    first = {name: step for r in results for name, step in r.first.items()}
    return Written(max(r.messages for r in results), first)


class _Child:
    """A share written by `python -m` this module. Not multiprocessing: spawning runs the caller's own
    script again in the child (a user's script without a main guard would import twice), and forking
    is unsafe from the app's threads."""

    def __init__(self, path: Path, folder: Path, plan: Plan, index: int):
        root = str(Path(__file__).parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        self.index, self.errors, self._got = index, tempfile.TemporaryFile(), None
        self.proc = subprocess.Popen([sys.executable, "-m", __spec__.name, str(path), str(folder),
                                      json.dumps(asdict(plan)), str(index)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors, env=env)

    def done(self) -> bool:
        return self.proc.poll() is not None

    def tell(self, at: int) -> None:
        """It need not read past `at`: an earlier message is bad."""
        if not self.done():
            try:
                self.proc.stdin.write(f"{at}\n".encode())
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass  # it has just finished

    def result(self) -> Written | Failed:
        if self._got is None:
            out, _ = self.proc.communicate()
            if self.proc.returncode:
                self.errors.seek(0)
                said = self.errors.read().decode(errors="replace").strip()[-2000:]
                raise RuntimeError(f"the import's process {self.index} failed (exit code {self.proc.returncode}): "
                                   f"{said}")
            got = json.loads(out)
            self._got = Failed(**got) if "at" in got else Written(**got)
        return self._got

    def close(self) -> None:
        if not self.done():
            self.proc.kill()
        self.proc.wait()
        self.errors.close()


def _earliest(children: list[_Child]) -> int | None:
    """The place of the earliest bad message a finished child found, if any."""
    return min((r.at for r in (c.result() for c in children if c.done()) if isinstance(r, Failed)), default=None)


def _outcome(write: Callable[[], Written]) -> Written | Failed:
    try:
        return write()
    except _Bad as e:
        return Failed(e.at, e.message)


class _Bad(Exception):
    def __init__(self, at: int, message: str):
        super().__init__(message)
        self.at, self.message = at, message


def _write_share(path: Path, folder: Path, plan: Plan, index: int, progress: Progress | None,
                 stop: Callable[[], int | None] | None = None) -> Written:
    """Write this process's replicas. A bad message is CaptureError (one process) or _Bad with its
    place (several); `stop` says where another process found one, and no further is read then."""
    reader = CaptureReader(path, None if plan.workers == 1 else lambda r: plan.owner(r) == index)
    writer = DatasetWriter(folder, {}, share=True)
    total, limit = max(path.stat().st_size, 1), None
    try:
        with paused_gc():
            for where, m in reader:
                at = writer.count
                if at % CHECK_EVERY == 0:
                    if progress is not None:
                        progress(min(reader.bytes_read, total), total)
                    if stop is not None and limit is None:
                        limit = stop()
                if limit is not None and at >= limit:
                    return Written(at, writer.first)
                if m is None:
                    writer.skip()
                    continue
                check_name(m.replica, f"{where}:")
                where = f"{where} (seq {m.seq})"
                writer.add(m, decode_batch(m.payload, where), where)
        writer.close()
    except CaptureError as e:
        if plan.workers == 1:
            raise
        raise _Bad(writer.count, str(e)) from None
    if progress is not None:
        progress(total, total)
    return Written(writer.count, writer.first)


def _told() -> int | None:
    """In a child: the place of an earlier bad message, once the parent has said one."""
    if select.select([sys.stdin], [], [], 0)[0]:
        line = sys.stdin.readline()
        return int(line) if line.strip() else None
    return None


def _child_main() -> None:
    path, folder, plan, index = sys.argv[1:5]
    said = json.loads(plan)
    got = _outcome(lambda: _write_share(Path(path), Path(folder), Plan(said["workers"], said["named"]), int(index),
                                        None, _told))
    print(json.dumps(asdict(got)))


if __name__ == "__main__":
    _child_main()
