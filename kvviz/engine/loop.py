"""The engine loop: arrivals -> schedule -> copy-on-write -> one packed forward -> commit ->
sample -> finish, once per step, over one shared pool and an unmodified transformers model.

A loop is one pool's life: a workload run (Engine.run) or a server's requests joining between steps.
Disaggregated, it is two instances over one arena of K/V (so that slots, provenance and the oracle
stay one address space): a prefill instance computes each prompt in its own blocks, then hands the
request over to the decode instance, whose pool receives the K/V by a transfer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..models import LoadedModel
from ..models.routing import step_kwargs
from .attention import KVTensors, StepBatch
from .block_pool import OutOfBlocks
from .config import EngineConfig
from .defences import Defences
from .kv_cache import KVCacheManager
from .observer import AttentionObserver, StepContext
from .plan import ScheduledWork, build_step
from .records import KVTransfer, Lookup, RequestResult, RunStats, StepRecord
from .sampler import request_generator, sample
from .scheduler import Scheduler, StepSchedule
from .workload import RequestSpec, WorkloadError


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
    block_hashes: list[bytes] = field(default_factory=list)  # its chain when it finished (a session resumes it)


@dataclass
class Instance:
    """A pool and the scheduler that fills it."""

    kv: KVCacheManager
    sched: Scheduler


class EngineLoop:
    """One shared pool, its scheduler and its requests (or a prefill and a decode instance); `advance`
    runs one step."""

    def __init__(self, model: LoadedModel, config: EngineConfig, defences: Defences, eos_ids: set[int], seed: int = 0,
                 observers: Sequence[AttentionObserver] = (), keep_logits: bool = False):
        cfg = self.config = config
        self.model, self.defences, self.eos_ids, self.seed = model, defences, eos_ids, seed
        self.observers, self.keep_logits = observers, keep_logits
        N, arena = cfg.num_blocks, cfg.num_blocks * (2 if cfg.disaggregated else 1)
        host = cfg.offload.cpu_blocks if cfg.offload else 0  # on the instance that looks prefixes up
        self.kv = KVCacheManager(arena, cfg.block_size, cfg.prefix_caching, 0 if cfg.disaggregated else host,
                                 owned=range(N))
        self.sched = Scheduler(self.kv, cfg.max_batch_tokens)
        self.decode = Instance(self.kv, self.sched)  # the only instance, unless disaggregated
        self.prefill: Instance | None = None
        if cfg.disaggregated:  # blocks N..2N-1 of the arena are the prefill instance's pool
            pkv = KVCacheManager(arena, cfg.block_size, cfg.prefix_caching, host, owned=range(N, arena),
                                 provenance=self.kv.provenance)
            self.prefill = Instance(pkv, Scheduler(pkv, cfg.max_batch_tokens))
        self.handoff: list[str] = []  # prefilled, waiting for room in the decode pool
        for inst in self.instances:
            defences.pool_patches.apply(inst.kv)
        self.tensors = KVTensors(arena * cfg.block_size)
        self.host_tensors = KVTensors(cfg.offload.cpu_blocks * cfg.block_size, "cpu") if cfg.offload else None
        self.live: dict[str, _Live] = {}
        self.stats = RunStats()
        self.step = 0  # the number the next step gets
        self.last: StepRecord | None = None
        self.t0 = time.perf_counter()  # request times count from here

    @property
    def instances(self) -> list[Instance]:
        """The prefill instance (disaggregated) and the decode instance, in the order they schedule."""
        return [self.prefill, self.decode] if self.prefill else [self.decode]

    def instance_of(self, request_id: str) -> Instance:
        """The instance whose pool holds (or will hold) the request."""
        return self.prefill if self.prefill and request_id in self.prefill.kv.seqs else self.decode

    @property
    def busy(self) -> bool:
        """Requests are running, waiting for the pool or waiting to be handed over."""
        return bool(self.handoff) or any(i.sched.running or i.sched.waiting for i in self.instances)

    def advance(self, snapshot: bool = False) -> StepRecord | None:
        """Run one step and return its record (with the pool's snapshot when asked), or None when no
        request is there; EngineError when requests wait but none can be scheduled."""
        started = time.perf_counter()
        transfers = self._hand_over() if self.prefill else []
        plans = [i.sched.schedule() for i in self.instances]
        plan = StepSchedule(*([x for p in plans for x in getattr(p, f)] for f in ("work", "preempted", "admitted")))
        if not plan.work:
            if self.busy:
                raise EngineError(f"step {self.step}: no request can be scheduled (pool too small?)")
            return None
        record = self._step(plan)
        record.transfers = transfers
        for sid in record.finished:
            inst = self.instance_of(sid)
            inst.sched.finish(sid)
            self.live[sid].block_hashes = inst.kv.free(sid).block_hashes
        if self.prefill:  # a prompt computed and its first token sampled: the decode instance takes over
            for sid in record.sampled:
                if sid in self.prefill.kv.seqs:
                    self.prefill.sched.finish(sid)
                    self.handoff.append(sid)
        record.events = [e for i in self.instances for e in i.kv.pop_events()]
        self.stats.steps += 1
        if snapshot:  # only for a consumer: keep it off the bare hot path
            snap = self.kv.snapshot()
            if self.prefill:
                snap = snap.merged(self.prefill.kv.snapshot(), self.prefill.kv.pool.owned)
            record.snapshot, record.seconds = snap, time.perf_counter() - started
        self.last, self.step = record, self.step + 1
        return record

    def _hand_over(self) -> list[KVTransfer]:
        """Move prefilled requests to the decode instance, oldest first, while its pool has room: their
        K/V goes over by a transfer (applied before this step's forward), their prefill blocks stay
        cached on the prefill instance."""
        out, pkv = [], self.prefill.kv
        per_slot = self.tensors.bytes_per_slot()
        while self.handoff:
            sid = self.handoff[0]
            seq = pkv.seqs[sid]
            try:
                status = self.kv.receive(sid, seq.token_ids, seq.salt, seq.adapter, seq.num_computed, seq.block_table)
            except OutOfBlocks:
                break  # the decode pool is full: wait for its requests to finish
            self.handoff.pop(0)
            table = self.kv.seqs[sid].block_table
            out.append(KVTransfer(sid, len(table), seq.num_computed * per_slot, status, tuple(seq.block_table),
                                  tuple(table), *self.kv.received(sid, seq.num_computed)))
            pkv.free(sid)
            self.sched.add_running(sid)
        return out

    # -- one step ------------------------------------------------------------------------------
    def _step(self, plan) -> StepRecord:
        """The step's stages: K/V moved, the work packed, provenance committed, observers told, the
        forward, then sampling."""
        seqs = {sid: s for i in self.instances for sid, s in i.kv.seqs.items()}
        self._move_kv(plan)
        work = sorted((ScheduledWork(sid, a.start, seqs[sid].token_ids[a.start:a.start + len(a.slots)],
                                     list(seqs[sid].block_table)) for sid, a in plan.work),
                      key=lambda w: len(w.token_ids) > 1)  # single-token rows first: groups are contiguous
        live_tables = {s.id: s.block_table for s in seqs.values() if s.block_table}
        inp = build_step(self.step, work, live_tables, self.config.block_size, self.tensors.num_slots,
                         self.config.isolation, self.defences, self.model.device)
        writes = self._commit(work, inp)
        sampling = [r for r, w in enumerate(work) if w.end == len(seqs[w.seq_id].token_ids)]
        logits = self._forward(work, inp, seqs, [inp.offsets[r] + len(work[r].token_ids) - 1 for r in sampling])
        starts = {sid: a.start for sid, a in plan.work}
        lookups = {sid: Lookup(len(seqs[sid].token_ids), starts[sid], seqs[sid].salt) for sid in plan.admitted}
        for sid in plan.admitted:
            if self.live[sid].cached_tokens < 0:
                self.live[sid].cached_tokens = starts[sid]
        sampled, finished = self._sample(logits, [work[r].seq_id for r in sampling], seqs)
        self.stats.preemptions += len(plan.preempted)
        return StepRecord(step=self.step, work={w.seq_id: (w.start, len(w.token_ids)) for w in work},
                          admitted=plan.admitted, preempted=plan.preempted, sampled=sampled, finished=finished,
                          writes=writes, tokens={w.seq_id: w.token_ids for w in work}, lookups=lookups)

    def _move_kv(self, plan) -> None:
        """K/V that moves before the forward: host-tier offloads and restores (before copy-on-write: an
        offload saves what a copy may overwrite), handed-over requests' K/V, copy-on-write copies."""
        tensors, size = self.tensors, self.config.block_size
        for inst in self.instances:
            if inst.kv.host is not None:
                tensors.transfer(self.host_tensors, inst.kv.host.pop_transfers(), size)
        tensors.copy_blocks(self.kv.incoming, size)
        self.kv.incoming = []
        tensors.copy_blocks([c for _, a in plan.work for c in a.copies], size)

    def _commit(self, work: list[ScheduledWork], inp) -> dict[str, list[int]]:
        """Provenance where the K/V really go (the forward writes exactly these slots), before the
        forward, so observers judge this step's reads with this step's writes; each request's slots."""
        write_slots, writes = inp.write_slots.tolist(), {}
        for r, w in enumerate(work):
            slots = writes[w.seq_id] = write_slots[inp.offsets[r]:inp.offsets[r] + len(w.token_ids)]
            self.instance_of(w.seq_id).kv.commit(w.seq_id, len(w.token_ids), slots)
            prompt_len = len(self.live[w.seq_id].prompt_ids)
            self.stats.prefill_tokens_computed += max(0, min(w.end, prompt_len) - w.start)
        return writes

    def _forward(self, work: list[ScheduledWork], inp, seqs: dict, keep: list[int]) -> torch.Tensor:
        """The model over every packed token, observers told the step first and every layer's weights;
        the logits of the `keep` positions (each sampling request's last token)."""
        observers, cfg = self.observers, self.config
        if observers:
            ctx = StepContext(self.step, work, inp.q_row, inp.position_ids[0], cfg.block_size, self.kv.provenance,
                              self._lifetimes(), [seqs[w.seq_id].prefix_ids[:w.end] for w in work],
                              [seqs[w.seq_id].salt for w in work])
            for o in observers:
                o.begin_step(ctx)

        def on_attention(layer, group, probs):
            for o in observers:
                o.on_attention(layer, group, probs)

        attend = None if cfg.compute == "fast" else self.defences.attend
        batch = StepBatch(inp.write_slots, inp.groups, self.tensors, attend, on_attention if observers else None)
        logits = self.model.model(input_ids=inp.input_ids, position_ids=inp.position_ids, use_cache=False,
                              logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.model.device),
                              **step_kwargs(batch)).logits[0]
        for o in observers:
            o.end_step()
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[str], seqs: dict) -> tuple[dict[str, int], list[str]]:
        """A token for each request whose last position was computed (logits row i: requests[i]); the
        ones that end (EOS or their length) are returned as finished, the rest take their token."""
        sampled, finished, now = {}, [], time.perf_counter()
        greedy = logits.argmax(-1).tolist()  # one pass over the step's rows, as generate takes its argmax
        for i, sid in enumerate(requests):
            state = self.live[sid]
            spec = state.spec
            tok = greedy[i] if spec.temperature == 0 else sample(logits[i], spec.temperature, spec.top_p,
                                                                 state.generator)
            state.output_ids.append(tok)
            if state.logits is not None:
                state.logits.append(logits[i].float().cpu())
            if state.first_token_step < 0:
                state.first_token_step, state.first_token_at = self.step, now
            sampled[sid] = tok
            self.stats.generated_tokens += 1
            eos = tok in self.eos_ids and not state.spec.ignore_eos
            if eos or len(state.output_ids) >= state.spec.max_new_tokens:
                state.finish_reason = "eos" if eos else "length"
                state.finish_step, state.finish_at = self.step, now
                finished.append(sid)
            else:
                seqs[sid].append([tok])
        return sampled, finished

    def _lifetimes(self) -> list[int]:
        """Every arena block's current lifetime, from the instance that owns it."""
        life = [b.lifetime for b in self.kv.pool.blocks]
        if self.prefill:
            for i in self.prefill.kv.pool.owned:
                life[i] = self.prefill.kv.pool.blocks[i].lifetime
        return life

    # -- requests ------------------------------------------------------------------------------
    def add(self, spec: RequestSpec, own_ids: list[int], generator: torch.Generator | None = None) -> None:
        """A request arrives now (its ids resolved by Engine.resolve); a fork shares its parent's blocks
        (partial last block included); a resumed session starts a new request from the first `truncate`
        tokens of its parent's history, with the parent's hashes of those tokens' full blocks. Sampling
        draws from `generator`, by default one seeded by the loop's seed and the request's id."""
        live, entry = self.live, self.instances[0]  # new requests enter at the prefill instance, if any
        gen = generator or request_generator(self.seed, spec.id, self.model.device)
        held = self.instance_of(spec.parent) if spec.parent is not None else entry
        parent = held.kv.seqs.get(spec.parent)
        if spec.parent is None:
            base = []
        elif parent is not None:
            base = list(parent.token_ids)
        else:  # the parent has finished: start from everything it produced
            base = live[spec.parent].prompt_ids + live[spec.parent].output_ids
        if spec.truncate is not None:
            base = base[:spec.truncate]
        state = live[spec.id] = _Live(spec, base + own_ids, gen, logits=[] if self.keep_logits else None)
        if spec.truncate is None and parent is not None and parent.block_table:
            held.kv.fork(spec.parent, spec.id)
            held.kv.append_tokens(spec.id, own_ids)
            state.cached_tokens = held.kv.seqs[spec.id].num_computed
            held.sched.add_running(spec.id)
        else:
            entry.kv.add(spec.id, state.prompt_ids, spec.cache_salt, spec.adapter)
            if spec.truncate is not None:
                hashes = parent.block_hashes if parent is not None else live[spec.parent].block_hashes
                entry.kv.resume(spec.id, hashes, len(base))
            entry.sched.add_waiting(spec.id)

    def reset_prefix_cache(self) -> bool:
        """Forget everything the prefix cache holds, as vLLM's reset_prefix_cache: only while no request
        runs, waits or is handed over (False, and nothing changes). The clear events go out with the
        next step's record, as vLLM publishes its events once per step."""
        if self.busy:
            return False
        return all([i.kv.reset_prefix_cache() for i in self.instances])

    def cancel(self, request_id: str) -> None:
        """Stop a request where it is (a client gone, a stop string seen) and free its blocks."""
        state = self.live.get(request_id)
        if state is None:
            return  # forgotten already
        inst = self.instance_of(request_id)
        if request_id in inst.sched.waiting:
            inst.sched.waiting.remove(request_id)
        elif request_id in inst.sched.running:
            inst.sched.finish(request_id)
        elif request_id in self.handoff:
            self.handoff.remove(request_id)
        else:
            return  # finished already
        state.block_hashes = inst.kv.free(request_id).block_hashes
        state.finish_reason, state.finish_step, state.finish_at = "cancelled", self.step, time.perf_counter()

    def forget(self, request_id: str) -> RequestResult:
        """A finished or cancelled request's result, dropped from the loop (a server keeps none)."""
        result = self.result(request_id)
        del self.live[request_id]
        return result

    def result(self, request_id: str) -> RequestResult:
        s, t0 = self.live[request_id], self.t0
        text = self.model.tokenizer.decode(s.output_ids, skip_special_tokens=True)
        return RequestResult(s.spec.id, s.prompt_ids, s.output_ids, text, s.finish_reason, s.cached_tokens,
                             s.spec.arrival_step, s.first_token_step, s.finish_step, s.spec.temperature == 0, s.logits,
                             s.first_token_at - t0, s.finish_at - t0)
