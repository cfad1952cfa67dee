"""An imported vLLM/SGLang KV-event capture: the prefix tree and the cache over time."""

from __future__ import annotations

import duckdb
import pandas as pd


def prefix_tree(con: duckdb.DuckDBPyConnection, run_id: str, max_nodes: int = 3000) -> pd.DataFrame:
    """One row per stored block hash: its parent, depth in its chain, its salts (more than one: shared
    across tenants), LoRA, when it was first
    stored and when it left the cache for good (its BlockRemoved or an AllBlocksCleared at or after
    its last store; null while it is still cached at the end), and its tokens; the first `max_nodes` stored."""
    return con.execute(
        "WITH ev AS (SELECT step, kind, block_hash, parent_hash, salt, lora_name, token_ids FROM kv_events "
        "WHERE run_id = ?), "
        "stored AS (SELECT block_hash, any_value(parent_hash) AS parent_hash, min(step) AS stored_step, "
        "max(step) AS last_stored, string_agg(DISTINCT coalesce(salt, '(no salt)'), ', ' ORDER BY "
        "coalesce(salt, '(no salt)')) AS salt, count(DISTINCT coalesce(salt, '')) AS salts, "
        "any_value(lora_name) AS lora_name, "
        "any_value(token_ids) AS token_ids FROM ev WHERE kind = 'BlockStored' GROUP BY block_hash), "
        "removed AS (SELECT s.block_hash, min(e.step) AS removed_step FROM stored s JOIN ev e ON e.kind = "
        "'BlockRemoved' AND e.block_hash = s.block_hash AND e.step >= s.last_stored GROUP BY s.block_hash), "
        "cleared AS (SELECT s.block_hash, min(e.step) AS cleared_step FROM stored s JOIN ev e "
        "ON e.kind = 'AllBlocksCleared' AND e.step >= s.last_stored GROUP BY s.block_hash) "
        "SELECT s.* EXCLUDE (last_stored), least(r.removed_step, c.cleared_step) AS removed_step FROM stored s "
        "LEFT JOIN removed r USING (block_hash) LEFT JOIN cleared c USING (block_hash) "
        "ORDER BY stored_step, block_hash LIMIT ?", [run_id, max_nodes]).df()


def cache_over_time(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """step, cached_blocks, stored, removed (the kv_cache_blocks view)."""
    return con.execute("SELECT step, cached_blocks, stored, removed FROM kv_cache_blocks WHERE run_id = ? "
                       "ORDER BY step", [run_id]).df()
