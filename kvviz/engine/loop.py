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
from .backend import Admission, EngineError
from .block_pool import OutOfBlocks
from .config import EngineConfig
from .defences import Defences
from .kv_cache import KVCacheManager
from .observer import AttentionObserver, StepContext
from .plan import ScheduledWork, build_step
from .records import KVTransfer, Lookup, StepRecord
from .sampler import ends, request_generator, sample
from .scheduler import Scheduler, StepSchedule
from .workload import RequestSpec


@dataclass(kw_only=True)
class _Request:
    """What the loop keeps of a request to compute it: its tokens so far, how to sample its next one."""

    spec: RequestSpec
    generator: torch.Generator
    tokens: list[int]  # the prompt, then every token it sampled
    prompt_len: int
    block_hashes: list[bytes] = field(default_factory=list)  # its chain when it finished (a session resumes it)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class Instance:
    """A pool and the scheduler that fills it."""

    kv: KVCacheManager
    sched: Scheduler


class EngineLoop:
    """kvviz's own engine as a Backend: one shared pool, its scheduler and its requests (or a prefill
    and a decode instance); `advance` runs one step."""

    def __init__(self, model: LoadedModel, config: EngineConfig, defences: Defences, eos_ids: set[int], seed: int = 0,
                 observers: Sequence[AttentionObserver] = ()):
        cfg = self.config = config
        self.model, self.defences, self.eos_ids, self.seed = model, defences, eos_ids, seed
        self.observers = observers
        N, arena = cfg.num_blocks, cfg.num_blocks * (2 if cfg.disaggregated else 1)
        host = cfg.offload.cpu_blocks if cfg.offload else 0  # on the instance that looks prefixes up
        self.kv = KVCacheManager(arena, cfg.block_size, cfg.prefix_caching, 0 if cfg.disaggregated else host,
                                 owned=range(N), eviction=cfg.eviction)
        self.sched = Scheduler(self.kv, cfg.max_batch_tokens, cfg.schedule)
        self.decode = Instance(self.kv, self.sched)  # the only instance, unless disaggregated
        self.prefill: Instance | None = None
        if cfg.disaggregated:  # blocks N..2N-1 of the arena are the prefill instance's pool
            pkv = KVCacheManager(arena, cfg.block_size, cfg.prefix_caching, host, owned=range(N, arena),
                                 provenance=self.kv.provenance, eviction=cfg.eviction)
            self.prefill = Instance(pkv, Scheduler(pkv, cfg.max_batch_tokens, cfg.schedule))
        self.handoff: list[str] = []  # prefilled, waiting for room in the decode pool
        for inst in self.instances:
            defences.pool_patches.apply(inst.kv)
        self.tensors = KVTensors(arena * cfg.block_size)
        self.host_tensors = KVTensors(cfg.offload.cpu_blocks * cfg.block_size, "cpu") if cfg.offload else None
        self.live: dict[str, _Request] = {}
        self.step = 0  # the number the next step gets
        self.notes: list[str] = []

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

    def advance(self, snapshot: bool = False, logits: bool = False) -> StepRecord | None:
        """Run one step and return its record (with the pool's snapshot and the sampled logits when
        asked), or None when no request is there; EngineError when requests wait but none can be
        scheduled."""
        started = time.perf_counter()
        transfers = self._hand_over() if self.prefill else []
        plans = [i.sched.schedule() for i in self.instances]
        plan = StepSchedule(*([x for p in plans for x in getattr(p, f)] for f in ("work", "preempted", "admitted")))
        if not plan.work:
            if self.busy:
                raise EngineError(f"step {self.step}: no request can be scheduled (pool too small?)")
            return None
        record = self._step(plan, logits)
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
        if snapshot:  # only for a consumer: keep it off the bare hot path
            snap = self.kv.snapshot()
            if self.prefill:
                snap = snap.merged(self.prefill.kv.snapshot(), self.prefill.kv.pool.owned)
            record.snapshot, record.seconds = snap, time.perf_counter() - started
        self.step += 1
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
            kv_of, intact = self.kv.received(sid, seq.num_computed)
            out.append(KVTransfer(request=sid, blocks=len(table), bytes=seq.num_computed * per_slot, status=status,
                                  from_blocks=tuple(seq.block_table), to_blocks=tuple(table), kv_of=kv_of,
                                  intact=intact))
            pkv.free(sid)
            self.sched.add_running(sid)
        return out

    # -- one step ------------------------------------------------------------------------------
    def _step(self, plan, keep_logits: bool) -> StepRecord:
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
        lookups = {sid: Lookup(tokens=len(seqs[sid].token_ids), hit_tokens=seqs[sid].cached_tokens, salt=seqs[sid].salt)
                   for sid in plan.admitted}
        names = [work[r].seq_id for r in sampling]
        sampled, finished = self._sample(logits, names, seqs)
        kept = {sid: logits[i].float().cpu() for i, sid in enumerate(names)} if keep_logits else {}
        return StepRecord(step=self.step, work={w.seq_id: (w.start, len(w.token_ids)) for w in work},
                          admitted=plan.admitted, preempted=plan.preempted, sampled=sampled, finished=finished,
                          writes=writes, tokens={w.seq_id: w.token_ids for w in work}, lookups=lookups, logits=kept)

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
        return writes

    def _forward(self, work: list[ScheduledWork], inp, seqs: dict, keep: list[int]) -> torch.Tensor:
        """The model over every packed token, observers told the step first and every layer's weights;
        the logits of the `keep` positions (each sampling request's last token)."""
        observers, cfg = self.observers, self.config
        if observers:
            ctx = StepContext(step=self.step, work=work, q_row=inp.q_row, q_pos=inp.position_ids[0],
                              block_size=cfg.block_size, provenance=self.kv.provenance,
                              block_lifetimes=self._lifetimes(),
                              prefix_ids=[seqs[w.seq_id].prefix_ids[:w.end] for w in work],
                              tenants=[seqs[w.seq_id].salt for w in work])
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
        sampled, finished = {}, []
        greedy = logits.argmax(-1).tolist()  # one pass over the step's rows, as generate takes its argmax
        for i, sid in enumerate(requests):
            state = self.live[sid]
            spec = state.spec
            tok = greedy[i] if spec.temperature == 0 else sample(logits[i], spec.temperature, spec.top_p,
                                                                 state.generator)
            state.tokens.append(tok)
            sampled[sid] = tok
            if ends(tok, state.generated, spec, self.eos_ids):
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
    def add(self, spec: RequestSpec, own_ids: list[int], generator: torch.Generator | None = None) -> Admission:
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
            base = list(live[spec.parent].tokens)
        if spec.truncate is not None:
            base = base[:spec.truncate]
        prompt = base + own_ids
        live[spec.id] = _Request(spec=spec, generator=gen, tokens=list(prompt), prompt_len=len(prompt))
        if spec.truncate is None and parent is not None and parent.block_table:
            held.kv.fork(spec.parent, spec.id)
            held.kv.append_tokens(spec.id, own_ids)
            held.sched.add_running(spec.id)
            return Admission(prompt_ids=prompt, cached_tokens=held.kv.seqs[spec.id].num_computed)
        entry.kv.add(spec.id, prompt, spec.cache_salt, spec.adapter)
        if spec.truncate is not None:
            hashes = parent.block_hashes if parent is not None else live[spec.parent].block_hashes
            entry.kv.resume(spec.id, hashes, len(base))
        entry.sched.add_waiting(spec.id)
        return Admission(prompt_ids=prompt)

    def reset_prefix_cache(self) -> bool:
        """Forget everything the prefix cache holds, as vLLM's reset_prefix_cache: only while no request
        runs, waits or is handed over (False, and nothing changes). The clear events go out with the
        next step's record, as vLLM publishes its events once per step."""
        if self.busy:
            return False
        return all([i.kv.reset_prefix_cache() for i in self.instances])

    def cancel(self, request_id: str) -> bool:
        """Stop a request where it is (a client gone, a stop string seen) and free its blocks."""
        state = self.live.get(request_id)
        if state is None:
            return False
        inst = self.instance_of(request_id)
        if request_id in inst.sched.waiting:
            inst.sched.waiting.remove(request_id)
        elif request_id in inst.sched.running:
            inst.sched.finish(request_id)
        elif request_id in self.handoff:
            self.handoff.remove(request_id)
        else:
            return False  # finished already
        state.block_hashes = inst.kv.free(request_id).block_hashes
        return True

    def forget(self, request_id: str) -> None:
        """Drop an ended request's history (a server keeps none; a fork of it can no longer start)."""
        self.live.pop(request_id, None)
