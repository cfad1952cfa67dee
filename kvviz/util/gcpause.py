"""Pause Python's cyclic garbage collector while millions of acyclic objects are made (an import's
rows, a capture's cache history): each collection walks every object alive, so leaving it on makes
such work several times slower, and for nothing. Nested and concurrent pauses (several app
sessions) share one pause; the collector comes back when the last ends, if it was on before."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_pauses = 0
_was_enabled = False


@contextmanager
def paused_gc() -> Iterator[None]:
    global _pauses, _was_enabled
    with _lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()
