"""LRU at every capacity from one pass: each lookup's reuse distance, the number of distinct blocks used
since the block's previous use, says at once every capacity at which LRU still holds it.

LRU here orders blocks as vLLM's free queue does: a finished request's blocks are freed tail first, so of
one request's blocks the deepest is evicted first and the first block last. The replay therefore
touches each request's blocks in reverse (deepest first), and a block's rank in the LRU stack when its
request starts is its distance e: LRU of capacity C holds it then exactly when e < C. A cached block's
parent was used at least as recently (every request that uses a block uses its prefix), so along a
request e only grows: the blocks with e < C are the leading ones, and the prefix rule needs no cut-off
(tests/test_whatif.py checks this against the per-capacity simulator). Nor does pinning change anything:
LRU evicts the request's own blocks last anyway, and keeping the first C of them is the stack's top C.
"""

from __future__ import annotations

import numpy as np

from .trace import Trace

NEVER = np.iinfo(np.int64).max  # the distance of a block's first use: a miss at any capacity


def reuse_distances(trace: Trace) -> np.ndarray:
    """Per lookup (in trace.keys order), the block's LRU rank when its request starts: how many distinct
    blocks were used since its previous use; NEVER for a first use."""
    n, seq = trace.lookups, trace.touch_order
    keys = np.empty(n, np.int64)
    keys[seq] = trace.keys
    order = np.argsort(keys, kind="stable")  # places grouped by key, in time order
    prev = np.full(n, -1, np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    at = np.nonzero(prev >= 0)[0]
    dist = np.full(n, NEVER, np.int64)
    # distinct blocks touched in (p, i) = #{m < i: prev[m] < p} - (p + 1), as every m <= p has prev[m] < p
    dist[at] = count_before(prev, at, prev[at]) - prev[at] - 1
    dist = dist[seq]
    # at the request's start rather than at the touch: the request's deeper blocks, touched just before,
    # were each last used before this one (no request uses a block without its prefix)
    seen = dist != NEVER
    dist[seen] -= (seq - trace.offsets[trace.request_of])[seen]
    return dist


def count_before(values: np.ndarray, at: np.ndarray, below: np.ndarray) -> np.ndarray:
    """For each query q: #{m < at[q]: values[m] < below[q]}, offline in O(n log^2 n) array work. [0, at)
    splits into one aligned run of 2^L places for each bit L set in at; at each level the values are
    sorted within runs, so a run's count is one searchsorted."""
    n = len(values)
    span = int(max(values.max(initial=0), below.max(initial=0))) + 2
    shifted, limit = values + 1, below + 1  # >= 0, so (run, value) packs into one sortable int64
    out = np.zeros(len(at), np.int64)
    level = 0
    while (1 << level) < n:
        run = at >> level
        ask = np.nonzero(run & 1)[0]
        packed = np.sort((np.arange(n) >> level) * span + shifted)
        before = run[ask] - 1
        out[ask] += np.searchsorted(packed, before * span + limit[ask]) - (before << level)
        level += 1
    return out


def lru_hits(distances: np.ndarray, capacities: np.ndarray) -> np.ndarray:
    """Blocks served at each capacity: lookups whose distance is below it."""
    return np.searchsorted(np.sort(distances), np.asarray(capacities, np.int64))
