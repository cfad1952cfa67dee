"""Page tables over the shared block pool: admission with prefix-cache hits, append, fork,
copy-on-write, free and preempt, plus slot provenance, invariant checks and snapshots.

Lifecycle of one request (the engine drives it once per step):
`add` -> `admit` (reuse cached prefix blocks, allocate for the first chunk) -> forward writes K/V
-> `commit` (record provenance, hash newly full blocks) -> `append_tokens` (sampled token) ->
`allocate` (next chunk or decode token) -> ... -> `free`. Every allocation is all or nothing.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from .block_pool import Block, BlockPool, OutOfBlocks
from .events import BlockEvent
from .hashing import BlockHash, block_hash, content_seed, next_prefix_id
from .host_tier import HostKey, HostTier, Stored
from .provenance import SlotProvenance


@dataclass(slots=True)
class Sequence:
    """One request's view of the cache: its tokens, page table and how many K/V are written."""

    id: str
    token_ids: list[int]
    salt: str | None = None
    adapter: str | None = None  # the weights its K/V are computed under (None: the base model)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0  # what its admission said the cache served (the reply's usage reports it)
    prefix_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.prefix_ids, self.block_hashes = [], []
        self._extend_prefix_ids(self.token_ids)

    def _extend_prefix_ids(self, tokens: Seq[int]) -> None:
        p = self.prefix_ids[-1] if self.prefix_ids else content_seed(self.adapter)
        for t in tokens:
            p = next_prefix_id(p, t)
            self.prefix_ids.append(p)

    def append(self, tokens: Seq[int]) -> None:
        self.token_ids.extend(tokens)
        self._extend_prefix_ids(tokens)


@dataclass(frozen=True, slots=True)
class Allocation:
    """Where the next K/V writes of one request go, and which blocks the engine must copy first."""

    start: int  # first position written
    slots: list[int]
    copies: list[tuple[int, int]]  # (source block, destination block) copy-on-write pairs


@dataclass(frozen=True)
class PoolSnapshot:
    """Page tables and block states at one instant, detached from the live pool."""

    block_size: int
    refcounts: tuple[int, ...]
    hashes: tuple[BlockHash | None, ...]
    lifetimes: tuple[int, ...]
    free_queue: tuple[int, ...]
    page_tables: dict[str, tuple[int, ...]]
    num_computed: dict[str, int]
    host_hashes: tuple[BlockHash | None, ...] = ()  # the host tier's blocks (offloading), if any
    reserved: int = 0  # the last `reserved` blocks are held back from every request (transformers' trash blocks)

    def state(self, block: int) -> str:
        if block >= len(self.refcounts) - self.reserved:  # neither free to allocate nor any request's
            return "reserved"
        if self.refcounts[block] > 0:
            return "used"
        return "cached" if self.hashes[block] is not None else "free"

    def merged(self, other: PoolSnapshot, blocks: range) -> PoolSnapshot:
        """This snapshot with `other`'s state for `blocks` (the other instance's share of the arena)."""
        def pick(mine: tuple, theirs: tuple) -> tuple:
            return tuple(theirs[i] if i in blocks else v for i, v in enumerate(mine))
        return PoolSnapshot(self.block_size, pick(self.refcounts, other.refcounts), pick(self.hashes, other.hashes),
                            pick(self.lifetimes, other.lifetimes), self.free_queue + other.free_queue,
                            {**other.page_tables, **self.page_tables}, {**other.num_computed, **self.num_computed},
                            self.host_hashes or other.host_hashes, self.reserved)

    def live_slots(self) -> int:
        """Slots holding a computed token of a request that still holds the block: per block, the most
        positions any holder has computed into it (a shared block counts once)."""
        B, fill = self.block_size, {}
        for req, table in self.page_tables.items():
            n = self.num_computed.get(req, 0)
            for i, b in enumerate(table):
                fill[b] = max(fill.get(b, 0), min(B, max(0, n - i * B)))
        return sum(fill.values())


class InvariantError(AssertionError):
    """The pool's bookkeeping is inconsistent; the message lists every violation found."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, host_blocks: int = 0,
                 owned: range | None = None, provenance: SlotProvenance | None = None, eviction: str = "lru"):
        """`owned` and `provenance`: this instance's share of an arena another instance uses too (the
        prefill instance of a disaggregated engine), and the slot facts of the whole arena."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events: list[BlockEvent] = []
        self.pool = BlockPool(num_blocks, self.events.append, owned, eviction)
        self.provenance = provenance or SlotProvenance(num_blocks * block_size)
        self.incoming: list[tuple[int, int]] = []  # (source block, block) K/V copies of received requests
        self.host = HostTier(host_blocks, block_size, self.provenance, self.events.append) if host_blocks else None
        if self.host is not None:
            self.pool.spill = lambda b, request: self.host.offload(b, request)  # late-bound: faults may patch it
        self.seqs: dict[str, Sequence] = {}
        self.prefix_queries = self.prefix_hits = 0  # in tokens, as vLLM counts them

    # -- requests ---------------------------------------------------------------------------
    def add(self, seq_id: str, token_ids: Seq[int], salt: str | None = None, adapter: str | None = None) -> Sequence:
        if seq_id in self.seqs:
            raise ValueError(f"request {seq_id!r} is already in the cache")
        if not token_ids:
            raise ValueError(f"request {seq_id!r} has no tokens")
        seq = self.seqs[seq_id] = Sequence(seq_id, list(token_ids), salt, adapter)
        return seq

    def append_tokens(self, seq_id: str, token_ids: Seq[int]) -> None:
        self.seqs[seq_id].append(token_ids)

    def resume(self, seq_id: str, hashes: Seq[BlockHash], keep: int) -> None:
        """A session resubmitted with the first `keep` tokens of an earlier request's history (same
        namespaces): the earlier hashes still name the full blocks wholly inside the kept tokens, and
        only those (the rest were computed over tokens this request no longer has)."""
        self.seqs[seq_id].block_hashes = list(hashes[:keep // self.block_size])

    def hash_keys(self, seq: Sequence) -> tuple:
        """The namespaces that enter a chain's first block hash, each tagged with its kind."""
        return tuple((kind, name) for kind, name in (("salt", seq.salt), ("adapter", seq.adapter)) if name is not None)

    def block_hash(self, seq: Sequence, i: int) -> BlockHash:
        """Hash of the seq's i-th full block; the namespaces enter block 0 and the rest via the chain."""
        B = self.block_size
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[j - 1] if j else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids[j * B:(j + 1) * B],
                                               () if j else self.hash_keys(seq)))
        return seq.block_hashes[i]

    def reads_cache(self, seq: Sequence) -> bool:
        """Whether the seq may be served from the prefix cache: always, when caching is on (its
        namespaces are in its keys, so it only finds K/V computed as its own would be)."""
        return self.enable_prefix_caching

    def lookup(self, seq_id: str) -> list[Block]:
        """Cached blocks for the longest prefix of full blocks; the last prompt token is never a hit."""
        seq = self.seqs[seq_id]
        if not self.reads_cache(seq):
            return []
        hits = []
        for i in range((len(seq.token_ids) - 1) // self.block_size):
            b = self.pool.cached_block(self.block_hash(seq, i))
            if b is None:
                break
            hits.append(b)
        return hits

    def on_host(self, seq: Sequence, start: int) -> list[HostKey]:
        """Host keys of the seq's full blocks from `start` on that the host tier can restore, in a row."""
        if self.host is None or not self.reads_cache(seq):
            return []
        B = self.block_size
        return self.host.run(Stored(self.block_hash(seq, i), seq.prefix_ids[(i + 1) * B - 1])
                             for i in range(start, (len(seq.token_ids) - 1) // B))

    def servable(self, seq_id: str) -> int:
        """How many leading full blocks the cache can serve: device hits, then host restores."""
        hits = len(self.lookup(seq_id))
        return hits + len(self.on_host(self.seqs[seq_id], hits))

    def admit(self, seq_id: str, budget: int) -> Allocation:
        """Start or restart a request: take its cached prefix (restoring what the host tier holds),
        then room for up to `budget` tokens."""
        seq = self.seqs[seq_id]
        assert not seq.block_table, f"{seq_id} already holds blocks"
        hits = self.lookup(seq_id)
        restores = self.on_host(seq, len(hits))
        cached = (len(hits) + len(restores)) * self.block_size
        n = min(budget, len(seq.token_ids) - cached)
        new_blocks = self._blocks_for(cached + n) - len(hits)
        needed = new_blocks + sum(b.ref_cnt == 0 for b in hits)
        if needed > self.pool.num_free:
            raise OutOfBlocks(needed, self.pool.num_free)
        self.pool.acquire(hits, seq_id, "hit")
        seq.block_table = [b.id for b in hits]
        if restores:
            self._restore(seq, restores)
        seq.num_computed = cached
        seq.cached_tokens = self.count_cached(len(hits), len(restores))
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += cached
        return self.allocate(seq_id, n)

    def count_cached(self, device_blocks: int, restored_blocks: int) -> int:
        """The cached tokens an admission reports (a reply's usage.prompt_tokens_details.cached_tokens):
        every token either tier served."""
        return (device_blocks + restored_blocks) * self.block_size

    def allocate(self, seq_id: str, num_tokens: int) -> Allocation:
        """Room for the next `num_tokens` K/V writes; copies a shared partial block first."""
        seq, B = self.seqs[seq_id], self.block_size
        start = seq.num_computed
        if start + num_tokens > len(seq.token_ids):
            raise ValueError(f"{seq_id}: cannot allocate past its {len(seq.token_ids)} known tokens")
        shared_tail = start % B != 0 and self.pool.blocks[seq.block_table[start // B]].ref_cnt > 1
        new_blocks = max(0, self._blocks_for(start + num_tokens) - len(seq.block_table))
        if new_blocks + shared_tail > self.pool.num_free:
            raise OutOfBlocks(new_blocks + shared_tail, self.pool.num_free)
        copies = self.copy_on_write(seq, start // B) if shared_tail else []
        seq.block_table += [b.id for b in self.pool.allocate(new_blocks, seq_id)]
        return Allocation(start, [self.slot(seq, p) for p in range(start, start + num_tokens)], copies)

    def _restore(self, seq: Sequence, keys: list[HostKey]) -> None:
        """Copy the host tier's blocks back into fresh device blocks and publish them there again. The
        allocation may offload other blocks; the ones being restored are never the host's victims."""
        B, start = self.block_size, len(seq.block_table)
        self.host.pinned = set(keys)
        try:
            blocks = self.pool.allocate(len(keys), seq.id)
        finally:
            self.host.pinned = set()
        for i, (k, b) in enumerate(zip(keys, blocks, strict=True)):
            self.host.restore(k, b, seq.id)
            j = start + i
            self.pool.cache(b, self.block_hash(seq, j), seq.id, parent_hash=self.block_hash(seq, j - 1) if j else None,
                            token_ids=tuple(seq.token_ids[j * B:(j + 1) * B]), salt=seq.salt, adapter=seq.adapter)
        seq.block_table += [b.id for b in blocks]

    def copy_on_write(self, seq: Sequence, index: int) -> list[tuple[int, int]]:
        """Give `seq` a private copy of its shared block `index`; other holders keep the original.
        Returns the (source, destination) block pair for the engine to copy K/V."""
        src = self.pool.blocks[seq.block_table[index]]
        (dst,) = self.pool.allocate(1, seq.id)
        B = self.block_size
        self.provenance.copy(src.id * B, dst.id * B, seq.num_computed - index * B, dst.lifetime)
        self.pool.release([src], seq.id, "free")
        seq.block_table[index] = dst.id
        self.pool.event("cow", dst, seq.id, source=src.id)
        return [(src.id, dst.id)]

    def commit(self, seq_id: str, num_tokens: int, slots: Seq[int] | None = None) -> None:
        """The forward wrote K/V for the next `num_tokens` positions (into `slots` if given):
        record who produced each slot, then publish blocks that just became full."""
        seq, B = self.seqs[seq_id], self.block_size
        start, end = seq.num_computed, seq.num_computed + num_tokens
        for k, p in enumerate(range(start, end)):
            s = slots[k] if slots is not None else self.slot(seq, p)
            self.provenance.record(s, seq.prefix_ids[p], p, seq.token_ids[p], seq_id, seq.salt,
                                   self.pool.blocks[s // B].lifetime)
        seq.num_computed = end
        self.publish(seq, start // B, end // B)

    def publish(self, seq: Sequence, first: int, end: int) -> None:
        """Give the seq's full blocks first..end-1 their hashes (prefix caching)."""
        if self.enable_prefix_caching:
            B = self.block_size
            for i in range(first, end):
                self.pool.cache(self.pool.blocks[seq.block_table[i]], self.block_hash(seq, i), seq.id,
                                parent_hash=self.block_hash(seq, i - 1) if i else None,
                                token_ids=tuple(seq.token_ids[i * B:(i + 1) * B]), salt=seq.salt, adapter=seq.adapter)

    def receive(self, seq_id: str, token_ids: Seq[int], salt: str | None, adapter: str | None, computed: int,
                source: Seq[int]) -> str:
        """A request prefilled by another instance arrives with K/V for its first `computed` tokens in
        that instance's blocks `source`: take blocks for them, queue the copies, publish the full ones.
        Returns the transfer's status (OutOfBlocks, before any change, when the pool lacks room)."""
        n = self._blocks_for(computed)
        if n > self.pool.num_free:
            raise OutOfBlocks(n, self.pool.num_free)
        seq = self.add(seq_id, token_ids, salt, adapter)
        seq.block_table = [b.id for b in self.pool.allocate(n, seq_id)]
        status = self.copy_in(list(source), seq.block_table, computed, seq_id)
        seq.num_computed = computed
        self.publish(seq, 0, computed // self.block_size)
        return status

    def copy_in(self, source: list[int], blocks: list[int], n: int, seq_id: str) -> str:
        """The transfer itself: `n` slots' K/V (queued for the engine) and their facts, block by block,
        each copy an event (what arrived, not what was asked for)."""
        B = self.block_size
        for k, (s, d) in enumerate(zip(source, blocks, strict=False)):
            self.provenance.copy(s * B, d * B, min(B, n - k * B), self.pool.blocks[d].lifetime)
            self.pool.event("transfer", self.pool.blocks[d], seq_id, source=s)
        self.incoming += list(zip(source, blocks, strict=False))
        return "ok"

    def received(self, seq_id: str, n: int) -> tuple[tuple[str, ...], bool]:
        """What a request's first `n` slots hold, by provenance: the requests that wrote them in their
        blocks' current lifetimes ("unwritten" for slots nothing wrote since allocation), and whether
        each holds this request's own token prefix at its position (a hit or a fork's parent may have
        written it: same tokens, same K/V). A transfer that delivered what it says is intact."""
        seq, B = self.seqs[seq_id], self.block_size
        writers, intact = set(), True
        for p in range(n):
            b = seq.block_table[p // B]
            facts = self.provenance.facts(b * B + p % B)
            if facts.lifetime != self.pool.blocks[b].lifetime or not facts.writer:
                writers.add("unwritten")
                intact = False
            else:
                writers.add(facts.writer)
                intact &= facts.prefix_id == seq.prefix_ids[p] and facts.pos == p
        return tuple(sorted(writers)), intact

    def fork(self, parent_id: str, child_id: str) -> Sequence:
        """A child of the same tenant sharing every block of its parent, partial last block included."""
        parent = self.seqs[parent_id]
        if child_id in self.seqs:
            raise ValueError(f"request {child_id!r} is already in the cache")
        child = Sequence(child_id, parent.token_ids, parent.salt, parent.adapter)
        child.block_table, child.num_computed = list(parent.block_table), parent.num_computed
        self.pool.acquire((self.pool.blocks[b] for b in child.block_table), child_id, "share")
        self.seqs[child_id] = child
        return child

    def free(self, seq_id: str) -> Sequence:
        """Release a finished request's blocks, last block first so its tail is evicted first."""
        seq = self.seqs.pop(seq_id)
        self._release(seq, "free")
        return seq

    def preempt(self, seq_id: str) -> None:
        """Drop a request's blocks but keep its tokens, to be recomputed when it is admitted again."""
        self._release(self.seqs[seq_id], "preempt")

    def _release(self, seq: Sequence, kind: str) -> None:
        self.pool.release((self.pool.blocks[b] for b in reversed(seq.block_table)), seq.id, kind)
        seq.block_table, seq.num_computed = [], 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, on the device and the host tier, while no request holds a block;
        False (and nothing changes) otherwise."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.host is not None:
            self.host.clear()
        return True

    # -- addressing ----------------------------------------------------------------------------
    def slot(self, seq: Sequence, pos: int) -> int:
        """Page-table lookup: the physical slot of logical position `pos`."""
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def pop_events(self) -> list[BlockEvent]:
        out, self.events[:] = list(self.events), []
        return out

    # -- inspection ----------------------------------------------------------------------------
    def snapshot(self) -> PoolSnapshot:
        blocks = self.pool.blocks
        return PoolSnapshot(
            self.block_size,
            tuple(b.ref_cnt for b in blocks),
            tuple(b.hash for b in blocks),
            tuple(b.lifetime for b in blocks),
            tuple(b.id for b in self.pool.free),
            {s.id: tuple(s.block_table) for s in self.seqs.values()},
            {s.id: s.num_computed for s in self.seqs.values()},
            tuple(self.host.hashes) if self.host else (),
        )

    def foreign_slots(self, seq_id: str) -> list[int]:
        """Positions of `seq_id` whose slot does not hold K/V of this request's own prefix."""
        seq, prov, B = self.seqs[seq_id], self.provenance, self.block_size
        bad = []
        for p in range(seq.num_computed):
            s = self.slot(seq, p)
            if not (prov.life[s] == self.pool.blocks[s // B].lifetime and prov.pos[s] == p
                    and prov.prefix[s] == seq.prefix_ids[p]):
                bad.append(p)
        return bad

    def check(self) -> None:
        """Assert every bookkeeping invariant of the pool; raise InvariantError listing all failures."""
        errors, blocks, B = [], self.pool.blocks, self.block_size
        refs = [0] * len(blocks)
        for seq in self.seqs.values():
            for b in seq.block_table:
                refs[b] += 1
            lo, hi = self._blocks_for(seq.num_computed), self._blocks_for(len(seq.token_ids))
            if not lo <= len(seq.block_table) <= hi:
                errors.append(f"{seq.id}: {len(seq.block_table)} blocks for {seq.num_computed} computed tokens")
            for i in range(seq.num_computed // B):
                h = blocks[seq.block_table[i]].hash
                if h is not None and h != self.block_hash(seq, i):
                    errors.append(f"{seq.id}: block {seq.block_table[i]} cached under another prefix")
        queued = [b.id for b in self.pool.free]
        if len(queued) != len(set(queued)) or len(queued) != len(self.pool.free):
            errors.append(f"free queue has duplicates or a wrong length: {queued}")
        for b in (blocks[i] for i in self.pool.owned):
            if b.ref_cnt != refs[b.id]:
                errors.append(f"block {b.id}: refcount {b.ref_cnt} but {refs[b.id]} page-table references")
            if (b.ref_cnt == 0) != (b in self.pool.free):
                errors.append(f"block {b.id}: refcount {b.ref_cnt} but in free queue = {b in self.pool.free}")
            if b.hash is not None and self.pool.cached.get(b.hash, {}).get(b.id) is not b:
                errors.append(f"block {b.id}: has a hash the map does not point back to")
        for h, copies in self.pool.cached.items():
            if not copies:
                errors.append("hash map holds a hash with no block")
            for i, b in copies.items():
                if b.hash != h or b.id != i:
                    errors.append(f"hash map points at block {b.id}, which holds another hash")
        for k, b in (self.host.cached.items() if self.host else ()):
            if self.host.keys[b] != k:
                errors.append(f"host key map points at host block {b}, which holds another key")
        if errors:
            raise InvariantError("; ".join(errors))
