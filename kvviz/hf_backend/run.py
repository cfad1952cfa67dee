"""A workload run through transformers' continuous batching, observed: what `engine.backend:
"transformers"` means. The result, step records and observer calls have the shapes kvviz's own engine
gives, so the oracles, the recorder and every view take a transformers run like any other.

Every workload field either reaches transformers or is refused in one sentence naming it, before
anything runs; the one accepted with a consequence (a cache salt) says so in a note.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..engine import Engine, EngineError, RequestResult, RunResult, RunStats, StepRecord
from ..engine.observer import AttentionObserver
from ..engine.workload import Workload, WorkloadError
from ..models import LoadedModel
from ..util.ids import new_run_id
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


def fault_refused(fault: str | None) -> None:
    """kvviz's faults strike kvviz's engine; transformers' code runs as shipped."""
    if fault is not None:
        raise WorkloadError(
            f"fault {fault!r}: kvviz's faults are injected into kvviz's own engine; the transformers "
            "backend runs transformers' code unchanged (run it with engine.backend 'kvviz')"
        )


def run_workload(
    model: LoadedModel,
    wl: Workload,
    on_step: Callable[[StepRecord], None] | None = None,
    observers: Sequence[AttentionObserver] = (),
    keep_logits: bool = False,
    run_id: str | None = None,
) -> RunResult:
    """Run every request through transformers' manager, one batch per step, arrivals at their step;
    observers see every layer's weights as `compute="inspect"` gives them. The caller holds the
    model's turn."""
    from .adapter import ContinuousBatching  # refuses a transformers release it does not read, in one sentence

    check_workload(wl)
    cfg, engine = wl.engine, Engine(model, wl.engine)  # its prompt checks and EOS ids; it runs nothing here
    specs = engine.resolve(wl)
    eos = sorted(engine.eos_ids)
    salts = {s.id: s.cache_salt for s in wl.requests}
    with (
        torch.random.fork_rng(devices=[model.device.index or 0] if model.device.type == "cuda" else []),
        torch.inference_mode(),
    ):
        cb = ContinuousBatching(
            model.model,
            page_size=cfg.block_size,
            num_blocks=cfg.num_blocks,
            max_batch_tokens=cfg.max_batch_tokens,
            block_sharing=cfg.prefix_caching,
            temperature=wl.requests[0].temperature,
            top_p=wl.requests[0].top_p,
            eos_ids=eos,
            seed=wl.seed,
            kernel=cfg.kernel,
        )
        try:
            obs = cb.listener = Observation(
                cb.total_blocks, cb.num_blocks, cb.block_size, salts, observers, keep_logits
            )
            outputs, stats = _drive(cb, obs, specs, eos, on_step)
        finally:
            cb.close()
    results = []
    for spec, ids in specs:
        out, (first, last, first_at, last_at) = outputs[spec.id]
        eos_end = bool(out) and out[-1] in eos and not spec.ignore_eos
        results.append(
            RequestResult(
                spec.id,
                ids,
                out,
                model.tokenizer.decode(out, skip_special_tokens=True),
                "eos" if eos_end else "length",
                obs.admitted[spec.id].hit_tokens,
                spec.arrival_step,
                first,
                last,
                spec.temperature == 0,
                obs.logits.get(spec.id, []) if keep_logits else None,
                first_at,
                last_at,
            )
        )
    stats.prompt_tokens = sum(len(ids) for _, ids in specs)
    stats.cached_tokens = sum(r.cached_tokens for r in results)
    stats.prefill_tokens_computed = obs.prefill_computed
    return RunResult(run_id or new_run_id(), cfg, results, stats)


def _drive(
    cb: ContinuousBatching,
    obs: Observation,
    specs,
    eos: list[int],
    on_step: Callable[[StepRecord], None] | None,
) -> tuple[dict, RunStats]:
    """Queue each request at its arrival step and run batches until every request has finished."""
    arrivals = sorted(specs, key=lambda s: s[0].arrival_step)
    outputs: dict[str, tuple[list[int], list]] = {}
    stats, t0, running = RunStats(), time.perf_counter(), 0
    while arrivals or running:
        while arrivals and arrivals[0][0].arrival_step <= obs.step:
            spec, ids = arrivals.pop(0)
            cb.add(spec.id, ids, spec.max_new_tokens, [] if spec.ignore_eos else eos)
            outputs[spec.id] = ([], [-1, -1, 0.0, 0.0])
            running += 1
        if not running:  # idle until the next arrival
            obs.step = arrivals[0][0].arrival_step
            continue
        started = time.perf_counter()
        outcome = cb.step()
        failed = cb.failures()
        if failed:
            raise EngineError(f"step {obs.step}: transformers failed request {failed[0][0]!r}: {failed[0][1]}")
        if outcome is None:
            raise EngineError(f"step {obs.step}: transformers' scheduler ran no batch (pool too small?)")
        now = time.perf_counter()
        record = obs.end(outcome, cb.cache_view(), now - started)
        for rid, tok in outcome.sampled.items():
            out, times = outputs[rid]
            out.append(tok)
            if times[0] < 0:
                times[0], times[2] = record.step, now - t0
        for rid in outcome.finished:
            outputs[rid][1][1], outputs[rid][1][3] = record.step, now - t0
            running -= 1
        stats.steps += 1
        stats.generated_tokens += len(outcome.sampled)
        stats.preemptions += len(record.preempted)
        if on_step is not None:
            on_step(record)
    stats.seconds = time.perf_counter() - t0
    return outputs, stats
