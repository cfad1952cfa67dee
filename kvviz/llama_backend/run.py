"""A workload run through llama.cpp, observed: what `engine.backend: "llama.cpp"` means.

llama.cpp computes; kvviz schedules requests onto its sequences as llama-server does (slots.py), builds
each `llama_batch`, samples from the logits llama.cpp returns, and observes: where every token's K/V
went and what each cell holds (cells.py, checked against llama.cpp's state after every step), and the
attention every layer computed (the adapter's evaluation callback). The step records and observer calls
have kvviz's engine's shapes: one attention group per step, every token of the batch over the cache's
key axis (cells 0..n_kv-1), so a weight on a cell llama.cpp's mask should have hidden is judged like
any other.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from ..engine import Admission, EngineError, StepRecord, eos_ids
from ..engine.attention import AttentionGroup
from ..engine.hashing import PREFIX_SEED, prefix_ids
from ..engine.observer import AttentionObserver, StepContext
from ..engine.plan import ScheduledWork
from ..engine.records import Lookup
from ..engine.sampler import ends, request_generator, sample
from ..engine.workload import RequestSpec, Workload, WorkloadError
from ..models import LoadedModel
from .adapter import BackendError, CallFailed, LlamaContext
from .cells import CellTable
from .facts import BatchToken, Ubatch
from .misuse import MISUSES, Misuse
from .slots import Chunk, Job, OneSequence, Saved, Slots
from .stored import Holding, StoredBlocks

BACKEND = "llama.cpp"
ISOLATIONS = ("masked", "streams")  # one unified cache behind the mask (kv_unified), or a stream per sequence
KERNELS = ("eager_paged", "flash_attn")  # llama.cpp's attention: KQ, softmax, KQV (its weights read); flash attention
CELL_ROUND = 256  # llama.cpp sizes its cache in multiples of this many cells
# llama.cpp is not batch-invariant: a request computed beside others (its cells in larger matrix products, its
# decode steps batched) has logits up to about 1.6 away from the same request alone on SmolLM2 Q4_1 (clean
# runs, docs/engines.md), enough to flip near ties; leaks moved them by 7 to 22. Within this, a difference
# with no foreign or stale weight is batch variance.
TOLERANCE = 3.0


def check_workload(wl: Workload) -> list[str]:
    """Refuse what llama.cpp cannot run as written (WorkloadError naming the field); return the notes on
    what it runs with a stated consequence."""
    cfg = wl.engine
    if cfg.offload is not None:
        raise WorkloadError("engine.offload: kvviz's host tier is kvviz's engine only; llama.cpp keeps every "
                            "sequence's cells in its one cache")
    if cfg.disaggregated:
        raise WorkloadError("engine.disaggregated: disaggregated prefill is kvviz's engine only")
    if cfg.kernel not in KERNELS:
        raise WorkloadError(f"engine.kernel: llama.cpp attends with {' or '.join(KERNELS)}, not {cfg.kernel!r}")
    if CELL_ROUND % cfg.block_size:
        raise WorkloadError(f"engine.block_size: llama.cpp's cache holds cells in multiples of {CELL_ROUND}; the "
                            f"block map groups them by a block size that divides {CELL_ROUND}, not {cfg.block_size}")
    for i, r in enumerate(wl.requests):
        if r.adapter is not None:
            raise WorkloadError(f"requests[{i}].adapter: the llama.cpp backend runs the base model only; use "
                                "engine.backend 'kvviz' for adapters")
    notes = []
    if (blocks := pool_blocks(wl)) != cfg.num_blocks:
        notes.append(f"engine.num_blocks: llama.cpp sizes its cache in multiples of {CELL_ROUND} cells"
                     + (" per sequence's stream" if cfg.isolation == "streams" else "")
                     + f", so the run has {blocks} blocks of {cfg.block_size} cells where {cfg.num_blocks} were asked")
    salted = sorted({r.cache_salt for r in wl.requests if r.cache_salt is not None})
    if salted:
        notes.append(f"requests[].cache_salt: llama.cpp has no cache salt, so the tenants {', '.join(salted)} share "
                     "cells; the salt is kept as each request's tenant and the oracle reports the reads across "
                     "tenants (cross_tenant findings)")
    return notes


def _round(n: int) -> int:
    return -(-n // CELL_ROUND) * CELL_ROUND


def n_sequences(wl: Workload) -> int:
    """llama-server's slots: a sequence id for each request that may run at once."""
    return min(256, len(wl.requests))


def streams(wl: Workload) -> tuple[int, int]:
    """The cache's streams and the cells of each, as llama.cpp sizes them: the pool's slots rounded up to a
    multiple of 256 cells, in one unified stream (isolation 'masked') or split between the sequences, each
    share rounded up again (isolation 'streams': kv_unified off)."""
    cells = _round(wl.engine.num_blocks * wl.engine.block_size)
    if wl.engine.isolation != "streams":
        return 1, cells
    n = n_sequences(wl)
    return n, _round(cells // n)


def pool_blocks(wl: Workload) -> int:
    """The blocks of block_size cells llama.cpp's cache really holds (rounded up, a stream per sequence):
    what the run records as its pool, so that utilisation and the block map count what there was."""
    n, size = streams(wl)
    return n * size // wl.engine.block_size


def stream_room(wl: Workload) -> tuple[int, str] | None:
    """What one request may hold where each sequence has a stream of its own (None: the whole cache)."""
    n, size = streams(wl)
    if n == 1:
        return None
    return size, f"with isolation 'streams' one sequence's stream holds {size} cells ({n} streams of llama.cpp's cache)"


@contextmanager
def open_backend(model: LoadedModel, wl: Workload, observers: Sequence[AttentionObserver] = (),
                 misuse: Misuse | None = None) -> Iterator[LlamaBackend]:
    """llama.cpp for this workload, observed, as a Backend; its context freed when the block ends."""
    check_workload(wl)
    cfg = wl.engine
    backend = LlamaBackend(model, wl, observers, misuse)
    n, size = streams(wl)
    backend.ctx = LlamaContext(model.gguf(), n_ctx=n * size, n_batch=cfg.max_batch_tokens,
                               n_seq_max=n_sequences(wl), unified=n == 1,
                               flash_attn=cfg.kernel == "flash_attn", listener=backend)
    if (backend.ctx.n_stream, backend.ctx.stream_size) != (n, size):
        raise BackendError(f"engine.num_blocks: llama.cpp made {backend.ctx.n_stream} streams of "
                           f"{backend.ctx.stream_size} cells where kvviz expected {n} of {size}")
    try:
        yield backend
    finally:
        backend.ctx.close()


class LlamaBackend:
    """llama.cpp's unified cache as a Backend."""

    def __init__(self, model: LoadedModel, wl: Workload, observers: Sequence[AttentionObserver],
                 misuse: Misuse | None):
        cfg = wl.engine
        self.model, self.observers, self.seed, self.eos = model, observers, wl.seed, eos_ids(model)
        self.ctx: LlamaContext | None = None
        n, size = streams(wl)
        self.unified = n == 1
        self.cells = CellTable(n * size, cfg.block_size, streams=n)
        self.stored = StoredBlocks(cfg.block_size)
        scheduler = OneSequence if misuse == Misuse.ONE_SEQUENCE else Slots
        self.sched = scheduler(n_sequences(wl), cfg.max_batch_tokens, self, misuse, cfg.prefix_caching, self.unified)
        self.salts = {r.id: r.cache_salt for r in wl.requests}
        self.jobs: dict[str, Job] = {}
        self.specs: dict[str, RequestSpec] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.prefixes: dict[str, list[int]] = {}
        self.step = 0
        self.misuse = misuse
        self._chunks: list[Chunk] = []  # the step's work
        self._part: list[Chunk] = []  # the part of it being decoded
        self._writes: dict[str, list[int]] = {}  # each request's cells written this step
        self._observed = 0  # decodes of the step seen by the evaluation callback
        self._seen = False  # the decode in progress was
        self._start = 0  # the first packed token of the decode in progress
        self._groups: list[AttentionGroup] = []  # the step's attention groups, one per decode

    @property
    def notes(self) -> list[str]:
        """A misuse that changed no call leaves a clean run that must not read as llama.cpp surviving it."""
        if self.misuse is None or self.sched.struck:
            return []
        if self.misuse == Misuse.CP_ONE_LONG and not self.unified:
            return [f"the misuse {self.misuse} never struck: with isolation 'streams' no request takes cells from "
                    "another sequence (seq_cp between streams copies a whole buffer), so no seq_cp was called"]
        return [MISUSES[self.misuse].never_struck()]

    # -- the cache calls the scheduler makes (slots.CacheOps) ----------------------------------
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.ctx.seq_cp(src, dst, p0, p1)
        self.cells.seq_cp(src, dst, p0, p1, self.sched.slots[dst].request)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self.ctx.seq_rm(seq, p0, p1)
        self.cells.seq_rm(seq, p0, p1, self.sched.slots[seq].request)

    def save(self, seq: int) -> Saved:
        return Saved(state=self.ctx.seq_state(seq), cells=self.cells.saved(seq))

    def restore(self, seq: int, saved: Saved, keep: int) -> None:
        self.ctx.restore(saved.state, seq)
        self.cells.restore(seq, saved.cells, self.sched.slots[seq].request)
        self.seq_rm(seq, keep, -1)

    def free_cells(self) -> int:
        return self.cells.n_cells - self.cells.occupied()

    def freed_by_rm(self, seq: int, p0: int) -> int:
        return self.cells.freed_by_rm(seq, p0)

    # -- the Backend protocol ------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.sched.running or self.sched.waiting)

    def add(self, spec: RequestSpec, own_ids: list[int], generator: torch.Generator | None = None) -> Admission:
        base: list[int] = []
        if spec.parent is not None:
            parent = self.jobs[spec.parent]
            base = parent.history if spec.truncate is None else parent.history[:spec.truncate]
        job = self.jobs[spec.id] = Job(id=spec.id, prompt=base + own_ids, max_new_tokens=spec.max_new_tokens)
        self.specs[spec.id] = spec
        self.generators[spec.id] = generator or request_generator(self.seed, spec.id, self.model.device)
        self.sched.waiting.append(job)
        return Admission(prompt_ids=list(job.prompt))

    def advance(self, snapshot: bool = False, logits: bool = False) -> StepRecord | None:
        if not self.busy:
            return None
        started = time.perf_counter()
        admitted = self.sched.admit(self.step)
        chunks = self._chunks = self.sched.batch()
        if not chunks:
            raise EngineError(f"step {self.step}: no request can be scheduled (the cache holds "
                              f"{self.cells.n_cells} cells; raise engine.num_blocks)")
        self._observed, self._writes, self._start, self._groups = 0, {}, 0, []
        sampled = self._decode(chunks) if self.unified else {k: v for c in chunks for k, v in self._decode([c]).items()}
        if self.observers and self._observed:
            for o in self.observers:
                o.end_step()
        self.sched.computed(chunks, self.step)
        record = self._record(chunks, sampled, admitted, logits)
        self.cells.check(self.ctx.cells(), self.step)
        holdings = [Holding(tokens=self.sched.held(slot), cells=self.cells.cells_of(slot.seq))
                    for slot in self.sched.slots]
        record.events = self.cells.take_events() + self.stored.changes(holdings, self.cells.provenance)
        if snapshot:
            named = {block: name for name, block in self.stored.held.items()}
            record.snapshot = self.cells.snapshot({j.id: j.slot.seq for j in self.sched.running}, named)
        record.seconds = time.perf_counter() - started
        self.step += 1
        return record

    def _decode(self, chunks: list[Chunk]) -> dict[str, torch.Tensor]:
        """One `llama_decode` of these chunks (every chunk of the step in one unified cache; one sequence's
        with a stream each, as llama.cpp would split them anyway); the logits of each request sampling."""
        self._part = chunks
        tokens = [BatchToken(token=t, pos=p, seqs=(c.job.slot.seq,), logits=c.sample and k == len(c.tokens) - 1)
                  for c in chunks for k, (t, p) in enumerate(zip(c.tokens, c.positions, strict=True))]
        self._seen = False
        try:
            rows = self.ctx.decode(tokens)
        except CallFailed as e:
            raise EngineError(f"step {self.step}: {e}") from None
        if not self._seen:
            raise BackendError(f"step {self.step}: llama.cpp decoded the batch without the graph kvviz observes")
        self._start += len(tokens)
        return {c.job.id: self.ctx.logits(row) for c, row in zip([c for c in chunks if c.sample], rows, strict=True)}

    def _record(self, chunks: list[Chunk], sampled_logits: dict[str, torch.Tensor], admitted: list[Job],
                keep: bool) -> StepRecord:
        """Sample each request whose last token was computed; the step's record."""
        sampled, finished, kept = {}, [], {}
        for c in (c for c in chunks if c.sample):
            job, spec = c.job, self.specs[c.job.id]
            logits = sampled_logits[job.id]
            tok = int(logits.argmax()) if spec.temperature == 0 else sample(logits, spec.temperature, spec.top_p,
                                                                            self.generators[job.id])
            sampled[job.id] = tok
            job.history.append(tok)
            if keep:
                kept[job.id] = logits
            if ends(tok, len(job.history) - len(job.prompt), spec, self.eos):
                finished.append(job.id)
                self.sched.finish(job)
        return StepRecord(step=self.step, work={c.job.id: (c.start, len(c.tokens)) for c in chunks},
                          admitted=[j.id for j in admitted], preempted=[], sampled=sampled, finished=finished,
                          writes=self._writes, tokens={c.job.id: c.tokens for c in chunks},
                          lookups={j.id: Lookup(tokens=len(j.prompt), hit_tokens=j.cached, salt=self.salts.get(j.id))
                                   for j in admitted}, logits=kept)

    def cancel(self, request_id: str) -> bool:
        return self.sched.cancel(request_id)

    def forget(self, request_id: str) -> None:
        for d in (self.jobs, self.specs, self.generators, self.prefixes):
            d.pop(request_id, None)

    # -- what the adapter observed (facts.Listener) --------------------------------------------
    def on_ubatch(self, ubatch: Ubatch) -> None:
        """The decode's cells, written into kvviz's account before any of its layers is judged; at the step's
        first decode the observers are told the step. Each decode is one attention group: its tokens over
        cells 0..n_kv-1 of the stream it reads."""
        if self._seen:
            raise BackendError(f"step {self.step}: llama.cpp split the batch into several evaluations")
        self._seen, self._observed = True, self._observed + 1
        cells = iter(ubatch.cells)
        for c in self._part:
            job = c.job
            p = self._prefix_ids(job.id, job.history, c.start + len(c.tokens))
            slots = self._writes[job.id] = [next(cells) for _ in c.tokens]
            for k, (cell, pos) in enumerate(zip(slots, c.positions, strict=True)):
                self.cells.write(cell, pos, (job.slot.seq,), index=c.start + k, prefix_id=p[c.start + k],
                                 token=c.tokens[k], writer=job.id, tenant=self.salts.get(job.id))
        self.cells.placed(ubatch.cells)
        if not self.observers:
            return
        if self._observed == 1:
            for o in self.observers:
                o.begin_step(self._context())
        self._group = AttentionGroup(self._start, (ubatch.base + torch.arange(ubatch.n_kv))[None],
                                     ubatch.visible[None])
        self._groups.append(self._group)  # alive for the step: observers key what they work out by the group

    def _context(self) -> StepContext:
        """The step as the observers see it: every chunk's queries at their places in their histories. Block
        lifetimes are kvviz's live array, so a stream's decode later in the step is judged on its writes."""
        work, rows, positions, prefixes, tenants = [], [], [], [], []
        for r, c in enumerate(self._chunks):
            end = c.start + len(c.tokens)
            work.append(ScheduledWork(c.job.id, c.start, c.tokens, []))
            rows += [r] * len(c.tokens)
            positions += range(c.start, end)
            prefixes.append(self._prefix_ids(c.job.id, c.job.history, end)[:end])
            tenants.append(self.salts.get(c.job.id))
        return StepContext(step=self.step, work=work, q_row=torch.tensor(rows), q_pos=torch.tensor(positions),
                           block_size=self.cells.block_size, provenance=self.cells.provenance,
                           block_lifetimes=self.cells.life, prefix_ids=prefixes, tenants=tenants)

    def on_layer(self, layer: int, weights: torch.Tensor) -> None:
        for o in self.observers:
            o.on_attention(layer, self._group, weights[None].float())

    def on_kernel(self, layer: int, excess: torch.Tensor) -> None:
        for o in self.observers:
            judge = getattr(o, "on_kernel_check", None)  # the oracle; a recorder keeps weights only
            if judge is not None:
                judge(layer, self._group, excess[None])

    def _prefix_ids(self, rid: str, history: list[int], end: int) -> list[int]:
        """The request's prefix ids up to `end`, extended as its history grows."""
        have = self.prefixes.setdefault(rid, [])
        if len(have) < end:
            have += prefix_ids(history[len(have):end], have[-1] if have else PREFIX_SEED)
        return have


def alone(wl: Workload):
    """The reference oracle's run of one request by itself on llama.cpp: its own context, one sequence,
    the prompt in chunks of the workload's batch size and then each generated token decoded one at a
    time, as the run computed them (teacher-forced); the logits of every generated position."""
    cfg = wl.engine

    def run(model: LoadedModel, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        n = len(prompt_ids) + len(output_ids)
        ctx = LlamaContext(model.gguf(), n_ctx=-(-n // CELL_ROUND) * CELL_ROUND, n_batch=cfg.max_batch_tokens,
                           n_seq_max=1, unified=True, flash_attn=cfg.kernel == "flash_attn", listener=None)
        try:
            out = []
            ids = prompt_ids + output_ids[:-1]
            starts = list(range(0, len(prompt_ids), cfg.max_batch_tokens)) + list(range(len(prompt_ids), len(ids)))
            for i, s in enumerate(starts):
                end = starts[i + 1] if i + 1 < len(starts) else len(ids)
                rows = ctx.decode([BatchToken(token=ids[p], pos=p, seqs=(0,), logits=p == end - 1 and
                                              p >= len(prompt_ids) - 1) for p in range(s, end)])
                out += [ctx.logits(r) for r in rows]
            return torch.stack(out)
        finally:
            ctx.close()
    return run
