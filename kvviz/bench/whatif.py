"""`python -m kvviz bench --whatif`: how fast a request trace is replayed under other caches, on real
traffic (the Mooncake traces, default: ../shared/traces/*.jsonl beside the repository). Per trace: the
read, LRU's whole curve from reuse distances, and each policy's exact replay at the same capacities; the
peer of the one-pass LRU curve is LRU replayed exactly at every capacity, so its ratio is what the
reuse distances buy."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..whatif import POLICIES, capacity_grid, curve, read_mooncake
from ..whatif.curves import request_hits

SHARED_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


@dataclass(frozen=True, kw_only=True)
class WhatifTiming:
    trace: str
    requests: int
    lookups: int
    points: int
    read_s: float
    seconds: dict[str, float]  # "lru (one pass)", then each policy's per-capacity replays


def default_traces() -> list[Path]:
    return sorted(SHARED_TRACES.glob("*.jsonl"))


def run_whatif_bench(paths: Sequence[Path], points: int = 20,
                     progress: Callable[[str], None] | None = None) -> list[WhatifTiming]:
    out = []
    for path in paths:
        start = time.perf_counter()
        trace = read_mooncake(path)
        read_s = time.perf_counter() - start
        caps = capacity_grid(trace.distinct_blocks, points)
        seconds = {}
        start = time.perf_counter()
        curve(trace, ["lru"], caps)
        seconds["lru (one pass)"] = time.perf_counter() - start
        for policy in POLICIES:
            if progress:
                progress(f"{path.name}: {policy} at {len(caps)} capacities")
            start = time.perf_counter()
            for c in caps[:-1]:  # the unbounded point needs no replay
                request_hits(trace, policy, c) if policy != "lru" else _exact_lru(trace, c)
            seconds[policy] = time.perf_counter() - start
        out.append(WhatifTiming(trace=path.name, requests=trace.requests, lookups=trace.lookups, points=len(caps),
                                read_s=read_s, seconds=seconds))
    return out


def _exact_lru(trace, capacity: int) -> None:
    from ..whatif.simulate import replay

    replay(trace, "lru", capacity)


def whatif_report(results: Sequence[WhatifTiming]) -> str:
    names = list(results[0].seconds) if results else []
    lines = ["| trace | requests | block lookups | capacities | read (s) | " + " | ".join(f"{n} (s)" for n in names)
             + " | exact LRU / one pass |", "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in names)
             + " | ---: |"]
    for r in results:
        ratio = r.seconds["lru"] / r.seconds["lru (one pass)"]
        lines.append(f"| {r.trace} | {r.requests:,} | {r.lookups:,} | {r.points} | {r.read_s:.2f} | "
                     + " | ".join(f"{r.seconds[n]:.2f}" for n in names) + f" | {ratio:.0f}x |")
    return "\n".join(lines) + "\n"
