"""Explaining a run in the background: one worker thread per run and store in this process, which every
session asks about instead of starting its own, so a capture of millions of events is explained once
while the pages stay usable, and the answer is kept in the run store for every session and the CLI.
Across processes (a second app server, `kvviz explain`) the claim `explained` takes beside the store
does the same: the second waits for the first one's answer (kvviz/store/claims.py).

A job is the work of `explained` on a thread of its own: a dataset registered in place is read on a
DuckDB of its own, so the store is held only to keep the answer. Its progress is the stage being run
(explain_sql.STAGES, then reading and keeping the answer) and, within a one-statement stage, how far
DuckDB says the statement has gone (its own estimate, from the rows it has read). A job that fails says
why in one sentence and is not started again until someone asks (`retry`)."""

from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from ..analysis.explained import COUNTING, STAGES, contradiction_sentence, explained, kept
from ..capture import explain_sql
from ..errors import KvvizError
from ..store import RunStore

STOP_S = 5.0  # at exit, how long to wait for a job's thread once its statement is interrupted
NICE = 10  # a job's thread, and the DuckDB threads it starts, yield the cores to the pages' own queries


@dataclass(frozen=True)
class Progress:
    """What a progress bar says: the stage (index into STAGES, its name and which round of it), how far
    DuckDB says the statement running now has gone (None: not measured), the share of the work done
    (never less than was shown before) and the seconds so far."""

    index: int
    stage: str
    detail: str
    statement: float | None
    fraction: float
    seconds: float

    def sentence(self) -> str:
        said = (f"stage {self.index} of {len(STAGES) - 1}: " if self.index else "") + self.stage  # 0: waiting
        said += f" ({self.detail})" if self.detail else ""
        if self.statement is not None:
            said += f", this statement {self.statement:.0%} done by DuckDB's estimate"
        return said + f"; {self.seconds:,.0f} s so far"


def _fraction(index: int, stage: str, statement: float | None) -> float:
    """Stages done, plus the running statement's share of its stage where the stage is one statement
    (a stage of rounds does not know how many rounds it has left)."""
    within = statement if statement is not None and stage not in explain_sql.ROUNDS else 0.0
    return min(1.0, max(0, index - 1 + within) / (len(STAGES) - 1))  # stage 0, waiting, is no share of the work


class ExplainJob:
    """Explaining one run of one store on a thread; `progress()` and `error` may be read from any thread."""

    def __init__(self, store: RunStore, run_id: str) -> None:
        self.store, self.run_id = store, run_id
        self.error: str | None = None
        self.contradictions: str | None = None  # once done: what the capture contradicts, said (None: nothing)
        self._done = threading.Event()
        self._lock = threading.Lock()  # guards the stage and the connection a statement runs on
        self._stage, self._detail = STAGES[1], ""  # STAGES[0] is waiting for another process, if ever
        self._con: duckdb.DuckDBPyConnection | None = None
        self._started = time.monotonic()
        self._shown = 0.0  # the largest fraction said so far: a bar does not go back
        self._thread = threading.Thread(target=self._work, name=f"kvviz-explain-{run_id}", daemon=True)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the job has ended (kept its answer, or failed); False if the timeout came first."""
        return self._done.wait(timeout)

    def progress(self) -> Progress:
        with self._lock:
            stage, detail, statement = self._stage, self._detail, None
            if self._con is not None:
                try:
                    measured = self._con.query_progress()
                except duckdb.Error:
                    measured = -1.0
                statement = measured / 100 if measured >= 0 else None  # -1: DuckDB is not measuring this one
            index = STAGES.index(stage)
            self._shown = max(self._shown, _fraction(index, stage, statement))
            return Progress(index, stage, detail, statement, self._shown, time.monotonic() - self._started)

    def stop(self) -> None:
        """Interrupt the statement running now (the job then fails, saying so)."""
        with self._lock:
            if self._con is not None:
                self._con.interrupt()

    # the Watch that `explained` reports to
    def stage(self, stage: str, detail: str) -> None:
        with self._lock:
            self._stage, self._detail = stage, detail

    def running_on(self, con: duckdb.DuckDBPyConnection | None) -> None:
        with self._lock:
            self._con = con

    def _work(self) -> None:
        _yield_cores()
        try:
            explained(self.store, self.run_id, watch=self)
            with self.store.read() as con:
                if not kept(con, self.run_id):  # worked out, but the store would not take it (read-only)
                    self.error = "Explaining the misses worked, but the run store could not keep the answer."
                    return
            self.stage(COUNTING, "")
            self.contradictions = contradiction_sentence(self.store, self.run_id)
        except KvvizError as e:
            self.error = f"Explaining the misses failed: {str(e).rstrip('.')}."
        except Exception as e:  # noqa: BLE001 - a worker thread has no caller to raise to: said, not lost
            first = str(e).splitlines()[0] if str(e) else ""
            self.error = f"Explaining the misses failed: {type(e).__name__}{': ' + first if first else ''}."
        finally:
            self.running_on(None)
            self._done.set()


def _yield_cores() -> None:
    """Lower this thread's priority (Linux: per thread, inherited by the threads it starts, DuckDB's among
    them): on a machine of two cores the pages keep drawing at their own speed while a capture is explained."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + NICE))
    except (AttributeError, OSError):
        pass  # no per-thread priority here (not Linux): it runs at the app's


_jobs: dict[tuple[Path, str], ExplainJob] = {}
_registry = threading.Lock()


def ensure(store: RunStore, run_id: str) -> ExplainJob:
    """The run's job: the one running or ended in this process, else a new one, started. A failed job
    stays failed (its sentence shown) until `retry`."""
    with _registry:
        job = _jobs.get((store.path, run_id))
        if job is None:
            job = _start(store, run_id)
        return job


def retry(store: RunStore, run_id: str) -> ExplainJob:
    """A new job in place of a failed one (a job running or done is kept as it is)."""
    with _registry:
        job = _jobs.get((store.path, run_id))
        if job is None or job.error is not None:
            job = _start(store, run_id)
        return job


def current(store: RunStore, run_id: str) -> ExplainJob | None:
    """The run's job in this process, if one was started."""
    with _registry:
        return _jobs.get((store.path, run_id))


def running(store: RunStore) -> list[ExplainJob]:
    """This store's jobs still working."""
    with _registry:
        return [j for (path, _), j in _jobs.items() if path == store.path and not j.done]


def _start(store: RunStore, run_id: str) -> ExplainJob:
    job = _jobs[(store.path, run_id)] = ExplainJob(store, run_id)
    job._thread.start()
    return job


@atexit.register
def _stop_all() -> None:
    """At exit, stop the statements still running and let every job's thread end: a thread cut off inside
    DuckDB as the interpreter goes aborts the process ("exception not rethrown"), seen once at exit."""
    with _registry:
        jobs = list(_jobs.values())
    until = time.monotonic() + STOP_S
    for job in jobs:  # interrupted again and again: a job between two statements starts the next one
        while job._thread.is_alive() and time.monotonic() < until:
            job.stop()
            job._thread.join(timeout=0.05)
