"""Runs on one model take turns, first come first served.

Two forwards at once on one CPU model only fight over the same cores (torch already spreads one
forward over all of them), so the runs of a process that share a model (several app sessions, the
server) queue for it instead. A waiting run hears how many runs are ahead of it whenever that
number changes, so a user sees "waiting for the model: N runs ahead" rather than a frozen page.
A turn is reentrant within a thread: a checked run holds it across its engine run and its reference
oracle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

WaitCallback = Callable[[int], None]


def waiting_message(ahead: int) -> str:
    """What the app and the CLI say while a run waits its turn."""
    return f"waiting for the model: {ahead} run{'s' if ahead != 1 else ''} ahead"


class ModelQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._line: list[object] = []  # tickets in arrival order; the first holds the model
        self._holder: int | None = None
        self._depth = 0

    @property
    def waiting(self) -> int:
        """Runs queued behind the one that holds the model."""
        with self._cond:
            return max(0, len(self._line) - 1)

    @contextmanager
    def turn(self, on_wait: WaitCallback | None = None) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                self._depth += 1
                reentered = True
            else:
                reentered, ticket = False, object()
                self._line.append(ticket)
        if reentered:
            try:
                yield
            finally:
                with self._cond:
                    self._depth -= 1
            return
        try:
            self._wait_for(ticket, me, on_wait)
            yield
        finally:
            with self._cond:
                if self._holder == me and self._line and self._line[0] is ticket:
                    self._holder = None
                self._line.remove(ticket)
                self._cond.notify_all()

    def _wait_for(self, ticket: object, me: int, on_wait: WaitCallback | None) -> None:
        reported = None
        while True:
            with self._cond:
                ahead = self._line.index(ticket)
                if ahead == 0:
                    self._holder, self._depth = me, 1
                    return
                if ahead == reported or on_wait is None:
                    self._cond.wait()
                    continue
            on_wait(ahead)  # outside the lock: the callback may draw, or raise to cancel the wait
            reported = ahead
