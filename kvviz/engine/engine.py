"""The engine loop: arrivals -> schedule -> copy-on-write -> one packed forward -> commit ->
sample -> finish, once per step, over one shared pool and an unmodified transformers model."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..ids import new_run_id
from ..models import LoadedModel
from ..models.queue import WaitCallback
from ..models.routing import step_kwargs
from ..workload import RequestSpec, Workload, WorkloadError
from .attention import KVTensors, StepBatch
from .config import EngineConfig
from .defences import Defences
from .events import BlockEvent
from .kv_cache import KVCacheManager, PoolSnapshot
from .observer import AttentionObserver, StepContext
from .plan import ScheduledWork, build_step
from .sampler import request_generator, sample
from .scheduler import Scheduler


class EngineError(WorkloadError):
    """The workload cannot run on this model and pool (it says which request and why)."""


@dataclass
class RequestResult:
    id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str  # "eos" or "length"
    cached_tokens: int  # prompt tokens served by the prefix cache on first admission
    arrival_step: int
    first_token_step: int
    finish_step: int
    greedy: bool
    logits: list[torch.Tensor] | None = None  # one float32 [V] row per generated token, on request
    first_token_seconds: float = 0.0  # since the run started: time to first token, queueing included
    finish_seconds: float = 0.0

    @property
    def seconds_per_output_token(self) -> float:
        """Mean time between this request's tokens after the first (TPOT), 0 for one token."""
        n = len(self.output_ids) - 1
        return (self.finish_seconds - self.first_token_seconds) / n if n > 0 else 0.0


@dataclass
class StepRecord:
    """What one step did, for recorders and progress displays."""

    step: int
    work: dict[str, tuple[int, int]]  # request -> (first position computed, tokens computed)
    admitted: list[str]
    preempted: list[str]
    sampled: dict[str, int]
    finished: list[str]
    writes: dict[str, list[int]] = field(default_factory=dict)  # request -> slots its K/V went to, by position
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request -> token ids computed, by position
    events: list[BlockEvent] = field(default_factory=list)
    lookups: dict[str, tuple[int, int]] = field(default_factory=dict)  # admitted -> (tokens looked up in the
    # prefix cache, tokens it served): what a prefix-cache hit rate counts
    snapshot: PoolSnapshot | None = None  # the pool after the step's frees
    seconds: float = 0.0


@dataclass
class RunStats:
    steps: int = 0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0  # prompt positions actually computed (recomputes included)
    cached_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


@dataclass
class RunResult:
    run_id: str
    config: EngineConfig
    requests: list[RequestResult]
    stats: RunStats = field(default_factory=RunStats)

    def summary(self) -> dict:
        s = self.stats
        return {
            "run_id": self.run_id,
            "engine": self.config.to_dict(),
            "requests": [{"id": r.id, "output_ids": r.output_ids, "text": r.text, "finish_reason": r.finish_reason,
                          "cached_tokens": r.cached_tokens} for r in self.requests],
            "stats": {"steps": s.steps, "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                      "prefill_tokens_computed": s.prefill_tokens_computed, "generated_tokens": s.generated_tokens,
                      "preemptions": s.preemptions, "seconds": round(s.seconds, 4),
                      "tokens_per_second": round(s.tokens_per_second, 2)},
        }


@dataclass
class _Live:
    spec: RequestSpec
    prompt_ids: list[int]
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None
    cached_tokens: int = -1
    first_token_step: int = -1
    finish_step: int = -1
    finish_reason: str = ""
    first_token_at: float = 0.0  # perf_counter times
    finish_at: float = 0.0


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig, defences: Defences | None = None):
        self.m, self.config, self.defences = model, config, defences or Defences()
        gen = model.model.generation_config
        eos = gen.eos_token_id if gen is not None else None
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if model.tokenizer.eos_token_id is not None:
            self.eos_ids.add(model.tokenizer.eos_token_id)

    def run(self, workload: Workload, on_step: Callable[[StepRecord], None] | None = None,
            observers: Sequence[AttentionObserver] = (), keep_logits: bool = False,
            run_id: str | None = None, on_wait: WaitCallback | None = None) -> RunResult:
        """Run every request of the workload to completion; steps are numbered from 0. Observers
        see every layer's attention probabilities, which only the inspect path computes. The run
        waits its turn on the model (on_wait hears how many runs are ahead)."""
        cfg = self.config
        if observers and cfg.compute != "inspect":
            raise EngineError("attention observers (the leak oracle) need compute='inspect'")
        specs = self._resolve(workload)
        kv = KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.prefix_caching)
        if self.defences.patch_pool is not None:
            self.defences.patch_pool(kv)
        sched = Scheduler(kv, cfg.max_batch_tokens)
        tensors = KVTensors(cfg.num_blocks * cfg.block_size)
        live: dict[str, _Live] = {}
        arrivals = sorted(specs, key=lambda s: s[0].arrival_step)
        stats, step = RunStats(), 0
        with self.m.queue.turn(on_wait), torch.inference_mode():
            t0 = time.perf_counter()  # times count from the turn on the model, not the wait for it
            while arrivals or sched.running or sched.waiting:
                while arrivals and arrivals[0][0].arrival_step <= step:
                    spec, own_ids = arrivals.pop(0)
                    self._arrive(spec, own_ids, workload.seed, kv, sched, live, keep_logits)
                started = time.perf_counter()
                plan = sched.schedule()
                if not plan.work:
                    if sched.running or sched.waiting:
                        raise EngineError(f"step {step}: no request can be scheduled (pool too small?)")
                    step = arrivals[0][0].arrival_step  # idle until the next arrival
                    continue
                record = self._step(step, plan, kv, tensors, live, stats, observers)
                for sid in record.finished:
                    sched.finish(sid)
                    kv.free(sid)
                record.events = kv.pop_events()
                stats.steps += 1
                if on_step is not None:  # the snapshot is only for a consumer: keep it off the bare hot path
                    record.snapshot, record.seconds = kv.snapshot(), time.perf_counter() - started
                    on_step(record)
                step += 1
        stats.seconds = time.perf_counter() - t0
        stats.cached_tokens = sum(r.cached_tokens for r in live.values())
        stats.prompt_tokens = sum(len(r.prompt_ids) for r in live.values())
        return RunResult(run_id or new_run_id(), cfg, [self._result(live[s.id], t0) for s, _ in specs], stats)

    # -- one step ------------------------------------------------------------------------------
    def _step(self, step, plan, kv, tensors, live, stats, observers) -> StepRecord:
        cfg, dev = self.config, self.m.device
        tensors.copy_blocks([c for _, a in plan.work for c in a.copies], cfg.block_size)
        work = []
        for sid, a in plan.work:
            seq = kv.seqs[sid]
            tokens = seq.token_ids[a.start:a.start + len(a.slots)]
            work.append(ScheduledWork(sid, a.start, tokens, list(seq.block_table)))
        work.sort(key=lambda w: len(w.token_ids) > 1)  # single-token rows first: groups are contiguous
        live_tables = {s.id: s.block_table for s in kv.seqs.values() if s.block_table}
        inp = build_step(step, work, live_tables, cfg.block_size, tensors.num_slots, cfg.isolation, self.defences,
                         dev)
        sampling = [r for r, w in enumerate(work) if w.end == len(kv.seqs[w.seq_id].token_ids)]
        last = [inp.offsets[r] + len(work[r].token_ids) - 1 for r in sampling]
        keep = torch.tensor(last, dtype=torch.long, device=dev)
        # Provenance is recorded where the K/V really go (the forward writes exactly these slots),
        # before the forward, so observers judge this step's reads with this step's writes.
        write_slots = inp.write_slots.tolist()
        for r, w in enumerate(work):
            kv.commit(w.seq_id, len(w.token_ids), write_slots[inp.offsets[r]:inp.offsets[r] + len(w.token_ids)])
            prompt_len = len(live[w.seq_id].prompt_ids)
            stats.prefill_tokens_computed += max(0, min(w.end, prompt_len) - w.start)
        if observers:
            ctx = StepContext(step, work, inp.q_row, inp.position_ids[0], cfg.block_size, kv.provenance,
                              [b.lifetime for b in kv.pool.blocks],
                              [kv.seqs[w.seq_id].prefix_ids[:w.end] for w in work],
                              [kv.seqs[w.seq_id].salt for w in work])
            for o in observers:
                o.begin_step(ctx)

        def on_attention(layer, group, probs):
            for o in observers:
                o.on_attention(layer, group, probs)

        batch = StepBatch(inp.write_slots, inp.groups, tensors,
                          None if cfg.compute == "fast" else self.defences.attend, on_attention if observers else None)
        logits = self.m.model(input_ids=inp.input_ids, position_ids=inp.position_ids, use_cache=False,
                              logits_to_keep=keep, **step_kwargs(batch)).logits[0]
        for o in observers:
            o.end_step()
        allocs = dict(plan.work)
        lookups = {sid: (len(kv.seqs[sid].token_ids), allocs[sid].start) for sid in plan.admitted}
        for sid in plan.admitted:
            if live[sid].cached_tokens < 0:
                live[sid].cached_tokens = allocs[sid].start
        sampled, finished, now = {}, [], time.perf_counter()
        for i, r in enumerate(sampling):
            sid = work[r].seq_id
            state = live[sid]
            tok = sample(logits[i], state.spec.temperature, state.spec.top_p, state.generator)
            state.output_ids.append(tok)
            if state.logits is not None:
                state.logits.append(logits[i].float().cpu())
            if state.first_token_step < 0:
                state.first_token_step, state.first_token_at = step, now
            sampled[sid] = tok
            stats.generated_tokens += 1
            eos = tok in self.eos_ids and not state.spec.ignore_eos
            if eos or len(state.output_ids) >= state.spec.max_new_tokens:
                state.finish_reason = "eos" if eos else "length"
                state.finish_step, state.finish_at = step, now
                finished.append(sid)
            else:
                kv.append_tokens(sid, [tok])
        stats.preemptions += len(plan.preempted)
        writes = {w.seq_id: write_slots[inp.offsets[r]:inp.offsets[r] + len(w.token_ids)] for r, w in enumerate(work)}
        return StepRecord(step, {w.seq_id: (w.start, len(w.token_ids)) for w in work}, plan.admitted,
                          plan.preempted, sampled, finished, writes, {w.seq_id: w.token_ids for w in work},
                          lookups=lookups)

    # -- requests ------------------------------------------------------------------------------
    def check(self, workload: Workload) -> None:
        """Refuse a workload this model and pool cannot run (WorkloadError), before anything starts."""
        self._resolve(workload)

    def _resolve(self, workload: Workload) -> list[tuple[RequestSpec, list[int]]]:
        """Token ids of each request's own prompt, checked against the vocabulary and the pool."""
        tok, cfg = self.m.tokenizer, self.config
        vocab = self.m.config.vocab_size
        max_pos = getattr(self.m.config, "max_position_embeddings", None) or getattr(self.m.config, "n_positions", None)
        out, longest = [], {}
        for i, s in enumerate(workload.requests):
            ids = list(s.prompt_ids) if s.prompt_ids is not None else (tok(s.prompt).input_ids if s.prompt else [])
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise WorkloadError(f"requests[{i}].prompt_ids: token {bad[0]} is outside the model's vocabulary "
                                    f"(size {vocab})")
            longest[s.id] = longest.get(s.parent, 0) + len(ids) + s.max_new_tokens
            capacity = cfg.num_blocks * cfg.block_size
            if longest[s.id] > capacity:
                raise WorkloadError(f"requests[{i}]: may reach {longest[s.id]} tokens but the pool holds {capacity} "
                                    f"({cfg.num_blocks} blocks x {cfg.block_size}); raise engine.num_blocks")
            if max_pos and longest[s.id] > max_pos:
                raise WorkloadError(f"requests[{i}]: may reach {longest[s.id]} tokens, beyond the model's "
                                    f"{max_pos} positions")
            out.append((s, ids))
        return out

    def _arrive(self, spec, own_ids, seed, kv, sched, live, keep_logits) -> None:
        """Admit a new request; a fork shares its parent's blocks (partial last block included)."""
        gen = request_generator(seed, spec.id, self.m.device)
        if spec.parent is None:
            base = []
        elif spec.parent in kv.seqs:
            base = list(kv.seqs[spec.parent].token_ids)
        else:  # the parent has finished: start from everything it produced
            parent = live[spec.parent]
            base = parent.prompt_ids + parent.output_ids
        state = live[spec.id] = _Live(spec, base + own_ids, gen, logits=[] if keep_logits else None)
        if spec.parent in kv.seqs and kv.seqs[spec.parent].block_table:
            kv.fork(spec.parent, spec.id)
            kv.append_tokens(spec.id, own_ids)
            state.cached_tokens = kv.seqs[spec.id].num_computed
            sched.add_running(spec.id)
        else:
            kv.add(spec.id, state.prompt_ids, spec.cache_salt)
            sched.add_waiting(spec.id)

    def _result(self, s: _Live, t0: float) -> RequestResult:
        text = self.m.tokenizer.decode(s.output_ids, skip_special_tokens=True)
        return RequestResult(s.spec.id, s.prompt_ids, s.output_ids, text, s.finish_reason, s.cached_tokens,
                             s.spec.arrival_step, s.first_token_step, s.finish_step, s.spec.temperature == 0, s.logits,
                             s.first_token_at - t0, s.finish_at - t0)
