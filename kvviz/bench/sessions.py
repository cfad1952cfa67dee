"""`python -m kvviz bench --sessions N`: N app sessions recording scenarios at the same moment, against
the same N runs one after another, in one process on one shared model.

Runs queue for the model (kvviz.models.queue), so at once should cost no more than one after another
(the target: within 1.2x); each run at once must also record exactly what it recorded alone.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..catalogue.scenarios import scenario
from ..engine.workload import Workload
from ..models import LoadedModel
from ..runners.checked import CheckedRun
from ..runners.recorded import record_run
from ..store import RunStore

SESSION_SCENARIOS = ("boundary", "global", "control_forks", "early_free")  # issue 13's team


@dataclass
class SessionsResult:
    sessions: int
    sequential_s: list[float]  # one per round
    concurrent_s: list[float]
    most_ahead: int  # the longest line a waiting session was told about
    identical: bool  # every run at once recorded the outputs and findings it recorded alone

    @property
    def ratio(self) -> float:
        return statistics.median(self.concurrent_s) / statistics.median(self.sequential_s)


def _fingerprint(run: CheckedRun) -> tuple:
    return ([r.output_ids for r in run.result.requests],
            sorted((f.kind, f.request, f.step, f.layer, f.head, f.position, f.mass) for f in run.findings))


def run_sessions(model: LoadedModel, n: int, repeat: int = 1, progress: Callable[[str],
                                                                                 None] = print) -> SessionsResult:
    names = [SESSION_SCENARIOS[i % len(SESSION_SCENARIOS)] for i in range(n)]
    jobs = [(Workload.from_dict(scenario(s).build(model.tokenizer)), scenario(s).fault, s) for s in names]
    sequential, concurrent, ahead, identical = [], [], 0, True
    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore.open(Path(tmp) / "sessions.duckdb")
        record_run(store, model, *jobs[0][:2])  # warm-up: caches, the store's schema
        for round_ in range(repeat):
            t = time.perf_counter()
            alone, _ = _sessions(store, model, jobs, at_once=False)
            sequential.append(time.perf_counter() - t)
            t = time.perf_counter()
            together, heard = _sessions(store, model, jobs, at_once=True)
            concurrent.append(time.perf_counter() - t)
            identical &= [_fingerprint(r) for r in together] == [_fingerprint(r) for r in alone]
            ahead = max([ahead, *(max(h) for h in heard if h)])
            progress(f"sessions round {round_ + 1}: {n} one after another {sequential[-1]:.1f} s, at once "
                     f"{concurrent[-1]:.1f} s")
    return SessionsResult(n, sequential, concurrent, ahead, identical)


def _sessions(store: RunStore, model: LoadedModel, jobs: list, at_once: bool) -> tuple[list[CheckedRun],
                                                                                       list[list[int]]]:
    """Every job recorded from its own thread, as each app session runs in its own script thread:
    started together, or each after the last has finished. Returns the runs and what each heard
    while it waited for the model."""
    heard: list[list[int]] = [[] for _ in jobs]
    done: list[CheckedRun | BaseException | None] = [None] * len(jobs)

    def session(i: int) -> None:
        wl, fault, s = jobs[i]
        try:
            done[i] = record_run(store, model, wl, fault, scenario=s, on_wait=heard[i].append)
        except BaseException as e:  # noqa: BLE001 (reported below)
            done[i] = e

    threads = [threading.Thread(target=session, args=(i,)) for i in range(len(jobs))]
    for th in threads:
        th.start()
        if not at_once:
            th.join()
    for th in threads:
        th.join()
    failed = [r for r in done if not isinstance(r, CheckedRun)]
    if failed:
        raise RuntimeError(f"a concurrent session failed: {failed[0]!r}")
    return done, heard


def sessions_report(model: LoadedModel, r: SessionsResult) -> str:
    rounds = "" if len(r.sequential_s) == 1 else f" (medians of {len(r.sequential_s)} interleaved rounds)"
    return (f"Model `{model.name}`, device {model.device}: {r.sessions} sessions recording the scenarios "
            f"{', '.join(SESSION_SCENARIOS[:r.sessions])} with both oracles{rounds}.\n\n"
            "| sessions | one after another s | at once s | at once / one after another | most runs ahead | "
            "same records |\n| ---: | ---: | ---: | ---: | ---: | --- |\n"
            f"| {r.sessions} | {statistics.median(r.sequential_s):.1f} | {statistics.median(r.concurrent_s):.1f} | "
            f"{r.ratio:.2f} | {r.most_ahead} | {'yes' if r.identical else 'NO'} |\n")
