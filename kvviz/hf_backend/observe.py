"""kvviz's view of transformers' batches: slot provenance, the oracle's step context, step records.

Nothing here imports transformers: the adapter hands over each batch (who computes which positions,
where their K/V went, which slots the packed key axis read) and each view of the cache; this module
keeps the slot facts the provenance oracle judges from (writer, position, token prefix, tenant, block
lifetime), derives the pool's events from one view to the next and makes the StepRecord kvviz's
recorder stores. The oracle sees one attention group per batch: every packed query over the whole
packed key axis (each query's request named by q_row), so a weight on another request's keys, which
transformers' mask should have hidden, is judged like any other.

A block starts a new lifetime when it enters a table fresh: held by no request before, or only by
requests that let it go, and not kept for its hash in between (a prefix-cache hit keeps the block's
lifetime and its slots' facts; a block taken for new content does not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..engine.attention import AttentionGroup
from ..engine.events import BlockEvent
from ..engine.hashing import PREFIX_SEED, prefix_ids
from ..engine.kv_cache import PoolSnapshot
from ..engine.observer import AttentionObserver, StepContext
from ..engine.plan import ScheduledWork
from ..engine.provenance import SlotProvenance
from ..engine.records import Lookup, StepRecord
from .facts import Batch, CacheView, Outcome


def _hash_bytes(h: int | None) -> bytes | None:
    """transformers' 64-bit block hash in the form kvviz's pool keeps (hash_to_u64 reads it back)."""
    return None if h is None else h.to_bytes(8, "big")


@dataclass(kw_only=True)
class _Current:
    batch: Batch
    work: list[ScheduledWork]
    group: AttentionGroup
    events: list[BlockEvent]
    writes: dict[str, list[int]]
    admitted: list[str]  # requests in their first batch
    preempted: list[str]  # requests whose blocks transformers took back to make room (to be recomputed)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # sampling request -> its row, when kept


@dataclass(kw_only=True)
class Observation:
    """The adapter's listener for one run: it feeds `observers` (the oracle, the attention recorder)."""

    total_blocks: int  # kvviz's pool: the data blocks, then transformers' trash blocks
    data_blocks: int
    block_size: int
    salts: dict[str, str | None]
    observers: Sequence[AttentionObserver] = ()
    keep_logits: bool = False  # this batch's sampled logits go on its record
    step: int = 0  # the number the next batch gets
    admitted: dict[str, Lookup] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.total_blocks
        self.provenance = SlotProvenance(n * self.block_size)
        self.life = [0] * n
        self.view = CacheView({}, [0] * n, [None] * n, [], {})  # the cache before anything ran
        self.prefix: dict[str, list[int]] = {}
        self.current: _Current | None = None

    # -- the adapter's listener ----------------------------------------------------------------
    def on_batch(self, batch: Batch) -> None:
        B, (events, preempted) = self.block_size, self._diff(self.view, batch.cache, fresh=True)
        write, dev = batch.write_slots.tolist(), batch.key_slots.device
        work, rows, positions, prefixes, writes, admitted = [], [], [], [], {}, []
        offset = 0
        for r, (rid, start, n, history) in enumerate(
            zip(batch.requests, batch.starts, batch.lengths, batch.histories, strict=True)
        ):
            p, salt, tokens = self._prefix_ids(rid, history, start + n), self.salts.get(rid), history[start : start + n]
            slots = writes[rid] = write[offset : offset + n]
            for k, slot in enumerate(slots):
                self.provenance.record(slot, p[start + k], start + k, tokens[k], rid, salt, self.life[slot // B])
            work.append(ScheduledWork(rid, start, tokens, batch.cache.tables.get(rid, [])))
            rows += [r] * n
            positions += range(start, start + n)
            prefixes.append(p[: start + n])
            if rid not in self.admitted:  # its first batch: what the prefix cache served it
                self.admitted[rid] = Lookup(tokens=len(history), hit_tokens=start, salt=salt)
                admitted.append(rid)
            offset += n
        ctx = StepContext(
            step=self.step,
            work=work,
            q_row=torch.tensor(rows, dtype=torch.long, device=dev),
            q_pos=torch.tensor(positions, dtype=torch.long, device=dev),
            block_size=B,
            provenance=self.provenance,
            block_lifetimes=list(self.life),
            prefix_ids=prefixes,
            tenants=[self.salts.get(rid) for rid in batch.requests],
        )
        group = AttentionGroup(0, batch.key_slots[None], batch.visible[None])
        self.current = _Current(batch=batch, work=work, group=group, events=events, writes=writes, admitted=admitted,
                                preempted=preempted)
        for o in self.observers:
            o.begin_step(ctx)

    def on_layer(self, layer: int, weights: torch.Tensor) -> None:
        probs = weights[None].float()
        for o in self.observers:
            o.on_attention(layer, self.current.group, probs)

    def on_kernel(self, layer: int, excess: torch.Tensor) -> None:
        for o in self.observers:
            judge = getattr(o, "on_kernel_check", None)  # the oracle; a recorder keeps weights only
            if judge is not None:
                judge(layer, self.current.group, excess[None])

    def on_logits(self, logits: torch.Tensor) -> None:
        if not self.keep_logits:
            return
        batch = self.current.batch
        sampling = [rid for rid, s in zip(batch.requests, batch.sampling, strict=True) if s]
        self.current.logits = {rid: row.cpu() for rid, row in zip(sampling, logits, strict=True)}

    # -- after the batch -----------------------------------------------------------------------
    def end(self, outcome: Outcome, after: CacheView, seconds: float) -> StepRecord:
        """The batch's record, once transformers updated its requests and cache (`after`)."""
        for o in self.observers:
            o.end_step()
        cur, self.current = self.current, None
        events = cur.events + self._diff(cur.batch.cache, after, fresh=False)[0]
        self.view = after
        record = StepRecord(
            step=self.step,
            work={w.seq_id: (w.start, len(w.token_ids)) for w in cur.work},
            admitted=cur.admitted,
            preempted=cur.preempted,
            sampled=outcome.sampled,
            finished=outcome.finished,
            writes=cur.writes,
            tokens={w.seq_id: w.token_ids for w in cur.work},
            events=events,
            lookups={rid: self.admitted[rid] for rid in cur.admitted},
            snapshot=self._snapshot(after),
            logits=cur.logits,
            seconds=seconds,
        )
        self.step += 1
        return record

    # -- internals -----------------------------------------------------------------------------
    def _prefix_ids(self, rid: str, history: list[int], end: int) -> list[int]:
        """The request's prefix ids up to `end`, extended as its history grows."""
        have = self.prefix.setdefault(rid, [])
        if len(have) < end:
            have += prefix_ids(history[len(have) : end], have[-1] if have else PREFIX_SEED)
        return have

    def _snapshot(self, view: CacheView) -> PoolSnapshot:
        cached = [b for b in view.cached if b < self.data_blocks]
        kept = set(cached)
        rest = [b for b in range(self.data_blocks) if view.refcounts[b] == 0 and b not in kept]
        return PoolSnapshot(
            self.block_size,
            tuple(view.refcounts),
            tuple(_hash_bytes(h) for h in view.hashes),
            tuple(self.life),
            tuple(cached + rest),
            {r: tuple(t) for r, t in view.tables.items()},
            dict(view.computed),
            reserved=self.total_blocks - self.data_blocks,  # the trash blocks, last: the map draws them apart
        )

    def _diff(self, before: CacheView, after: CacheView, fresh: bool) -> tuple[list[BlockEvent], list[str]]:
        """The pool's events from one view to the next, the lifetimes of blocks taken fresh, and the
        requests preempted. Before a forward (fresh) a request takes blocks from the free pool
        (allocate) or the prefix cache (hit), and one that loses its table was preempted to make room
        (transformers' soft reset: recomputed later); after one, a request finishes (free) or adopts the
        identical block another holds (share) and releases its own copy."""
        events: list[BlockEvent] = []
        preempted = [rid for rid in before.tables if fresh and rid not in after.tables]
        for rid, table in before.tables.items():
            kept = set(after.tables.get(rid, ()))
            for b in table:
                if b not in kept:
                    events.append(BlockEvent("preempt" if rid in preempted else "free", b, rid, after.refcounts[b]))
        taken: dict[int, list[str]] = {}
        for rid, table in after.tables.items():
            had = set(before.tables.get(rid, ()))
            for b in table:
                if b not in had:
                    taken.setdefault(b, []).append(rid)
        for b in range(len(after.hashes)):
            if before.hashes[b] is not None and after.hashes[b] != before.hashes[b]:
                events.append(BlockEvent("evict", b, None, after.refcounts[b], hash=_hash_bytes(before.hashes[b])))
        for b, takers in taken.items():
            holders = {rid for rid, t in before.tables.items() if b in t}
            still = any(b in after.tables.get(rid, ()) for rid in holders)
            hash_kept = before.hashes[b] is not None and after.hashes[b] == before.hashes[b]
            if not still and not hash_kept:  # taken for new content: its old slots are stale now
                self.life[b] += 1
                kinds = ["allocate"] + ["share"] * (len(takers) - 1)
            else:  # a prefix-cache hit before a forward; after one, the adoption of an identical block
                kinds = ["hit" if fresh else "share"] * len(takers)
            for kind, rid in zip(kinds, takers, strict=True):
                events.append(BlockEvent(kind, b, rid, after.refcounts[b]))
        for b in range(len(after.hashes)):
            h = after.hashes[b]
            if h is not None and h != before.hashes[b]:
                events.append(self._cached(b, h, after))
        return events, preempted

    def _cached(self, b: int, h: int, view: CacheView) -> BlockEvent:
        """A block given its hash: the hash of the block before it in a table that holds it, its tokens
        and the tenant that wrote it."""
        B, parent = self.block_size, None
        for table in view.tables.values():
            if b in table:
                i = table.index(b)
                parent = view.hashes[table[i - 1]] if i else None
                break
        tokens = tuple(self.provenance.token[b * B : (b + 1) * B])
        first = self.provenance.facts(b * B)
        return BlockEvent(
            "cache",
            b,
            first.writer,
            view.refcounts[b],
            hash=_hash_bytes(h),
            parent_hash=_hash_bytes(parent),
            token_ids=tokens,
            salt=first.tenant,
        )
