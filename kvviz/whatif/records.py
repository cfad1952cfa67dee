"""What a what-if replay answers, as flat records: one row per point, built by keyword, so a list of
them becomes a pyarrow table (for DuckDB and SQL) or a list of dicts without a mapping in between."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass(frozen=True, kw_only=True)
class CurvePoint:
    """One policy at one capacity: the hit rate the issue asks for (prompt tokens served from cache over
    all prompt tokens), with the counts it comes from so rows can be summed and re-divided in SQL."""

    policy: str
    keying: str  # shared, tenant or conversation: how blocks were keyed (salted)
    capacity: int  # blocks; the trace's distinct blocks means unbounded
    hits: int  # full-block lookups served from cache
    lookups: int  # full-block lookups
    tokens_saved: int  # prefill tokens not computed: hits * block_size
    prompt_tokens: int
    hit_rate: float


@dataclass(frozen=True, kw_only=True)
class TenantCost:
    """What salting costs one tenant at one capacity: its hit rate with the cache shared by everyone and
    with blocks keyed per tenant (or per conversation, or as a capture keyed them), both replayed with the
    same policy and room."""

    tenant: int
    keying: str
    policy: str
    capacity: int
    prompt_tokens: int
    shared_tokens_saved: int  # the counts the rates divide, so that several caches' costs can be summed
    tokens_saved: int
    shared_hit_rate: float
    hit_rate: float
    loss: float  # shared_hit_rate - hit_rate


@dataclass(frozen=True, kw_only=True)
class CrossRead:
    """Reads one tenant would make of blocks another tenant's request computed, were the cache shared:
    what salting forbids, and why it costs hits."""

    reader: int
    writer: int
    capacity: int
    blocks: int
    tokens: int


Record = CurvePoint | TenantCost | CrossRead


def as_dicts(records: Sequence[Record]) -> list[dict]:
    return [asdict(r) for r in records]


def as_table(records: Sequence[Record]) -> pa.Table:
    """The records as one Arrow table (one column per field), ready for DuckDB or Parquet."""
    import pyarrow as pa

    return pa.Table.from_pylist(as_dicts(records))


def capacity_grid(distinct_blocks: int, points: int = 20, smallest: int = 4) -> list[int]:
    """Capacities from `smallest` blocks to the unbounded one (every distinct block), log-spaced, at least
    `points` of them where that many integers fit between."""
    top = max(distinct_blocks, 1)
    low = min(smallest, top)
    want, num = min(points, top - low + 1), points
    while len(grid := np.unique(np.rint(np.geomspace(low, top, num)).astype(np.int64))) < want:
        num *= 2
    return grid.tolist()
