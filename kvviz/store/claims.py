"""Work on a run that one process at a time should do (explaining a capture of millions of events takes
minutes): claimed by a file beside the store naming the process, so a second process (another app
server, the CLI) waits for the first one's answer instead of doing the work again. A claim whose
process has died is taken over; a folder this user may not write to holds no claims (each process
then does its own work, as before claims)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def claim_path(store_path: Path, what: str) -> Path:
    return store_path.parent / f".{store_path.name}.{what}.claim"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def holder(store_path: Path, what: str) -> int | None:
    """The pid of the live process that holds the claim, or None (unclaimed, or its holder died)."""
    try:
        pid = int(claim_path(store_path, what).read_text())
    except (OSError, ValueError):
        return None
    return pid if pid != os.getpid() and alive(pid) else None


@contextmanager
def claimed(store_path: Path, what: str) -> Iterator[int | None]:
    """Yields None with the claim held by this process (released on exit), or the pid of the live
    process that holds it."""
    path = claim_path(store_path, what)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            other = holder(store_path, what)
            if other is not None:
                yield other
                return
            path.unlink(missing_ok=True)  # its process died: taken over
            continue
        except OSError:  # a folder this user may only read: no claim, the work is done here
            yield None
            return
        try:
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            yield None
        finally:
            path.unlink(missing_ok=True)
        return
    yield None  # lost the race to take over twice: do the work here
