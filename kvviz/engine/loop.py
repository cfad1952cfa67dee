"""The engine loop: arrivals -> schedule -> copy-on-write -> one packed forward -> commit ->
sample -> finish, once per step, over one shared pool and an unmodified transformers model.

A loop is one pool's life: a workload run (Engine.run) or a server's requests joining between steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..models.routing import step_kwargs
from ..workload import RequestSpec, WorkloadError
from .attention import KVTensors, StepBatch
from .kv_cache import KVCacheManager
from .observer import AttentionObserver, StepContext
from .plan import ScheduledWork, build_step
from .records import Lookup, RequestResult, RunStats, StepRecord
from .sampler import request_generator, sample
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .engine import Engine


class EngineError(WorkloadError):
    """The workload cannot run on this model and pool (it says which request and why)."""


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


class EngineLoop:
    """One shared pool, its scheduler and its requests; `advance` runs one step."""

    def __init__(self, engine: Engine, seed: int = 0, observers: Sequence[AttentionObserver] = (),
                 keep_logits: bool = False):
        cfg = self.config = engine.config
        self.engine, self.m, self.seed = engine, engine.m, seed
        self.observers, self.keep_logits = observers, keep_logits
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.prefix_caching)
        if engine.defences.patch_pool is not None:
            engine.defences.patch_pool(self.kv)
        self.sched = Scheduler(self.kv, cfg.max_batch_tokens)
        self.tensors = KVTensors(cfg.num_blocks * cfg.block_size)
        self.live: dict[str, _Live] = {}
        self.stats = RunStats()
        self.step = 0  # the number the next step gets
        self.last: StepRecord | None = None
        self.t0 = time.perf_counter()  # request times count from here

    @property
    def busy(self) -> bool:
        """Requests are running or waiting for the pool."""
        return bool(self.sched.running or self.sched.waiting)

    def advance(self, snapshot: bool = False) -> StepRecord | None:
        """Run one step and return its record (with the pool's snapshot when asked), or None when no
        request is there; EngineError when requests wait but none can be scheduled."""
        started = time.perf_counter()
        plan = self.sched.schedule()
        if not plan.work:
            if self.busy:
                raise EngineError(f"step {self.step}: no request can be scheduled (pool too small?)")
            return None
        record = self._step(plan)
        for sid in record.finished:
            self.sched.finish(sid)
            self.kv.free(sid)
        record.events = self.kv.pop_events()
        self.stats.steps += 1
        if snapshot:  # only for a consumer: keep it off the bare hot path
            record.snapshot, record.seconds = self.kv.snapshot(), time.perf_counter() - started
        self.last, self.step = record, self.step + 1
        return record

    # -- one step ------------------------------------------------------------------------------
    def _step(self, plan) -> StepRecord:
        step, kv, tensors, live, stats = self.step, self.kv, self.tensors, self.live, self.stats
        cfg, dev, engine, observers = self.config, self.m.device, self.engine, self.observers
        tensors.copy_blocks([c for _, a in plan.work for c in a.copies], cfg.block_size)
        work = []
        for sid, a in plan.work:
            seq = kv.seqs[sid]
            tokens = seq.token_ids[a.start:a.start + len(a.slots)]
            work.append(ScheduledWork(sid, a.start, tokens, list(seq.block_table)))
        work.sort(key=lambda w: len(w.token_ids) > 1)  # single-token rows first: groups are contiguous
        live_tables = {s.id: s.block_table for s in kv.seqs.values() if s.block_table}
        inp = build_step(step, work, live_tables, cfg.block_size, tensors.num_slots, cfg.isolation, engine.defences,
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

        attend = None if cfg.compute == "fast" else engine.defences.attend
        batch = StepBatch(inp.write_slots, inp.groups, tensors, attend, on_attention if observers else None)
        logits = self.m.model(input_ids=inp.input_ids, position_ids=inp.position_ids, use_cache=False,
                              logits_to_keep=keep, **step_kwargs(batch)).logits[0]
        for o in observers:
            o.end_step()
        allocs = dict(plan.work)
        lookups = {sid: Lookup(len(kv.seqs[sid].token_ids), allocs[sid].start, kv.seqs[sid].salt)
                   for sid in plan.admitted}
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
            eos = tok in engine.eos_ids and not state.spec.ignore_eos
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
    def add(self, spec: RequestSpec, own_ids: list[int], generator: torch.Generator | None = None) -> None:
        """A request arrives now (its ids resolved by Engine.resolve); a fork shares its parent's blocks
        (partial last block included). Sampling draws from `generator`, by default one seeded by the
        loop's seed and the request's id."""
        kv, sched, live = self.kv, self.sched, self.live
        gen = generator or request_generator(self.seed, spec.id, self.m.device)
        if spec.parent is None:
            base = []
        elif spec.parent in kv.seqs:
            base = list(kv.seqs[spec.parent].token_ids)
        else:  # the parent has finished: start from everything it produced
            parent = live[spec.parent]
            base = parent.prompt_ids + parent.output_ids
        state = live[spec.id] = _Live(spec, base + own_ids, gen, logits=[] if self.keep_logits else None)
        if spec.parent in kv.seqs and kv.seqs[spec.parent].block_table:
            kv.fork(spec.parent, spec.id)
            kv.append_tokens(spec.id, own_ids)
            state.cached_tokens = kv.seqs[spec.id].num_computed
            sched.add_running(spec.id)
        else:
            kv.add(spec.id, state.prompt_ids, spec.cache_salt)
            sched.add_waiting(spec.id)

    def cancel(self, request_id: str) -> None:
        """Stop a request where it is (a client gone, a stop string seen) and free its blocks."""
        state = self.live.get(request_id)
        if state is None:
            return  # forgotten already
        if request_id in self.sched.waiting:
            self.sched.waiting.remove(request_id)
        elif request_id in self.sched.running:
            self.sched.finish(request_id)
        else:
            return  # finished already
        self.kv.free(request_id)
        state.finish_reason, state.finish_step, state.finish_at = "cancelled", self.step, time.perf_counter()

    def forget(self, request_id: str) -> RequestResult:
        """A finished or cancelled request's result, dropped from the loop (a server keeps none)."""
        result = self.result(request_id)
        del self.live[request_id]
        return result

    def result(self, request_id: str) -> RequestResult:
        s, t0 = self.live[request_id], self.t0
        text = self.m.tokenizer.decode(s.output_ids, skip_special_tokens=True)
        return RequestResult(s.spec.id, s.prompt_ids, s.output_ids, text, s.finish_reason, s.cached_tokens,
                             s.spec.arrival_step, s.first_token_step, s.finish_step, s.spec.temperature == 0, s.logits,
                             s.first_token_at - t0, s.finish_at - t0)
