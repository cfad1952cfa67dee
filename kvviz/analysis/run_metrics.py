"""The metrics the seed says to watch in production (section 6.3: leak rate, cache hit rate, block
utilisation), kept up to date step by step as a run goes, each with a threshold that raises an alert.

hit rate: prompt tokens the prefix cache served over the tokens looked up, at every admission so far
(vLLM's prefix-cache hits over queries). block utilisation: blocks held by requests over the pool
(vLLM's KV-cache usage; near 1 the scheduler preempts). slot utilisation: the share of held slots
that hold a token (low means fragmentation). leak rate: queries whose foreign and stale attention
mass passed the oracle's threshold over every query judged so far; foreign mass: the largest seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..engine import StepRecord
from ..oracle import ProvenanceOracle


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    help: str
    alert_when: Literal["above", "below"]
    default_limit: float  # what a new Run page starts with

    def crossed(self, value: float | None, limit: float) -> bool:
        if value is None:
            return False
        return value > limit if self.alert_when == "above" else value < limit


METRICS = {m.key: m for m in (
    Metric("hit_rate", "prefix-cache hit rate", "prompt tokens the prefix cache served, of those looked up at "
           "admission, as the engine counted them for its replies' cached tokens (a fork shares its parent's blocks "
           "without a lookup: not counted; where the counts are wrong, the oracle's telemetry_mismatch findings say "
           "so). The default threshold 0 never alerts; raise it to be told when sharing stops", "below", 0.0),
    Metric("block_utilisation", "block utilisation", "blocks held by requests, of the pool (near 1: preemption)",
           "above", 0.95),
    Metric("slot_utilisation", "slot utilisation", "held KV slots that hold a token (low: fragmentation)", "below",
           0.8),
    Metric("leak_rate", "leak rate", "query rows (per layer and head) whose foreign + stale attention passed the "
           "oracle's threshold, of every row judged so far; the inspector's Leaks view shows it per step",
           "above", 0.0),
    Metric("max_foreign", "max foreign mass", "the largest share of one query's attention on keys not its own",
           "above", 0.001),
)}


@dataclass
class LiveMetrics:
    """Running totals over the steps seen so far; `values()` gives every metric now."""

    looked_up: int = 0
    served: int = 0
    used_blocks: int = 0
    num_blocks: int = 0
    live_slots: int = 0
    allocated_slots: int = 0
    leak_rows: float = 0.0
    judged_rows: int = 0
    max_foreign: float = 0.0
    keep_history: bool = True  # a server that runs for days keeps only the totals
    history: dict[str, list[float | None]] = field(default_factory=lambda: {k: [] for k in METRICS})

    def update(self, rec: StepRecord, oracle: ProvenanceOracle | None = None) -> None:
        snap = rec.snapshot
        for lookup in rec.lookups.values():
            self.looked_up, self.served = self.looked_up + lookup.tokens, self.served + lookup.hit_tokens
        self.used_blocks = sum(1 for r in snap.refcounts if r > 0)
        # the blocks requests can hold: every one is held or free, but transformers' reserved trash blocks
        # (last in its snapshot) are neither, and counted they read as held
        self.num_blocks = self.used_blocks + len(snap.free_queue)
        self.live_slots, self.allocated_slots = snap.live_slots(), self.used_blocks * snap.block_size
        if oracle is not None and oracle.steps and oracle.steps[-1].step == rec.step:
            s = oracle.steps[-1]
            _, layers, heads = s.leak_rows.shape
            self.leak_rows += float(s.leak_rows.sum())
            self.judged_rows += sum(s.rows) * layers * heads
            self.max_foreign = max(self.max_foreign, float(s.max_foreign.max()))
        if self.keep_history:
            for k, v in self.values().items():
                self.history[k].append(v)

    def values(self) -> dict[str, float | None]:
        return {"hit_rate": self.served / self.looked_up if self.looked_up else None,
                "block_utilisation": self.used_blocks / self.num_blocks if self.num_blocks else None,
                "slot_utilisation": self.live_slots / self.allocated_slots if self.allocated_slots else None,
                "leak_rate": self.leak_rows / self.judged_rows if self.judged_rows else None,
                "max_foreign": self.max_foreign if self.judged_rows else None}
