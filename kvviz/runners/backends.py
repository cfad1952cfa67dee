"""Whose engine runs a workload, chosen once from `engine.backend`: each backend's checks, how it opens
under the driver and how its requests are rerun alone for the reference oracle. Nothing else in kvviz
compares backend names to decide what to run."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from .. import hf_backend
from ..catalogue.faults import Scope, defences_with
from ..engine import Backend, Driver, Engine, EngineLoop, RunResult, StepRecord, eos_ids
from ..engine.observer import AttentionObserver
from ..engine.workload import Workload
from ..errors import WorkloadError
from ..models import LoadedModel
from ..oracle.reference import Alone, isolated_logits

# how a backend opens: (model, workload, observers, fault, fault scope) -> a context that yields it
Opener = Callable[[LoadedModel, Workload, Sequence[AttentionObserver], str | None, Scope | None],
                  AbstractContextManager[Backend]]


@dataclass(frozen=True, kw_only=True)
class BackendKind:
    name: str  # engine.backend
    label: str  # what the app and the CLI call it
    check: Callable[[Workload], list[str]]  # refuses what it cannot run; notes on what it runs with a consequence
    takes_faults: bool  # kvviz's catalogue faults strike it
    open: Opener
    alone: Alone  # the reference oracle's run of one request by itself


@contextmanager
def _open_kvviz(model: LoadedModel, wl: Workload, observers: Sequence[AttentionObserver], fault: str | None,
                scope: Scope | None) -> Iterator[Backend]:
    yield EngineLoop(model, wl.engine, defences_with(fault, wl.engine.block_size, scope), eos_ids(model), wl.seed,
                     observers)


def _open_transformers(model: LoadedModel, wl: Workload, observers: Sequence[AttentionObserver], fault: str | None,
                       scope: Scope | None) -> AbstractContextManager[Backend]:
    return hf_backend.open_backend(model, wl, observers)


BACKENDS: dict[str, BackendKind] = {k.name: k for k in (
    BackendKind(name="kvviz", label="kvviz's engine", check=lambda wl: [], takes_faults=True, open=_open_kvviz,
                alone=isolated_logits),
    BackendKind(name=hf_backend.BACKEND, label="transformers' continuous batching", check=hf_backend.check_workload,
                takes_faults=False, open=_open_transformers, alone=isolated_logits),
)}


def backend_kind(wl: Workload) -> BackendKind:
    return BACKENDS[wl.engine.backend]


def refuse_fault(fault: str | None, wl: Workload) -> None:
    """A catalogue fault on a backend that runs its own code unchanged: refused in one sentence."""
    kind = backend_kind(wl)
    if fault is not None and not kind.takes_faults:
        raise WorkloadError(f"fault {fault!r}: kvviz's faults are injected into kvviz's own engine; {kind.label} "
                            "runs its own code unchanged (run it with engine.backend 'kvviz')")


def run_backend(model: LoadedModel, wl: Workload, *, fault: str | None = None, scope: Scope | None = None,
                observers: Sequence[AttentionObserver] = (), keep_logits: bool = False,
                on_step: Callable[[StepRecord], None] | None = None, run_id: str) -> RunResult:
    """Run every request of the workload on its backend, under the driver, to completion. The caller
    holds the model's turn."""
    refuse_fault(fault, wl)
    specs = Engine(model, wl.engine).resolve(wl)  # prompts checked against the vocabulary, the pool, the positions
    with torch.inference_mode(), backend_kind(wl).open(model, wl, observers, fault, scope) as backend:
        driver = Driver(backend, model.tokenizer, eos_ids(model), keep_logits)
        return driver.run(specs, wl.engine, run_id, on_step)
