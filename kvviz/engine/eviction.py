"""Which free block the pool reuses first when it is not least-recently-used (engine.eviction), so that
the policies kvviz's what-if replay compares (kvviz.whatif) can run in a real cache, and the replay be
checked against it.

As in the LRU free queue, blocks that hold no hash can serve no hit and are reused first, in the order
freed. Cached free blocks are ranked when they are freed (their touch: a request that used a block frees
it, tail first): the lowest rank is evicted first.

- `lfu`: by uses since the block's hash was cached (every request that used it), then by touch order;
- `seed`: the seed article's advice as a radix-tree cache reads it: only leaves are evictable (a cached
  block that a cached child continues is not: evicting it would strand the child), ranked GreedyDual by
  rebuild cost: a clock, raised to each victim's rank, plus the length in blocks of the prefix the block
  ends; ties by touch order. A block becomes evictable when its last cached child is evicted.
- `newcomer`: LRU, except that a block whose hash was never freed before enters as if touched a cache's
  length earlier (the pool's blocks less one, the one a running request's partial block holds), so
  one-shot prompts leave first; whether a hash was seen outlives its eviction (a flag, nothing of its KV).
  With that length the pool of N blocks ranks as the replay's newcomer at N - 1 blocks (tests).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from .hashing import BlockHash


class Block(Protocol):
    """What the ranking reads of block_pool's blocks."""

    id: int
    hash: BlockHash | None

EVICTIONS = ("lru", "lfu", "seed", "newcomer")


class RankedFree:
    """Free blocks: the uncached in a FIFO queue, the cached in a heap by rank (stale entries skipped)."""

    def __init__(self, blocks: Iterable[Block], policy: str, fifo: Callable):
        """fifo: block_pool's FreeQueue, holding the uncached blocks (and raising when nothing is free)."""
        self.policy, self.empty = policy, fifo(blocks)
        self.handicap = len(self.empty) - 1  # newcomer: a cache's length, in touches
        self.heap: list[tuple[tuple[int, int], int, Block]] = []
        self.rank: dict[int, tuple[int, int]] = {}  # free cached block id -> its live rank
        self.waiting: dict[int, tuple[Block, tuple[int, int]]] = {}  # free blocks a cached child keeps (seed)
        self.touches = self.clock = 0
        self.uses: dict[BlockHash, int] = {}
        self.seen: set[BlockHash] = set()  # newcomer: hashes freed before, evicted or not
        self.parent: dict[BlockHash, BlockHash | None] = {}
        self.depth: dict[BlockHash, int] = {}
        self.children: dict[BlockHash, int] = {}  # cached blocks continuing each cached hash

    def __len__(self) -> int:
        return len(self.empty) + len(self.rank) + len(self.waiting)

    def __iter__(self) -> Iterator[Block]:
        """In eviction order (those a child keeps last)."""
        yield from self.empty
        yield from (b for _, _, b in sorted(e for e in self.heap if self.rank.get(e[2].id) == e[0]))
        yield from (b for b, _ in self.waiting.values())

    def __contains__(self, b: Block) -> bool:
        return b in self.empty or b.id in self.rank or b.id in self.waiting

    # -- the free queue's interface (block_pool.FreeQueue) -------------------------------------
    def prepend(self, blocks: Iterable[Block]) -> None:
        self.empty.prepend(blocks)

    def append(self, blocks: Iterable[Block]) -> None:
        for b in blocks:  # touched in this order
            self.touches += 1
            self.uses[b.hash] = self.uses.get(b.hash, 0) + 1
            self._offer(b, (self._key(b.hash), self.touches))

    def remove(self, b: Block) -> None:
        if b in self.empty:
            self.empty.remove(b)
        else:
            self.rank.pop(b.id, None)
            self.waiting.pop(b.id, None)

    def pop_head(self) -> Block:
        if len(self.empty):
            return self.empty.pop_head()
        while self.heap:
            rank, _, b = heapq.heappop(self.heap)
            if self.rank.get(b.id) == rank:
                del self.rank[b.id]
                self.clock = max(self.clock, rank[0])
                return b
        return self.empty.pop_head()  # nothing free: the queue's own OutOfBlocks

    # -- what the pool tells it ----------------------------------------------------------------
    def clear(self) -> None:
        """Every hash forgotten (a prefix-cache reset): the free blocks, in eviction order, are plain free."""
        order = [b for b in self if b not in self.empty]
        self.heap, self.rank, self.waiting = [], {}, {}
        self.uses, self.parent, self.depth, self.children, self.seen = {}, {}, {}, {}, set()
        self.empty.append(order)

    def cached(self, b: Block, parent: BlockHash | None) -> None:
        """b now holds a hash continuing `parent`'s (None: the first block of a prefix)."""
        self.parent[b.hash], self.depth[b.hash] = parent, self.depth.get(parent, -1) + 1 if parent else 0
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1

    def evicted(self, h: BlockHash) -> None:
        """A block's hash is forgotten: its uses end, and its parent may become a leaf."""
        self.uses.pop(h, None)
        parent = self.parent.pop(h, None)
        if parent is not None and self.children.get(parent):
            self.children[parent] -= 1
            if not self.children[parent]:
                del self.children[parent]
                for b, rank in [w for w in self.waiting.values() if w[0].hash == parent]:
                    del self.waiting[b.id]
                    self._offer(b, rank)

    def _key(self, h: BlockHash) -> int:
        """The first part of a block's rank as it is freed (touches break ties)."""
        if self.policy == "lfu":
            return self.uses[h]
        if self.policy == "newcomer":
            first = h not in self.seen
            self.seen.add(h)
            return self.touches - self.handicap * first
        return self.clock + self.depth.get(h, 0) + 1

    def _offer(self, b: Block, rank: tuple[int, int]) -> None:
        if self.policy == "seed" and self.children.get(b.hash):
            self.waiting[b.id] = (b, rank)
            return
        self.rank[b.id] = rank
        heapq.heappush(self.heap, (rank, b.id, b))
