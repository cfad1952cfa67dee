"""The exact replay of one eviction policy at one capacity: one pass over the trace, a heap of cached
blocks ordered by the policy's priority (lowest evicted first), stale entries skipped when popped.

Per request: look up its full blocks (hits up to the first uncached one), then store its first
min(blocks, capacity) blocks, evicting other blocks for the missing ones: a request's own blocks are
held while it is stored (vLLM's refcount), so they are never the victims.

A policy with `leaves_only` evicts as a radix tree does (SGLang): only blocks no cached block extends,
since a cached child would be stranded behind its missing parent, unreachable under the prefix rule.
The replay, not the policy, enforces it, so a policy only ranks blocks: a block enters the heap only as
a leaf (touched with no cached child, or, at the priority of its last touch, when its last cached child
is evicted), and stays a leaf while its entry is live, as caching a child touches its parent anew.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop, heappush

import numpy as np

from ..errors import KvvizError
from .policies import make_policy
from .trace import Trace


def replay(trace: Trace, policy: str, capacity: int, *,
           after: Callable[[int, bytearray], None] | None = None) -> np.ndarray:
    """Blocks served from cache per request, under `policy` with room for `capacity` blocks; `after`, if
    given, sees the cached flags (per key) once each request is stored: how the tests watch the cache."""
    if capacity < 1:
        raise KvvizError(f"capacity must be at least 1 block, got {capacity}")
    rank = make_policy(policy, trace, capacity)
    priority, evicted = rank.priority, rank.evicted
    leaves = getattr(rank, "leaves_only", False)
    parent = parents(trace) if leaves else []
    children = [0] * trace.distinct_blocks if leaves else []  # cached children, kept only for leaves_only
    keys, offsets = trace.keys.tolist(), trace.offsets.tolist()
    cached = bytearray(trace.distinct_blocks)
    current = [0] * trace.distinct_blocks  # a cached block's live priority; older heap entries are stale
    held = [-1] * trace.distinct_blocks  # the request that holds the block now
    heap: list[tuple[int, int]] = []
    hits, size = [0] * trace.requests, 0
    for r in range(trace.requests):
        a, b = offsets[r], offsets[r + 1]
        h = a
        while h < b and cached[keys[h]]:
            h += 1
        hits[r] = h - a
        stored = keys[a:min(b, a + capacity)]
        excess = size - capacity
        for x in stored:
            held[x] = r
            excess += not cached[x]
        while excess > 0:  # leaves_only: the held blocks are a path from the root, so a leaf is left outside
            p, x = heappop(heap)
            if current[x] != p or not cached[x] or held[x] == r:  # held: a fresh entry is pushed below
                continue
            if leaves and (y := parent[x]) >= 0:
                children[y] -= 1
                if not children[y]:
                    heappush(heap, (current[y], y))
            cached[x] = 0
            evicted(x, p)
            excess -= 1
            size -= 1
        last = a + len(stored) - 1
        for i, x in enumerate(stored, a):
            if not cached[x]:
                size += 1
                cached[x] = 1
                if leaves and (y := parent[x]) >= 0:
                    children[y] += 1
            current[x] = p = priority(x, i)
            if not leaves or i == last and not children[x]:  # a non-leaf is pushed once it is a leaf
                heappush(heap, (p, x))
        if after:
            after(r, cached)
    return np.array(hits, np.int64)


def parents(trace: Trace) -> list[int]:
    """Per key, the key of the block before it (-1 for a first block): one per key, as keys are chained."""
    up = np.full(trace.distinct_blocks, -1, np.int64)
    deep = np.flatnonzero(trace.depth)
    up[trace.keys[deep]] = trace.keys[deep - 1]
    return up.tolist()
