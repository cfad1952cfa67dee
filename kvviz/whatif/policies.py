"""The eviction policies the replay offers, each as the priority it gives a block when a request touches
it: the cached block with the lowest priority, among those the admitted request does not hold, is
evicted first; a policy with `leaves_only = True` may evict only blocks no cached block extends (the
replay enforces it, simulate.py). Priorities are unique ints (ties broken by LRU order), so a heap entry
is live exactly when it equals the block's current priority.

Every policy here keeps the cache prefix-closed (checked on random traces), so no cached block is ever
stranded behind a missing prefix: `seed` because it evicts leaves only, the others because a block is
never colder than its child, as every request that touches a child touches its parent.
"""

from __future__ import annotations

import numpy as np

from ..errors import KvvizError
from .trace import Trace


class Lru:
    """Least recently used, in vLLM's free-queue order."""

    def __init__(self, trace: Trace, capacity: int):
        self.order = trace.touch_order.tolist()

    def priority(self, key: int, i: int) -> int:
        return self.order[i]

    def evicted(self, key: int, priority: int) -> None:
        pass


class Lfu:
    """Least frequently used: uses since the block was last stored (counts end with eviction), then LRU."""

    def __init__(self, trace: Trace, capacity: int):
        self.order, self.scale = trace.touch_order.tolist(), trace.lookups + 1
        self.uses = [0] * trace.distinct_blocks

    def priority(self, key: int, i: int) -> int:
        self.uses[key] += 1
        return self.uses[key] * self.scale + self.order[i]

    def evicted(self, key: int, priority: int) -> None:
        self.uses[key] = 0


class Seed:
    """The seed's advice (its section 6.3), read as a radix-tree cache (SGLang) would: refcount zero first,
    then least recently used, large blocks last, as they stand for long prefixes, dear to rebuild.
    Refcount zero: the admitted request's blocks are never evicted (a trace has no durations, so between
    lookups no other request holds a block), nor is a block with a cached child, which references it
    (`leaves_only`): evicting it would strand the child. Among those leaves, recency and size are weighed
    together as GreedyDual does: a touched block's priority is the clock plus its rebuild cost, the length
    in blocks of the prefix it ends (depth + 1), and the clock rises to each victim's priority, so the
    leaf ending a longer prefix stays longer, and any leaf untouched long enough goes, as with LRU."""

    leaves_only = True

    def __init__(self, trace: Trace, capacity: int):
        self.order, self.scale = trace.touch_order.tolist(), trace.lookups + 1
        self.cost = (trace.depth + 1).tolist()
        self.clock = 0

    def priority(self, key: int, i: int) -> int:
        return (self.clock + self.cost[i]) * self.scale + self.order[i]

    def evicted(self, key: int, priority: int) -> None:
        # a parent freed by its child's eviction keeps the priority of its last touch, which may lie below
        # the clock (its cost is a block less than the child's): the clock never goes back
        self.clock = max(self.clock, priority // self.scale)


class Newcomer:
    """kvviz's own: LRU, except that a block never seen before enters as if touched `capacity` block
    touches earlier (about one cache's length), so one-shot prompts flow through the cold end without
    pushing out prefixes that come back (an old conversation's next turn). Whether a block was seen is
    remembered after it is evicted (a flag per block hash, nothing of its KV), so a returning prefix
    re-enters at the hot end."""

    def __init__(self, trace: Trace, capacity: int):
        self.order, self.handicap = trace.touch_order.tolist(), capacity
        self.seen = bytearray(trace.distinct_blocks)
        self.scale = trace.lookups + 1

    def priority(self, key: int, i: int) -> int:
        now = self.order[i]
        first = not self.seen[key]
        self.seen[key] = 1
        return (now - self.handicap * first) * self.scale + now

    def evicted(self, key: int, priority: int) -> None:
        pass


class Belady:
    """Belady's MIN: evict the block whose next use is furthest away; blocks never used again go first,
    least recently touched first. A parent is next used no later than its child and ties go to the
    child, so MIN keeps the cache prefix-closed, and its hits are then the most any policy can have
    that, like every one here, stores each block a request brings (no bypass): an upper bound the
    tests check against the others on random traces rather than assume."""

    def __init__(self, trace: Trace, capacity: int):
        n = trace.lookups
        order = np.lexsort((np.arange(n), trace.keys))
        following = 2 * n - trace.touch_order  # never used again: after every real use, least recent first
        same = trace.keys[order[1:]] == trace.keys[order[:-1]]
        following[order[:-1][same]] = order[1:][same]
        self.rank = (-following).tolist()

    def priority(self, key: int, i: int) -> int:
        return self.rank[i]

    def evicted(self, key: int, priority: int) -> None:
        pass


Policy = Lru | Lfu | Seed | Newcomer | Belady
POLICIES: dict[str, type[Policy]] = {"lru": Lru, "lfu": Lfu, "seed": Seed, "newcomer": Newcomer, "belady": Belady}


def check_policy(name: str) -> str:
    """The name, or a refusal that lists the known ones."""
    if name not in POLICIES:
        raise KvvizError(f"policy {name!r} is not known (known: {', '.join(POLICIES)})")
    return name


def make_policy(name: str, trace: Trace, capacity: int) -> Policy:
    """The named policy, ready to replay `trace` with room for `capacity` blocks."""
    return POLICIES[check_policy(name)](trace, capacity)
