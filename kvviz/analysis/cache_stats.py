"""A run's prefix cache in numbers, from the views every run and capture share: tokens looked up
and served per interval (hit_rate_per_interval) and each cached block's lives (block_lifetimes)."""

from __future__ import annotations

import duckdb
import pandas as pd


def hit_rates(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """interval_start, replica, unit, tokens, hit_tokens, hit_rate, oldest first."""
    return con.execute("SELECT interval_start, replica, unit, tokens, hit_tokens, hit_rate FROM hit_rate_per_interval "
                       "WHERE run_id = ? ORDER BY interval_start, replica", [run_id]).df()


def lifetimes(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """block_hash, life, stored_step, removed_step, lifetime_steps, hits, idle_steps: one row per life."""
    return con.execute("SELECT block_hash, life, stored_step, removed_step, lifetime_steps, hits, idle_steps "
                       "FROM block_lifetimes WHERE run_id = ? ORDER BY stored_step, block_hash", [run_id]).df()
