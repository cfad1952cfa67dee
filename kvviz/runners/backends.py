"""Whose engine runs a workload, chosen once from `engine.backend`: each backend's checks, how it opens
under the driver and how its requests are rerun alone for the reference oracle. Nothing else in kvviz
compares backend names to decide what to run."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace

import torch

from .. import hf_backend, llama_backend
from ..catalogue.faults import FAULTS, Scope, defences_with
from ..engine import Backend, Driver, Engine, EngineLoop, RunResult, StepRecord, eos_ids
from ..engine.observer import AttentionObserver
from ..engine.workload import Workload
from ..errors import WorkloadError
from ..models import LoadedModel
from ..oracle.reference import TOLERANCE, Alone, isolated_logits

# how a backend opens: (model, workload, observers, fault, fault scope) -> a context that yields it
Opener = Callable[[LoadedModel, Workload, Sequence[AttentionObserver], str | None, Scope | None],
                  AbstractContextManager[Backend]]


@dataclass(frozen=True, kw_only=True)
class BackendKind:
    name: str  # engine.backend
    label: str  # what the app and the CLI call it
    # refuses what it cannot run on this model, before anything runs; notes on what it runs with a consequence
    check: Callable[[LoadedModel, Workload], list[str]]
    faults: tuple[str, ...]  # the faults it can be run with: kvviz's catalogue, llama.cpp's API misuses, or none
    open: Opener
    alone: Callable[[Workload], Alone]  # the reference oracle's run of one request by itself, for a workload
    tolerance: float = TOLERANCE  # logit difference from the request run alone that batch variance explains
    # the isolations it can run, the first recorded when the workload asks for another (empty: any, as set)
    isolations: tuple[str, ...] = ()
    pool: Callable[[Workload], int] | None = None  # the blocks it really makes, where not num_blocks


@contextmanager
def _open_kvviz(model: LoadedModel, wl: Workload, observers: Sequence[AttentionObserver], fault: str | None,
                scope: Scope | None) -> Iterator[Backend]:
    yield EngineLoop(model, wl.engine, defences_with(fault, wl.engine.block_size, scope), eos_ids(model), wl.seed,
                     observers)


def _open_transformers(model: LoadedModel, wl: Workload, observers: Sequence[AttentionObserver], fault: str | None,
                       scope: Scope | None) -> AbstractContextManager[Backend]:
    return hf_backend.open_backend(model, wl, observers)


def _open_llama(model: LoadedModel, wl: Workload, observers: Sequence[AttentionObserver], fault: str | None,
                scope: Scope | None) -> AbstractContextManager[Backend]:
    return llama_backend.open_backend(model, wl, observers, None if fault is None else llama_backend.Misuse(fault))


def _transformers_alone(wl: Workload) -> Alone:
    return isolated_logits


def _check_llama(model: LoadedModel, wl: Workload) -> list[str]:
    notes = llama_backend.check_workload(wl)
    room = llama_backend.stream_room(wl)
    if room is not None:  # each request within its sequence's stream
        Engine(model, wl.engine).resolve(wl, room)
    llama_backend.adapter.check_version()
    model.gguf()  # a model llama.cpp cannot load is refused before a run begins
    return notes


BACKENDS: dict[str, BackendKind] = {k.name: k for k in (
    BackendKind(name="kvviz", label="kvviz's engine", check=lambda model, wl: [], faults=tuple(FAULTS),
                open=_open_kvviz, alone=_transformers_alone),
    BackendKind(name=hf_backend.BACKEND, label="transformers' continuous batching",
                check=lambda model, wl: hf_backend.check_workload(wl),
                faults=(), open=_open_transformers, alone=_transformers_alone),
    BackendKind(name=llama_backend.BACKEND, label="llama.cpp", check=_check_llama,
                faults=tuple(llama_backend.MISUSES), open=_open_llama, alone=llama_backend.alone,
                tolerance=llama_backend.TOLERANCE, isolations=llama_backend.ISOLATIONS, pool=llama_backend.pool_blocks),
)}


def backend_kind(wl: Workload) -> BackendKind:
    return BACKENDS[wl.engine.backend]


def as_run(wl: Workload) -> Workload:
    """The workload as its backend runs it, for the run's record: the oracle's compute path (inspect), the
    isolation the backend runs (llama.cpp: its mask over one unified cache unless streams are asked for)
    and the pool it really makes (llama.cpp rounds its cells up)."""
    kind, engine = backend_kind(wl), replace(wl.engine, compute="inspect")
    if kind.isolations and engine.isolation not in kind.isolations:
        engine = replace(engine, isolation=kind.isolations[0])
    if kind.pool is not None:
        engine = replace(engine, num_blocks=kind.pool(replace(wl, engine=engine)))
    return replace(wl, engine=engine)


def refuse_fault(fault: str | None, wl: Workload) -> None:
    """A fault the workload's backend cannot be run with, refused in one sentence: kvviz's catalogue faults
    strike kvviz's engine, llama.cpp's API misuses llama.cpp, and transformers runs unchanged."""
    kind = backend_kind(wl)
    if fault is None or fault in kind.faults or kind.name == "kvviz":  # kvviz's: runners.checked.check_fault
        return
    if fault in FAULTS or not kind.faults:
        raise WorkloadError(f"fault {fault!r}: kvviz's faults are injected into kvviz's own engine; {kind.label} "
                            "runs its own code unchanged (run it with engine.backend 'kvviz')")
    raise WorkloadError(f"fault {fault!r}: {kind.label}'s faults are its API misuses ({', '.join(kind.faults)})")


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
