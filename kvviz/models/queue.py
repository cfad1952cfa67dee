"""Runs on one model take turns, first come first served, within a process and across processes.

Two forwards at once on one CPU model only fight over the same cores (torch already spreads one
forward over all of them), so the runs that share a model (several app sessions, a CLI script beside
the app) queue for it instead. A waiting run hears how many runs are ahead of it whenever that number
changes, and again every second, so a user sees "waiting for the model: N runs ahead" rather than a
frozen page or a slow bar, and a session whose page was left or rerun finds out (its callback raises)
before the run starts, instead of starting a run nobody watches. A turn is reentrant within a
thread: a checked run holds it across its engine run and its reference oracle.

Across processes the line is a folder of ticket files named by arrival time and process id; a
ticket whose process has died is removed by whoever sees it, so a killed run never blocks the line.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

WaitCallback = Callable[[int], None]
POLL_S = 0.1  # how often a run waiting on another process looks at the line
HEARTBEAT_S = 1.0  # a waiting run is told its place at least this often, so a page that was left notices


def waiting_message(ahead: int) -> str:
    """What the app and the CLI say while a run waits its turn."""
    return f"waiting for the model: {ahead} run{'s' if ahead != 1 else ''} ahead"


class _FileLine:
    """The machine-wide line for one model: one ticket file per run, oldest first."""

    def __init__(self, folder: Path):
        self.folder = folder

    def join(self) -> Path | None:
        """A new ticket at the end of the line; None where the folder cannot be written (a read-only
        cache): then runs queue within this process only."""
        ticket = self.folder / f"{time.time_ns():020d}-{os.getpid()}-{threading.get_ident()}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            ticket.touch()
        except OSError:
            return None
        return ticket

    def ahead(self, ticket: Path) -> int:
        """Live tickets older than this one (a dead process's tickets are removed on the way)."""
        count = 0
        for other in sorted(p.name for p in self.folder.iterdir()):
            if other >= ticket.name:
                break
            if _alive(int(other.split("-")[1])):
                count += 1
            else:
                (self.folder / other).unlink(missing_ok=True)
        return count


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:  # a zombie (exited, not yet reaped by its parent) answers the signal but holds no turn
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class ModelQueue:
    def __init__(self, line_folder: Path | None = None) -> None:
        """line_folder: where the machine-wide line lives (None: this process only)."""
        self._cond = threading.Condition()
        self._line: list[object] = []  # tickets in arrival order; the first holds the model
        self._files = _FileLine(line_folder) if line_folder is not None else None
        self._holder: int | None = None
        self._depth = 0

    @property
    def waiting(self) -> int:
        """Runs of this process queued behind the one that holds the model."""
        with self._cond:
            return max(0, len(self._line) - 1)

    @contextmanager
    def turn(self, on_wait: WaitCallback | None = None) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                self._depth += 1
                reentered = True
            else:  # both lines take this run in the same order, or two runs could each wait for the other
                reentered, ticket = False, object()
                self._line.append(ticket)
                file_ticket = self._files.join() if self._files is not None else None
        if reentered:
            try:
                yield
            finally:
                with self._cond:
                    self._depth -= 1
            return
        try:
            self._wait_for(ticket, file_ticket, me, on_wait)
            yield
        finally:
            if file_ticket is not None:
                file_ticket.unlink(missing_ok=True)
            with self._cond:
                if self._holder == me and self._line and self._line[0] is ticket:
                    self._holder = None
                self._line.remove(ticket)
                self._cond.notify_all()

    def _wait_for(self, ticket: object, file_ticket: Path | None, me: int, on_wait: WaitCallback | None) -> None:
        reported, told_at = None, 0.0
        while True:
            with self._cond:
                here = self._line.index(ticket)
                # The file line holds every run of every process, this one's included, in arrival order.
                ahead = self._files.ahead(file_ticket) if file_ticket is not None else here
                if here == 0 and ahead == 0:
                    self._holder, self._depth = me, 1
                    return
                due = on_wait is not None and (ahead != reported or time.monotonic() - told_at >= HEARTBEAT_S)
                if not due:
                    self._cond.wait(POLL_S if file_ticket is not None or on_wait is not None else None)
                    continue
            on_wait(ahead)  # outside the lock: the callback may draw, or raise to cancel the wait
            reported, told_at = ahead, time.monotonic()
