"""A workload run through transformers' continuous batching, observed: what `engine.backend:
"transformers"` means. It is a Backend under kvviz's driver: its step records and observer calls have
the shapes kvviz's own engine gives, so the oracles, the recorder and every view take a transformers
run like any other.

Every workload field either reaches transformers or is refused in one sentence naming it, before
anything runs; the one accepted with a consequence (a cache salt) says so in a note.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from ..engine import Admission, EngineError, StepRecord, eos_ids
from ..engine.observer import AttentionObserver
from ..engine.workload import RequestSpec, Workload, WorkloadError
from ..models import LoadedModel
from .observe import Observation

if TYPE_CHECKING:
    from .adapter import ContinuousBatching

BACKEND = "transformers"


def check_workload(wl: Workload) -> list[str]:
    """Refuse what transformers' manager cannot run as written (WorkloadError naming the field);
    return the notes on what it runs with a stated consequence."""
    cfg = wl.engine
    if cfg.isolation != "paged":
        raise WorkloadError(
            f"engine.isolation: transformers isolates requests by its own paged attention; "
            f"{cfg.isolation!r} is kvviz's engine only"
        )
    if cfg.offload is not None:
        raise WorkloadError(
            "engine.offload: kvviz's host tier is kvviz's engine only (transformers' own CPU "
            "offloading stays off: a request that does not fit is recomputed)"
        )
    if cfg.disaggregated:
        raise WorkloadError("engine.disaggregated: disaggregated prefill is kvviz's engine only")
    first = wl.requests[0]
    for i, r in enumerate(wl.requests):
        if r.parent is not None:
            raise WorkloadError(
                f"requests[{i}].parent: transformers' manager forks only through "
                "num_return_sequences and resumes no session; use engine.backend 'kvviz' for forks"
            )
        if r.adapter is not None:
            raise WorkloadError(
                f"requests[{i}].adapter: the transformers backend runs the base model only; use "
                "engine.backend 'kvviz' for adapters"
            )
        for name in ("temperature", "top_p"):
            if getattr(r, name) != getattr(first, name):
                raise WorkloadError(
                    f"requests[{i}].{name}: transformers' manager samples every request with one "
                    f"generation config; give every request the {name} of the first "
                    f"({getattr(first, name)})"
                )
    salted = sorted({r.cache_salt for r in wl.requests if r.cache_salt is not None})
    if not salted:
        return []
    return [
        f"requests[].cache_salt: transformers has no cache salt, so the tenants {', '.join(salted)} share "
        "prefix blocks; the salt is kept as each request's tenant and the oracle reports the reads across "
        "tenants (cross_tenant findings)"
    ]


@contextmanager
def open_backend(model: LoadedModel, wl: Workload,
                 observers: Sequence[AttentionObserver] = ()) -> Iterator[TransformersBackend]:
    """transformers' manager for this workload, observed, as a Backend; closed (and the global random
    state restored: transformers samples from it) when the block ends. The caller holds the model's turn."""
    from .adapter import ContinuousBatching  # refuses a transformers release it does not read, in one sentence

    check_workload(wl)
    cfg, eos = wl.engine, sorted(eos_ids(model))
    with torch.random.fork_rng(devices=[model.device.index or 0] if model.device.type == "cuda" else []):
        cb = ContinuousBatching(model.model, page_size=cfg.block_size, num_blocks=cfg.num_blocks,
                                max_batch_tokens=cfg.max_batch_tokens, block_sharing=cfg.prefix_caching,
                                temperature=wl.requests[0].temperature, top_p=wl.requests[0].top_p, eos_ids=eos,
                                seed=wl.seed, kernel=cfg.kernel)
        try:
            cb.listener = Observation(total_blocks=cb.total_blocks, data_blocks=cb.num_blocks,
                                      block_size=cb.block_size, salts={s.id: s.cache_salt for s in wl.requests},
                                      observers=observers)
            yield TransformersBackend(cb, eos)
        finally:
            cb.close()


class TransformersBackend:
    """transformers' continuous batching as a Backend: each step is one iteration of its own loop, the
    record made from what kvviz observed of it (observe.Observation)."""

    def __init__(self, cb: ContinuousBatching, eos: list[int]):
        self.cb, self.obs, self.eos = cb, cb.listener, eos
        self.running: set[str] = set()
        self.notes: list[str] = []

    @property
    def step(self) -> int:
        return self.obs.step

    @step.setter
    def step(self, value: int) -> None:
        self.obs.step = value

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def add(self, spec: RequestSpec, own_ids: list[int], generator: torch.Generator | None = None) -> Admission:
        """Queued in transformers' manager (which samples from its own seeded state, not `generator`)."""
        self.cb.add(spec.id, own_ids, spec.max_new_tokens, [] if spec.ignore_eos else self.eos)
        self.running.add(spec.id)
        return Admission(prompt_ids=own_ids)

    def advance(self, snapshot: bool = False, logits: bool = False) -> StepRecord | None:
        if not self.running:
            return None
        started, self.obs.keep_logits = time.perf_counter(), logits
        outcome = self.cb.step()
        failed = self.cb.failures()
        if failed:
            raise EngineError(f"step {self.obs.step}: transformers failed request {failed[0][0]!r}: {failed[0][1]}")
        if outcome is None:
            raise EngineError(f"step {self.obs.step}: transformers' scheduler ran no batch (pool too small?)")
        self.running.difference_update(outcome.finished)
        return self.obs.end(outcome, self.cb.cache_view(), time.perf_counter() - started)

    def cancel(self, request_id: str) -> bool:
        """transformers' own cancellation: the manager drops the request and frees its blocks next step."""
        if request_id not in self.running:
            return False
        self.cb.cancel(request_id)
        self.running.discard(request_id)
        return True

    def forget(self, request_id: str) -> None:
        """transformers keeps nothing of a request once it ended."""
