"""The pool at a step and over time: block map, occupancy, page tables and one block's story."""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pandas as pd

from .tokens import label, slot_contents, token_texts

STATES = ("free", "cached", "used", "shared")  # occupancy codes 0..3; shared = used with refcount > 1


def block_map(con: duckdb.DuckDBPyConnection, run_id: str, step: int) -> pd.DataFrame:
    """One row per block: state, refcount, hash, lifetime and the requests whose page tables hold it."""
    return con.execute(
        "SELECT b.block, b.state, b.refcount, b.hash, b.lifetime, "
        "coalesce(string_agg(DISTINCT p.request_id, ',' ORDER BY p.request_id), '') AS owners "
        "FROM blocks b LEFT JOIN page_tables p ON p.run_id = b.run_id AND p.step = b.step "
        "AND p.physical_block = b.block WHERE b.run_id = ? AND b.step = ? "
        "GROUP BY ALL ORDER BY b.block", [run_id, step]).df()


def host_map(con: duckdb.DuckDBPyConnection, run_id: str, step: int) -> pd.DataFrame:
    """The host tier of an offloading run at a step, in block_map's columns (empty without one); a host
    block this step moved is in state offloaded (device content copied in), restored (copied back to
    the device) or dropped (lost its hash), in that order of precedence; `held` says whether it holds
    offloaded content after the step, moved or not."""
    return con.execute(
        "WITH moved AS (SELECT CASE kind WHEN 'host_evict' THEN block ELSE source END AS block, "
        "min(CASE kind WHEN 'offload' THEN 0 WHEN 'restore' THEN 1 ELSE 2 END) AS how FROM block_events "
        "WHERE run_id = ? AND step = ? AND kind IN ('offload', 'restore', 'host_evict') GROUP BY ALL) "
        "SELECT h.block, CASE m.how WHEN 0 THEN 'offloaded' WHEN 1 THEN 'restored' WHEN 2 THEN 'dropped' "
        "ELSE h.state END AS state, 0 AS refcount, h.hash, 0 AS lifetime, '' AS owners, h.state = 'cached' AS held "
        "FROM host_blocks h "
        "LEFT JOIN moved m USING (block) WHERE h.run_id = ? AND h.step = ? ORDER BY h.block",
        [run_id, step, run_id, step]).df()


def tier_moves(con: duckdb.DuckDBPyConnection, run_id: str, step: int) -> dict[str, int]:
    """How many blocks a step offloaded, restored and dropped from the host tier."""
    counts = dict(con.execute("SELECT kind, count(*) FROM block_events WHERE run_id = ? AND step = ? AND kind IN "
                              "('offload', 'restore', 'host_evict') GROUP BY kind", [run_id, step]).fetchall())
    return {k: int(counts.get(k, 0)) for k in ("offload", "restore", "host_evict")}


def transfers(con: duckdb.DuckDBPyConnection, run_id: str, step: int) -> pd.DataFrame:
    """Disaggregated prefill: the requests handed to the decode instance up to a step, what was sent from
    where to where, and whose K/V arrived (null in runs recorded before schema 8)."""
    return con.execute(
        "SELECT step, request_id, intact AS delivered, array_to_string(kv_of, ', ') AS written_by, "
        "array_to_string(from_blocks, ',') AS prefill_blocks, array_to_string(to_blocks, ',') AS decode_blocks, "
        "blocks, bytes, status FROM kv_transfers WHERE run_id = ? AND step <= ? ORDER BY step, request_id",
        [run_id, step]).df()


def leaky_blocks(con: duckdb.DuckDBPyConnection, run_id: str, step: int, block_size: int) -> set[int]:
    """Blocks holding keys that some query read at this step with a foreign or stale class."""
    rows = con.execute(
        "SELECT DISTINCT k.slot // ? FROM (SELECT unnest(key_slots) AS slot, unnest(key_classes) AS cls, "
        "unnest(weights) AS w FROM attention WHERE run_id = ? AND step = ? AND head = -1) k "
        "WHERE k.cls > 0 AND k.w > 0", [block_size, run_id, step]).fetchall()
    return {int(r[0]) for r in rows}


def cross_read_blocks(con: duckdb.DuckDBPyConnection, run_id: str, step: int) -> set[int]:
    """Blocks another tenant wrote that a request read at this step (its cross_tenant findings): the
    same content, so no attention figure shows them."""
    rows = con.execute("SELECT DISTINCT block FROM findings WHERE run_id = $run AND kind = 'cross_tenant' AND "
                       "block IS NOT NULL AND step <= $step AND coalesce(last_step, step) >= $step",
                       {"run": run_id, "step": step}).fetchall()
    return {int(r[0]) for r in rows}


def occupancy(con: duckdb.DuckDBPyConnection, run_id: str, max_steps: int = 400,
              max_blocks: int = 512) -> tuple[np.ndarray, list[int], int]:
    """[blocks, steps] state codes (see STATES), the steps shown and blocks per row: long runs are
    sampled evenly, big pools merge neighbouring blocks (the busiest state wins), and blocks never
    used past the last used one are left out."""
    steps = [r[0] for r in con.execute("SELECT DISTINCT step FROM blocks WHERE run_id = ? ORDER BY step",
                                       [run_id]).fetchall()]
    if len(steps) > max_steps:
        steps = [steps[i] for i in np.linspace(0, len(steps) - 1, max_steps).round().astype(int)]
    df = con.execute(
        "SELECT step, block, CASE WHEN state = 'used' AND refcount > 1 THEN 3 WHEN state = 'used' THEN 2 "
        "WHEN state = 'cached' THEN 1 ELSE 0 END AS code FROM blocks WHERE run_id = ? AND list_contains(?, step)",
        [run_id, steps]).df()
    if df.empty:
        return np.zeros((0, 0), np.int8), [], 1
    touched = df.block[df.code > 0]
    grid = np.zeros((int(touched.max() if len(touched) else 0) + 1, len(steps)), np.int8)
    df = df[df.block < len(grid)]
    col = {s: i for i, s in enumerate(steps)}
    grid[df.block.to_numpy(), df.step.map(col).to_numpy()] = df.code.to_numpy()
    per = -(-len(grid) // max_blocks)
    if per > 1:
        padded = np.zeros((-(-len(grid) // per) * per, grid.shape[1]), np.int8)
        padded[:len(grid)] = grid
        grid = padded.reshape(-1, per, grid.shape[1]).max(axis=1)
    return grid, steps, per


def page_tables(con: duckdb.DuckDBPyConnection, run_id: str, step: int) -> pd.DataFrame:
    """Page-table entries after the step, with each block's refcount and whether the request got it
    as a copy-on-write copy."""
    return con.execute(
        "SELECT p.request_id, p.logical_block, p.physical_block, b.refcount, b.refcount > 1 AS shared, "
        "EXISTS (SELECT 1 FROM block_events e WHERE e.run_id = p.run_id AND e.kind = 'cow' AND e.step <= p.step "
        "AND e.block = p.physical_block AND e.request_id = p.request_id) AS cow "
        "FROM page_tables p JOIN blocks b ON b.run_id = p.run_id AND b.step = p.step AND b.block = p.physical_block "
        "WHERE p.run_id = ? AND p.step = ? ORDER BY p.request_id, p.logical_block", [run_id, step]).df()


@dataclass
class BlockStory:
    """One block at a step: who references it, its hash chain, what its slots hold, what happened to it."""

    block: int
    state: str
    refcount: int
    hash: str | None
    references: pd.DataFrame  # request_id, logical_block
    chains: dict[str, list[str]]  # request -> hashes of its blocks 0..logical (the prefix this block ends)
    slots: pd.DataFrame  # slot, request_id, position, token, text
    events: pd.DataFrame  # step, kind, request_id, refcount, source


def block_story(con: duckdb.DuckDBPyConnection, run_id: str, step: int, block: int, block_size: int) -> BlockStory:
    row = con.execute("SELECT state, refcount, hash FROM blocks WHERE run_id = ? AND step = ? AND block = ?",
                      [run_id, step, block]).fetchone()
    if row is None:
        raise KeyError(f"block {block} is not in the pool at step {step}")
    refs = con.execute("SELECT request_id, logical_block FROM page_tables WHERE run_id = ? AND step = ? AND "
                       "physical_block = ? ORDER BY request_id", [run_id, step, block]).df()
    chains = {}
    for req, logical in refs.itertuples(index=False):
        chains[req] = [_hex(h) for (h,) in con.execute(
            "SELECT b.hash FROM page_tables p JOIN blocks b ON b.run_id = p.run_id AND b.step = p.step "
            "AND b.block = p.physical_block WHERE p.run_id = ? AND p.step = ? AND p.request_id = ? "
            "AND p.logical_block <= ? ORDER BY p.logical_block", [run_id, step, req, logical]).fetchall()]
    contents = slot_contents(con, run_id, step, block_size)
    slots = contents[(contents.slot >= block * block_size) & (contents.slot < (block + 1) * block_size)].copy()
    texts = token_texts(con, run_id)
    slots["text"] = [label(texts, t) for t in slots.token]
    events = con.execute("SELECT step, kind, request_id, refcount, source FROM block_events WHERE run_id = ? "
                         "AND block = ? AND step <= ? AND coalesce(medium, 'GPU') = 'GPU' ORDER BY step, seq",
                         [run_id, block, step]).df()
    return BlockStory(block, row[0], row[1], _hex(row[2]), refs, chains, slots.drop(columns="lifetime"), events)


def _hex(h: int | None) -> str | None:
    return None if h is None else f"{int(h):016x}"


def busiest_step(con: duckdb.DuckDBPyConnection, run_id: str) -> int | None:
    """The step after which the most blocks were in use (the first such), None without blocks."""
    row = con.execute("SELECT step FROM blocks WHERE run_id = ? GROUP BY step "
                      "ORDER BY count(*) FILTER (state = 'used') DESC, step LIMIT 1", [run_id]).fetchone()
    return None if row is None else int(row[0])
