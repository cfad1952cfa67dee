"""An imported vLLM/SGLang KV-event capture: the prefix tree and the cache over time."""

from __future__ import annotations

import duckdb
import pandas as pd


def prefix_tree(con: duckdb.DuckDBPyConnection, run_id: str, max_nodes: int = 3000) -> pd.DataFrame:
    """One row per stored block hash: its parent, depth in its chain, salt, LoRA, when it was stored
    and (if) removed, and its tokens; the first `max_nodes` stored."""
    return con.execute(
        "WITH stored AS (SELECT block_hash, any_value(parent_hash) AS parent_hash, min(step) AS stored_step, "
        "any_value(salt) AS salt, any_value(lora_name) AS lora_name, any_value(token_ids) AS token_ids "
        "FROM kv_events WHERE run_id = ? AND kind = 'BlockStored' GROUP BY block_hash), "
        "removed AS (SELECT block_hash, min(step) AS removed_step FROM kv_events WHERE run_id = ? "
        "AND kind = 'BlockRemoved' GROUP BY block_hash) "
        "SELECT s.*, r.removed_step FROM stored s LEFT JOIN removed r USING (block_hash) "
        "ORDER BY stored_step, block_hash LIMIT ?", [run_id, run_id, max_nodes]).df()


def cache_over_time(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """step, cached_blocks, stored, removed (the kv_cache_blocks view)."""
    return con.execute("SELECT step, cached_blocks, stored, removed FROM kv_cache_blocks WHERE run_id = ? "
                       "ORDER BY step", [run_id]).df()
