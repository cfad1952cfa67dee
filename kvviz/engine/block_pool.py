"""The physical blocks: refcounts, the LRU free queue (or another eviction order) and the prefix-cache map.

Semantics of vLLM's block pool (v1): the blocks a release frees go to the free queue in the order
given, those holding a cached hash at the tail (kept for reuse, evicted last) and those holding none
at the head, as one batch (reused first, the first given first). Eviction is lazy: a cached free
block keeps its hash until it is popped for new content, and only then is its hash-map entry
removed. Two blocks computed at once for the same prefix both keep their hash (a block table never
changes under a request); a hit takes the lower block id, and evicting one copy leaves the hash
served by the other. Plain Python, no torch: the engine owns the tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from .events import BlockEvent, EventKind
from .eviction import RankedFree
from .hashing import BlockHash


class OutOfBlocks(RuntimeError):
    """Raised before any change when a request needs more free blocks than the pool has."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"need {needed} free KV blocks, only {free} available")
        self.needed, self.free = needed, free


@dataclass(slots=True, eq=False)
class Block:
    id: int
    ref_cnt: int = 0
    hash: BlockHash | None = None
    lifetime: int = 0  # bumped on every allocation: slots written in older lifetimes are stale
    detail: dict | None = field(default=None, repr=False)  # how it was cached: parent hash, tokens, salt
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class FreeQueue:
    """Free blocks in eviction order (head first), as a doubly linked list: O(1) removal anywhere."""

    def __init__(self, blocks: Iterable[Block]):
        self._head, self._tail = Block(-1), Block(-2)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        self.append(blocks)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        b = self._head.next
        while b is not self._tail:
            yield b
            b = b.next

    def __contains__(self, b: Block) -> bool:
        return b.prev is not None

    def _link(self, b: Block, prev: Block, nxt: Block) -> None:
        b.prev, b.next, prev.next, nxt.prev = prev, nxt, b, b
        self._len += 1

    def prepend(self, blocks: Iterable[Block]) -> None:
        """Put blocks at the head as one batch, in the order given: the first is popped first (pushed
        to the head one at a time they would come out reversed)."""
        at = self._head
        for b in blocks:
            self._link(b, at, at.next)
            at = b

    def append(self, blocks: Iterable[Block]) -> None:
        """Put blocks at the tail in the order given: the last is popped last."""
        for b in blocks:
            self._link(b, self._tail.prev, self._tail)

    def remove(self, b: Block) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self._len -= 1

    def pop_head(self) -> Block:
        """The block to reuse next; OutOfBlocks, with the queue untouched, when none is free."""
        if not self._len:
            raise OutOfBlocks(1, 0)
        b = self._head.next
        self.remove(b)
        return b


class BlockPool:
    """A fixed set of blocks shared by every request; reports each change through `emit`."""

    def __init__(self, num_blocks: int, emit: Callable[[BlockEvent], None], owned: range | None = None,
                 eviction: str = "lru"):
        """`owned`: the blocks of the arena this pool allocates from (all by default); the others belong
        to another instance sharing the arena (disaggregated prefill) and are never touched. `eviction`:
        the free queue's order, LRU as vLLM's, or another policy (eviction.py)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.owned = owned if owned is not None else range(num_blocks)
        blocks = (self.blocks[i] for i in self.owned)
        self.free = FreeQueue(blocks) if eviction == "lru" else RankedFree(blocks, eviction, FreeQueue)
        self.ranked = isinstance(self.free, RankedFree)
        self.cached: dict[BlockHash, dict[int, Block]] = {}  # hash -> every block holding it, by id
        self._emit = emit
        self.spill: Callable[[Block, str | None], None] | None = None  # a host tier keeps evicted content

    @property
    def num_free(self) -> int:
        return len(self.free)

    def event(self, kind: EventKind, b: Block, request: str | None, source: int | None = None, **detail) -> None:
        self._emit(BlockEvent(kind, b.id, request, b.ref_cnt, source, **detail))

    def allocate(self, n: int, request: str) -> list[Block]:
        """Pop `n` blocks for new content, evicting cached ones from the head of the queue."""
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free)
        out = []
        for _ in range(n):
            b = self.free.pop_head()
            if b.hash is not None:
                self.evict(b, request)
            b.ref_cnt, b.lifetime = 1, b.lifetime + 1
            self.event("allocate", b, request)
            out.append(b)
        return out

    def cached_block(self, h: BlockHash) -> Block | None:
        """The block a hit on `h` takes: of several copies, the lowest id (as vLLM picks, deterministic)."""
        copies = self.cached.get(h)
        return copies[min(copies)] if copies else None

    def evict(self, b: Block, request: str | None) -> None:
        """Forget a block's hash when it is reused; the map entry must go with it (a host tier, if any,
        copies the content out first)."""
        old = b.hash
        if self.spill is not None:
            self.spill(b, request)
        copies = self.cached.get(old)
        if copies is not None and copies.get(b.id) is b:
            del copies[b.id]
            if not copies:
                del self.cached[old]
        b.hash = None
        if self.ranked:
            self.free.evicted(old)
        self.event("evict", b, request, hash=old)

    def acquire(self, blocks: Iterable[Block], request: str, kind: EventKind = "hit") -> None:
        """Add a reference to blocks that already hold content (prefix hits, forks)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free.remove(b)
            b.ref_cnt += 1
            self.event(kind, b, request)

    def release(self, blocks: Iterable[Block], request: str, kind: EventKind = "free") -> None:
        """Drop one reference from each block, in the order given (callers pass reverse order: the
        tail of a request is evicted first)."""
        freed = []
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                freed.append(b)
            self.event(kind, b, request)
        self.requeue(freed)

    def requeue(self, freed: list[Block]) -> None:
        """Blocks no request holds any more, in eviction order: those without a hash can serve no hit and
        go to the head as one batch, the cached ones to the tail."""
        self.free.prepend(b for b in freed if b.hash is None)
        self.free.append(b for b in freed if b.hash is not None)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, so that nothing cached before hits again (new weights, a clean benchmark),
        as vLLM's reset does it: only while no request holds a block (False, and nothing changes). Each
        block that held a hash says so with a clear event; the free queue keeps its order."""
        owned = [self.blocks[i] for i in self.owned]
        if any(b.ref_cnt for b in owned):
            return False
        for b in owned:
            if b.hash is not None:
                old, b.hash, b.detail = b.hash, None, None
                self.event("clear", b, None, hash=old)
        self.cached.clear()
        if self.ranked:
            self.free.clear()
        return True

    def cache(self, b: Block, h: BlockHash, request: str, **detail) -> None:
        """Publish a full block under its hash, beside any other block holding it (detail: its parent's
        hash, tokens and salt, carried on the event)."""
        if b.hash == h:
            return  # published already (a fault can let two requests fill one block)
        b.hash, b.detail = h, detail
        self.cached.setdefault(h, {})[b.id] = b
        if self.ranked:
            self.free.cached(b, detail.get("parent_hash"))
        self.event("cache", b, request, hash=h, **detail)
