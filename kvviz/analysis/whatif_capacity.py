"""A run's own cache size, where the What if curve marks it: known for an engine run (its pool, num_blocks);
for a capture, which KV events never state (a Mooncake trace neither), a lower bound from its events: the
most blocks a replica held at once on one medium (stores that cached a block minus removals, summed over
its KV groups, from nothing again at a clear or a restart). The cache was at least that large; how much
larger the events cannot tell (a cache that never filled removes nothing)."""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from .runs import RunInfo

DEVICE = "GPU"  # the medium the What if replay caches (coalesce(medium, 'GPU'), as its traces are read)

# per replica and medium, the most blocks held at once: kv_cache_occupancy counts per KV group (and per
# medium as published), so each count's changes are summed across them in step order, per restart
HELD_SQL = """
WITH changes AS (
    SELECT replica, coalesce(medium, 'GPU') AS medium, restart, step,
           cached_blocks - coalesce(lag(cached_blocks) OVER (PARTITION BY replica, medium, group_idx, restart
                                                             ORDER BY step), 0) AS change
    FROM kv_cache_occupancy WHERE run_id = ?),
held AS (
    SELECT replica, medium, sum(sum(change)) OVER (PARTITION BY replica, medium, restart ORDER BY step) AS held
    FROM changes GROUP BY replica, medium, restart, step)
SELECT replica, medium, max(held) FROM held GROUP BY ALL ORDER BY replica, medium
"""


@dataclass(frozen=True)
class OwnCapacity:
    """The run's own cache per replica, in blocks: known, or at least `blocks` (inferred from the events);
    held: per (replica, medium), the most blocks held at once, where inferred."""

    blocks: int
    known: bool
    held: tuple[tuple[str, str, int], ...] = ()

    @property
    def label(self) -> str:
        """What the figure calls its mark."""
        return "this run's cache" if self.known else f"at least {self.blocks:,} blocks held at once"

    @property
    def where(self) -> str:
        """The one replica that held the most, for an inferred bound's sentence ('' when known, or when one
        replica or several held it)."""
        most = [r for r, m, n in self.held if m == DEVICE and n == self.blocks]
        return most[0] if len(most) == 1 and len([m for _, m, _ in self.held if m == DEVICE]) > 1 else ""


def own_capacity(con: duckdb.DuckDBPyConnection, info: RunInfo) -> OwnCapacity | None:
    """The run's own cache: an engine run's pool; a capture's lower bound (its replicas' device medium,
    the largest of them, as the replay gives every replica one capacity); None where nothing is held."""
    if not info.has_kv_events:
        blocks = int(info.engine.get("num_blocks", 0))
        return OwnCapacity(blocks, known=True) if blocks else None
    held = tuple((str(r), str(m), int(n)) for r, m, n in con.execute(HELD_SQL, [info.run_id]).fetchall())
    device = [n for _, m, n in held if m == DEVICE]
    return OwnCapacity(max(device), known=False, held=held) if device and max(device) > 0 else None
