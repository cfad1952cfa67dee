"""What a capture's block-event rows (rows.py) measure, defined once for the two readers that report
it: the capture views (analysis/capture_time.py, over a run's kv_events) and the live monitor
(monitor/, over each slice of rows as they arrive). Each definition is a SQL fragment over the row
columns, so both readers aggregate the same expression; a ratio is made from the sums in Python.

A hit is a store of a block already cached on its replica, KV group and medium (`repeat`: vLLM
re-reports reused blocks under kv_cache_report_mode="full"); its tokens were served by the cache. A
new block's tokens were computed: the cache had nothing for them. The hit rate is the share of a
store's tokens that were hits, weighted by block size, so replicas with other block sizes compare.
"""

from __future__ import annotations

# Tokens of stores that repeated a cached block (hits) and of stores of new blocks (misses).
HIT_TOKENS = "coalesce(sum(block_size) FILTER (kind = 'BlockStored' AND repeat), 0)"
MISS_TOKENS = "coalesce(sum(block_size) FILTER (kind = 'BlockStored' AND NOT coalesce(repeat, false)), 0)"
# A stored segment (an event's first new block continuing a cached chain) whose event names no salt,
# in a chain that has one: the chain's tenant is known, the tenant that stored the segment is not.
UNTOLD_SEGMENT = ("kind = 'BlockStored' AND NOT coalesce(repeat, false) AND block_index = 0 "
                  "AND parent_hash IS NOT NULL AND salt_named = false")


def hit_ratio(hit_tokens: float, miss_tokens: float) -> float | None:
    """The share of stored tokens the cache served; None when nothing was stored (no 0 is claimed)."""
    total = hit_tokens + miss_tokens
    return hit_tokens / total if total else None
