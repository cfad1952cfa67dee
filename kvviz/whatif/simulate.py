"""The exact replay of one eviction policy at one capacity: one pass over the trace, a heap of cached
blocks ordered by the policy's priority (lowest evicted first), stale entries skipped when popped.

Per request: look up its full blocks (hits up to the first uncached one), then store its first
min(blocks, capacity) blocks, evicting other blocks for the missing ones: a request's own blocks are
held while it is stored (vLLM's refcount), so they are never the victims.
"""

from __future__ import annotations

from heapq import heappop, heappush

import numpy as np

from ..errors import KvvizError
from .policies import make_policy
from .trace import Trace


def replay(trace: Trace, policy: str, capacity: int) -> np.ndarray:
    """Blocks served from cache per request, under `policy` with room for `capacity` blocks."""
    if capacity < 1:
        raise KvvizError(f"capacity must be at least 1 block, got {capacity}")
    rank = make_policy(policy, trace, capacity)
    priority, evicted = rank.priority, rank.evicted
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
        while excess > 0:
            p, x = heappop(heap)
            if current[x] == p and cached[x] and held[x] != r:  # held: a fresh entry is pushed below
                cached[x] = 0
                evicted(x, p)
                excess -= 1
                size -= 1
        for i, x in enumerate(stored, a):
            size += not cached[x]
            cached[x] = 1
            current[x] = p = priority(x, i)
            heappush(heap, (p, x))
    return np.array(hits, np.int64)
