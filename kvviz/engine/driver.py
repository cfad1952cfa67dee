"""The driver every backend runs under: arrivals at their step, each request's result and the run's
totals, from the backend's step records alone. One copy of this logic for every engine, so a run on
llama.cpp counts, times and names its requests exactly as a run on kvviz's engine does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .backend import Backend, EngineError
from .config import EngineConfig
from .records import RequestResult, RunResult, RunStats, StepRecord
from .sampler import is_eos
from .workload import RequestSpec


@dataclass(kw_only=True)
class _Progress:
    """One request as the driver saw it go."""

    spec: RequestSpec
    prompt_ids: list[int]
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None
    first_token_step: int = -1
    finish_step: int = -1
    finish_reason: str = ""
    first_token_at: float = 0.0  # perf_counter times
    finish_at: float = 0.0


class Driver:
    """Runs a backend step by step: a workload to completion (`run`), or requests that join between
    steps (a server's: `add`, `advance`, `cancel`, `forget`)."""

    def __init__(self, backend: Backend, tokenizer, eos_ids: set[int], keep_logits: bool = False):
        self.backend, self.tokenizer, self.eos_ids, self.keep_logits = backend, tokenizer, eos_ids, keep_logits
        self.requests: dict[str, _Progress] = {}
        self.stats = RunStats()
        self.last: StepRecord | None = None
        self.t0 = time.perf_counter()  # request times count from here

    @property
    def step(self) -> int:
        return self.backend.step

    @property
    def busy(self) -> bool:
        return self.backend.busy

    def add(self, spec: RequestSpec, own_ids: list[int], generator: torch.Generator | None = None) -> None:
        a = self.backend.add(spec, own_ids, generator)
        self.requests[spec.id] = _Progress(spec=spec, prompt_ids=a.prompt_ids,
                                           cached_tokens=-1 if a.cached_tokens is None else a.cached_tokens,
                                           logits=[] if self.keep_logits else None)
        self.stats.prompt_tokens += len(a.prompt_ids)
        self.stats.cached_tokens += a.cached_tokens or 0

    def advance(self, snapshot: bool = False) -> StepRecord | None:
        """One step of the backend, its record taken into each request's progress and the totals."""
        record = self.backend.advance(snapshot=snapshot, logits=self.keep_logits)
        if record is None:
            return None
        now, st = time.perf_counter(), self.stats
        for sid, lookup in record.lookups.items():
            if self.requests[sid].cached_tokens < 0:  # its first admission: a preempted one's recompute is not a hit
                self.requests[sid].cached_tokens = lookup.hit_tokens
                st.cached_tokens += lookup.hit_tokens
        for sid, (start, n) in record.work.items():
            st.prefill_tokens_computed += max(0, min(start + n, len(self.requests[sid].prompt_ids)) - start)
        for sid, token in record.sampled.items():
            p = self.requests[sid]
            p.output_ids.append(token)
            if p.logits is not None:
                p.logits.append(record.logits[sid])
            if p.first_token_step < 0:
                p.first_token_step, p.first_token_at = record.step, now
        for sid in record.finished:
            p = self.requests[sid]
            eos = bool(p.output_ids) and is_eos(p.output_ids[-1], p.spec, self.eos_ids)
            p.finish_reason, p.finish_step, p.finish_at = "eos" if eos else "length", record.step, now
        st.steps += 1
        st.generated_tokens += len(record.sampled)
        st.preemptions += len(record.preempted)
        self.last = record
        return record

    def cancel(self, request_id: str) -> None:
        """Stop a request where it is (a client gone, a stop string seen); a finished one stays as it ended."""
        p = self.requests.get(request_id)
        if p is not None and self.backend.cancel(request_id):
            p.finish_reason, p.finish_step, p.finish_at = "cancelled", self.backend.step, time.perf_counter()

    def result(self, request_id: str) -> RequestResult:
        p, t0 = self.requests[request_id], self.t0
        return RequestResult(
            id=p.spec.id, prompt_ids=p.prompt_ids, output_ids=p.output_ids,
            text=self.tokenizer.decode(p.output_ids, skip_special_tokens=True), finish_reason=p.finish_reason,
            cached_tokens=p.cached_tokens, arrival_step=p.spec.arrival_step, first_token_step=p.first_token_step,
            finish_step=p.finish_step, logits=p.logits,
            first_token_seconds=p.first_token_at - t0 if p.first_token_step >= 0 else 0.0,
            finish_seconds=p.finish_at - t0 if p.finish_step >= 0 else 0.0)

    def forget(self, request_id: str) -> RequestResult:
        """A finished or cancelled request's result, dropped from the driver (a server keeps none)."""
        result = self.result(request_id)
        del self.requests[request_id]
        self.backend.forget(request_id)
        return result

    def run(self, specs: list[tuple[RequestSpec, list[int]]], config: EngineConfig, run_id: str,
            on_step: Callable[[StepRecord], None] | None = None) -> RunResult:
        """Every request admitted at its arrival step and run to completion; steps with nothing to run
        are skipped to the next arrival. on_step sees each step's record with the cache after it."""
        arrivals = sorted(specs, key=lambda s: s[0].arrival_step)
        cancels = sorted((s.cancel_step, s.id) for s, _ in specs if s.cancel_step is not None)
        while arrivals or self.busy:
            while arrivals and arrivals[0][0].arrival_step <= self.backend.step:
                self.add(*arrivals.pop(0))
            while cancels and cancels[0][0] <= self.backend.step:
                self.cancel(cancels.pop(0)[1])
            if self.advance(snapshot=on_step is not None) is None:
                if not arrivals:
                    raise EngineError(f"step {self.backend.step}: requests are running but the backend ran nothing")
                self.backend.step = arrivals[0][0].arrival_step  # idle until the next arrival
            elif on_step is not None:
                on_step(self.last)
        self.stats.seconds = time.perf_counter() - self.t0
        return RunResult(run_id=run_id, config=config, requests=[self.result(s.id) for s, _ in specs],
                         stats=self.stats, notes=list(self.backend.notes))
