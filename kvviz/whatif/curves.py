"""Hit rate against capacity for each policy: LRU from one pass of reuse distances, the others by one
exact replay per capacity; at the unbounded capacity (every distinct block) nothing is ever evicted, so
every policy serves every block seen before and no replay is needed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..errors import KvvizError
from .lru import lru_hits, reuse_distances
from .policies import check_policy
from .records import CurvePoint
from .simulate import replay
from .trace import Trace

Progress = Callable[[str, int, int], None]  # (policy, capacities done, capacities in all)


def check_capacities(capacities: Sequence[int]) -> list[int]:
    """The capacities as ints, or a refusal naming the first below one block."""
    if (bad := next((c for c in capacities if c < 1), None)) is not None:
        raise KvvizError(f"capacity must be at least 1 block, got {bad}")
    return [int(c) for c in capacities]


def request_hits(trace: Trace, policy: str, capacity: int) -> np.ndarray:
    """Blocks served from cache per request, under `policy` with room for `capacity` blocks."""
    check_capacities([capacity])
    if check_policy(policy) != "lru" and capacity < trace.distinct_blocks:
        return replay(trace, policy, capacity)
    served = _seen(trace) if capacity >= trace.distinct_blocks else reuse_distances(trace) < capacity
    return np.bincount(trace.request_of, served, trace.requests).astype(np.int64)


def curve(trace: Trace, policies: Sequence[str], capacities: Sequence[int], *, keying: str = "shared",
          progress: Progress | None = None) -> list[CurvePoint]:
    """One CurvePoint per (policy, capacity), policies in the order given."""
    for p in policies:
        check_policy(p)
    caps = check_capacities(capacities)
    distances = reuse_distances(trace) if "lru" in policies else None
    points = []
    for p in policies:
        if p == "lru":
            hits = lru_hits(distances, caps).tolist()
        else:
            hits = []
            for done, c in enumerate(caps):
                hits.append(int(request_hits(trace, p, c).sum()))
                if progress:
                    progress(p, done + 1, len(caps))
        points += [_point(trace, p, c, h, keying) for c, h in zip(caps, hits, strict=True)]
    return points


def _point(trace: Trace, policy: str, capacity: int, hits: int, keying: str = "shared") -> CurvePoint:
    saved = int(hits) * trace.block_size
    return CurvePoint(policy=policy, keying=keying, capacity=capacity, hits=int(hits), lookups=trace.lookups,
                      tokens_saved=saved, prompt_tokens=trace.prompt_tokens,
                      hit_rate=saved / trace.prompt_tokens if trace.prompt_tokens else 0.0)


def _seen(trace: Trace) -> np.ndarray:
    """Per lookup, whether its block was used by an earlier request: a hit in an unbounded cache."""
    first = np.zeros(trace.lookups, bool)
    first[np.unique(trace.keys, return_index=True)[1]] = True
    return ~first
