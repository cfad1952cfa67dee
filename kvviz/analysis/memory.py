"""Memory utilisation, the seed's section 3.3: the share of allocated KV slots that hold live tokens,
for the paged pool as it ran and for a contiguous allocator replayed on the same arrivals and lengths.

The paged figure is the pool's own after each step (PoolSnapshot.live_slots, recorded in steps): a
block with a reference is allocated, and its live slots are the most positions any holder has computed
into it. The
contiguous replay gives each request one region of its maximum length (prompt + max_new_tokens) when
it arrives, first fit in the same number of slots; a request that finds no region waits, in arrival
order. Placed, a request advances as it did in the paged run, step by step; it frees its region when
it finishes. Fragmentation shows twice: slots reserved but not yet (or never) filled, and requests
waiting although enough slots are free in total.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import duckdb
import pandas as pd

ARTICLE = {"contiguous": 0.60, "paged": 0.90}  # the seed: "from about 60% to over 90%"


@dataclass(frozen=True)
class Usage:
    """The slots of one allocator after one step."""

    step: int
    live: int  # slots holding a token of a request still running
    allocated: int  # slots set aside for requests still running
    waiting: int | None = None  # requests that have arrived and hold no memory (the replay counts them)

    @property
    def utilisation(self) -> float | None:
        return self.live / self.allocated if self.allocated else None


def overall(usage: Iterable[Usage]) -> float | None:
    """Live over allocated slots summed over every step: each step weighs by what it held."""
    points = list(usage)
    allocated = sum(u.allocated for u in points)
    return sum(u.live for u in points) / allocated if allocated else None


@dataclass(frozen=True)
class RequestSpan:
    """What the contiguous replay needs of one request."""

    id: str
    arrival_step: int
    reserve: int  # slots a contiguous allocator sets aside up front: the longest the request may grow
    progress: tuple[int, ...]  # tokens it held after each step that took it further, in order


def spans(requests: Iterable[tuple[str, int, int]], work: Iterable[tuple[int, str, int]]) -> list[RequestSpan]:
    """Spans from (id, arrival step, reserve) and the run's work as (step, request, positions computed
    after the step), in step order. A step that only recomputes what a preemption dropped does not take
    the request further, so a contiguous allocator, which never preempts, skips it."""
    progress: dict[str, list[int]] = {}
    for _, req, end in work:
        seen = progress.setdefault(req, [])
        if not seen or end > seen[-1]:
            seen.append(end)
    return [RequestSpan(rid, arrival, reserve, tuple(progress.get(rid, ()))) for rid, arrival, reserve in requests]


class FirstFit:
    """A line of `capacity` slots handed out as contiguous regions, lowest free address first."""

    def __init__(self, capacity: int):
        self.holes: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # (start, length), sorted

    @property
    def free(self) -> int:
        return sum(n for _, n in self.holes)

    def place(self, size: int) -> int | None:
        for i, (start, n) in enumerate(self.holes):
            if n >= size:
                self.holes[i:i + 1] = [(start + size, n - size)] if n > size else []
                return start
        return None

    def release(self, start: int, size: int) -> None:
        """Give a region back, merged with the holes on either side."""
        holes = sorted([*self.holes, (start, size)])
        merged = [holes[0]]
        for s, n in holes[1:]:
            ps, pn = merged[-1]
            merged[-1:] = [(ps, pn + n)] if ps + pn == s else [(ps, pn), (s, n)]
        self.holes = merged


@dataclass
class ContiguousReplay:
    usage: list[Usage] = field(default_factory=list)
    fragmented_steps: int = 0  # steps the first waiting request waited with enough slots free in total
    refused: list[str] = field(default_factory=list)  # longer than the whole space: never placed


def contiguous_replay(requests: Sequence[RequestSpan], capacity: int) -> ContiguousReplay:
    """Replay the requests on a contiguous first-fit allocator of `capacity` slots (see the module)."""
    out, space = ContiguousReplay(), FirstFit(capacity)
    pending = deque(sorted((r for r in requests if r.progress), key=lambda r: r.arrival_step))
    queue: deque[RequestSpan] = deque()
    placed: dict[str, tuple[RequestSpan, int, int]] = {}  # id -> (span, region start, steps done)
    step = 0
    while pending or queue or placed:
        while pending and pending[0].arrival_step <= step:
            arrived = pending.popleft()
            (out.refused.append(arrived.id) if arrived.reserve > capacity else queue.append(arrived))
        while queue:
            head = queue[0]
            at = space.place(head.reserve)
            if at is None:
                out.fragmented_steps += space.free >= head.reserve
                break
            placed[queue.popleft().id] = (head, at, 0)
        if not placed:  # nothing runs: idle until the next arrival, as the engine does
            if pending:
                step = max(step + 1, pending[0].arrival_step)
            continue
        live = allocated = 0
        for rid, (span, at, done) in list(placed.items()):
            if done + 1 == len(span.progress):  # its last step: freed after the step, like the engine's
                space.release(at, span.reserve)
                del placed[rid]
                continue
            placed[rid] = (span, at, done + 1)
            live, allocated = live + span.progress[done], allocated + span.reserve
        out.usage.append(Usage(step, live, allocated, len(queue)))
        step += 1
    return out


@dataclass(frozen=True)
class MemoryComparison:
    paged: list[Usage]
    contiguous: ContiguousReplay
    capacity: int  # slots in the pool, and in the contiguous space

    def frame(self) -> pd.DataFrame:
        """One row per (allocator, step): step, allocator, utilisation, live, allocated, waiting."""
        rows = [(u.step, name, u.utilisation, u.live, u.allocated, u.waiting)
                for name, usage in (("paged", self.paged), ("contiguous", self.contiguous.usage)) for u in usage]
        return pd.DataFrame(rows, columns=["step", "allocator", "utilisation", "live", "allocated", "waiting"])


def run_memory(con: duckdb.DuckDBPyConnection, run_id: str) -> MemoryComparison | None:
    """Both allocators for a recorded engine run; None for a run with no pool (an imported capture) or
    one recorded before kvviz counted live slots."""
    head = con.execute("SELECT engine, workload FROM runs WHERE run_id = ?", [run_id]).fetchone()
    paged = con.execute("SELECT step, live_slots, allocated_slots FROM kv_slot_utilisation WHERE run_id = ? "
                        "ORDER BY step", [run_id]).fetchall()
    if head is None or not paged or any(live is None for _, live, _ in paged):
        return None  # no pool, or steps recorded before kvviz counted live slots (schema 4)
    engine, workload = json.loads(head[0] or "{}"), json.loads(head[1] or "{}")
    max_new = {r.get("id"): r.get("max_new_tokens", 16) for r in workload.get("requests", [])}
    reqs = con.execute("SELECT request_id, arrival_step, len(prompt_ids) FROM requests WHERE run_id = ? "
                       "ORDER BY arrival_step, request_id", [run_id]).fetchall()
    work = con.execute("SELECT step, request_id, start + tokens FROM step_work WHERE run_id = ? "
                       "ORDER BY step, request_id", [run_id]).fetchall()
    arena = int(engine.get("num_blocks", 256)) * (2 if engine.get("disaggregated") else 1)  # both instances' pools
    capacity = arena * int(engine.get("block_size", 16))
    replay = contiguous_replay(spans(((r, a, n + max_new.get(r, 16)) for r, a, n in reqs), work), capacity)
    return MemoryComparison([Usage(s, live, alloc) for s, live, alloc in paged], replay, capacity)
