"""A capture on its time axis (the publisher's clock): what happened in a time range, in intervals
of a width a chart can draw (at most MAX_INTERVALS of them), so every view is an aggregate in
DuckDB and the browser gets hundreds of points whatever the capture's length.

Churn (new blocks, hits, evictions), hit and miss tokens, occupancy split by replica, tier or tenant,
and the distributions of block lifetimes, idle time before eviction and reuse gaps (measured per
block at import: rows.py), and the prefixes most reused."""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pandas as pd

from ..capture.measures import HIT_TOKENS, MISS_TOKENS, UNTOLD_SEGMENT
from ..capture.measures import hit_ratio as hit_ratio  # the views' hit rate from churn's sums, as the monitor's
from ..capture.tenants import NO_SALT, SALT_LABEL, TENANT, TOLD

MAX_INTERVALS = 300
BINS_PER_DECADE = 10  # duration histograms: durations span milliseconds to hours, so bins are logarithmic
NICE_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800,
          3600, 7200, 10800, 21600, 43200, 86400)
UNTOLD = "'s chain, own tenant unknown"  # after the salt of a block whose store event named none
SPLITS = {"replica": "coalesce(replica, 'replica-0')", "tier": "coalesce(medium, '(no medium)')",
          "tenant": "CASE WHEN NOT coalesce(named, true) AND salt IS NOT NULL THEN salt || $untold "
                    "ELSE coalesce(salt, '(no salt)') END"}
_NEW = "NOT coalesce(repeat, false)"
# kv_events with `named`: whether the store that cached the block (a removal's: the last before it on
# its replica, KV group and tier) named its salt. The import says it of each removal (salt_named); a
# capture imported before it did is looked up by an as-of join over every event (3-4 s at 10M events).
_LOOKED_UP_NAMED = (
    "(SELECT e.*, coalesce(e.salt_named, s.salt_named) AS named FROM kv_events e ASOF LEFT JOIN "
    "(SELECT coalesce(replica, 'replica-0') AS r, coalesce(group_idx, -1) AS g, coalesce(medium, '') AS m, "
    "block_hash AS h, step AS s_step, salt_named FROM kv_events WHERE run_id = $run AND kind = 'BlockStored' "
    f"AND {_NEW}) s "
    "ON s.r = coalesce(e.replica, 'replica-0') AND s.g = coalesce(e.group_idx, -1) AND s.m = coalesce(e.medium, '') "
    "AND s.h = e.block_hash AND s.s_step <= e.step WHERE e.run_id = $run)")
_SAID_NAMED = "(SELECT *, coalesce(salt_named, true) AS named FROM kv_events WHERE run_id = $run)"


def _named_source(con: duckdb.DuckDBPyConnection, run_id: str) -> str:
    """kv_events with `named`: as the import said it, unless some store named no salt and the capture
    was imported before removals said whether theirs did."""
    looked_up = con.execute(
        "SELECT EXISTS (SELECT 1 FROM kv_events WHERE run_id = $run AND kind = 'BlockStored' AND salt_named = false "
        f"AND {_NEW}) AND EXISTS (SELECT 1 FROM kv_events WHERE run_id = $run AND kind = 'BlockRemoved' "
        f"AND {_NEW} AND salt_named IS NULL)", {"run": run_id}).fetchone()[0]
    return _LOOKED_UP_NAMED if looked_up else _SAID_NAMED


@dataclass(frozen=True)
class Span:
    """The capture's first and last publisher timestamps (seconds since the epoch)."""
    start: float
    end: float


def span(con: duckdb.DuckDBPyConnection, run_id: str) -> Span | None:
    lo, hi = con.execute("SELECT min(ts), max(ts) FROM kv_events WHERE run_id = ?", [run_id]).fetchone()
    return None if lo is None else Span(float(lo), float(hi))


def interval_s(start: float, end: float, most: int = MAX_INTERVALS) -> float:
    """The narrowest round width that cuts [start, end] into at most `most` intervals."""
    need = (end - start) / most
    return next((w for w in NICE_S if w >= need), float(np.ceil(need / 86400) * 86400))


def churn(con: duckdb.DuckDBPyConnection, run_id: str, start: float, end: float, width: float) -> pd.DataFrame:
    """interval_start, replica, stored (new blocks), hits (stores of cached blocks), evicted, hit_tokens,
    miss_tokens (tokens of new blocks: computed because nothing cached them). Intervals begin at `start`
    (the capture's first event for the whole capture), not at multiples of `width` since the epoch."""
    return con.execute(
        f"SELECT $a + floor((ts - $a) / $w) * $w AS interval_start, coalesce(replica, 'replica-0') AS replica, "
        f"count(*) FILTER (kind = 'BlockStored' AND {_NEW}) AS stored, "
        "count(*) FILTER (kind = 'BlockStored' AND repeat) AS hits, "
        f"count(*) FILTER (kind = 'BlockRemoved' AND {_NEW}) AS evicted, "
        f"{HIT_TOKENS} AS hit_tokens, {MISS_TOKENS} AS miss_tokens "
        "FROM kv_events WHERE run_id = $run AND kind IN ('BlockStored', 'BlockRemoved') AND ts BETWEEN $a AND $b "
        "GROUP BY ALL ORDER BY interval_start, replica",
        {"run": run_id, "w": width, "a": start, "b": end}).df()


def occupancy(con: duckdb.DuckDBPyConnection, run_id: str, start: float, end: float, width: float,
              split: str) -> pd.DataFrame:
    """interval_start, series, cached: blocks cached at the end of each interval, per replica, tier or
    tenant (summed over replicas). Each replica's count goes back to zero at its AllBlocksCleared and
    at a publisher restart (each begins an epoch); the level at `start` counts everything before it.
    Intervals begin at `start`, as churn's do."""
    # intervals by number from `start`, so the last one is the one `end` falls in exactly (seconds added up
    # along a grid drift past it)
    args = {"run": run_id, "w": width, "a": start, "b": end}
    bucket = "greatest(floor((ts - $a) / $w), 0)"
    epochs = ("SELECT replica, restart, step, ts, row_number() OVER (PARTITION BY replica, restart ORDER BY step) "
              "AS epoch FROM (SELECT DISTINCT coalesce(replica, 'replica-0') AS replica, coalesce(restart, 0) AS "
              "restart, step, ts FROM kv_events WHERE run_id = $run AND kind = 'AllBlocksCleared' AND ts <= $b)")
    clears = con.execute(epochs, {"run": run_id, "b": end}).df()
    ev = (f"SELECT coalesce(replica, 'replica-0') AS replica, coalesce(restart, 0) AS restart, step, ts, "
          f"{SPLITS[split]} AS series, CASE WHEN kind = 'BlockStored' THEN 1 ELSE -1 END AS delta FROM "
          f"{_named_source(con, run_id) if split == 'tenant' else 'kv_events'} "
          f"WHERE run_id = $run AND kind IN ('BlockStored', 'BlockRemoved') AND {_NEW} AND ts <= $b")
    if clears.empty:  # the common case: no epoch to look up for every row
        changes = (f"SELECT replica, restart, 0 AS epoch, series, {bucket} AS t, sum(delta) AS delta FROM ({ev}) "
                   "GROUP BY ALL")
    else:
        changes = (f"SELECT e.replica, e.restart, coalesce(k.epoch, 0) AS epoch, e.series, "
                   f"{bucket.replace('ts', 'e.ts')} AS t, sum(e.delta) AS delta FROM ({ev}) e ASOF LEFT JOIN "
                   f"({epochs}) k ON e.replica = k.replica AND e.restart = k.restart AND k.step <= e.step GROUP BY ALL")
    levels = con.execute(
        f"SELECT replica, restart, epoch, series, t, sum(delta) OVER (PARTITION BY replica, restart, epoch, series "
        f"ORDER BY t) AS cached FROM ({changes}) ORDER BY t, restart, epoch",
        args | ({"untold": UNTOLD} if split == "tenant" else {})).df()
    if levels.empty:
        return pd.DataFrame({"interval_start": [], "series": [], "cached": []})
    restarts = con.execute(  # where each replica's restarts begin (a new process caches nothing)
        f"SELECT coalesce(replica, 'replica-0') AS replica, restart, 0 AS epoch, {bucket.replace('ts', 'min(ts)')} "
        "AS t FROM kv_events WHERE run_id = $run AND restart > 0 AND ts <= $b GROUP BY ALL", args).df()
    first = levels.groupby("replica", as_index=False).t.min().assign(restart=0, epoch=0)
    begins = pd.concat([first, restarts, clears.assign(t=np.maximum(np.floor((clears.ts - start) / width), 0))
                        [["replica", "restart", "epoch", "t"]]], ignore_index=True)
    grid = np.arange(0, np.floor((end - start) / width) + 1)  # the intervals holding [start, end]
    out = []
    for replica, mine in levels.groupby("replica"):
        now = (begins[begins.replica == replica].sort_values(["t", "restart", "epoch"])
               .drop_duplicates("t", keep="last").set_index("t").reindex(grid, method="ffill"))
        for name, part in mine.groupby("series"):
            level = part.drop_duplicates("t", keep="last").set_index("t").reindex(grid, method="ffill")
            alive = (level.restart == now.restart) & (level.epoch == now.epoch)  # an older epoch is gone
            out.append(pd.DataFrame({"interval_start": start + grid * width, "series": name,
                                     "cached": level.cached.where(alive, 0).fillna(0).to_numpy()}))
    return (pd.concat(out).groupby(["interval_start", "series"], as_index=False).cached.sum()
            .sort_values(["interval_start", "series"], ignore_index=True))


def distributions(con: duckdb.DuckDBPyConnection, run_id: str, start: float, end: float) -> pd.DataFrame:
    """measure (lifetime | idle before eviction | reuse gap), seconds (a bin's lower edge: BINS_PER_DECADE
    to a power of ten), count: evictions (the first two) or hits (the last) in the range. Zero
    durations (same-timestamp batches) fall in the lowest bin, 1 ms."""
    return con.execute(
        "SELECT m.measure, power(10, floor(log10(greatest(m.seconds, 0.001)) * $k) / $k) AS seconds, "
        "count(*) AS count FROM kv_events, LATERAL (VALUES ('lifetime', lifetime_s), "
        "('idle before eviction', idle_s), ('reuse gap', reuse_gap_s)) AS m(measure, seconds) "
        "WHERE run_id = $run AND ts BETWEEN $a AND $b AND m.seconds IS NOT NULL GROUP BY ALL ORDER BY ALL",
        {"run": run_id, "a": start, "b": end, "k": BINS_PER_DECADE}).df()


def shared_prefixes(con: duckdb.DuckDBPyConnection, run_id: str, start: float, end: float,
                    top: int = 20) -> pd.DataFrame:
    """The blocks most reused in the range: replica, group_idx, block_hash, uses (stores and hits), hits,
    first_ts, tenants (distinct salts the stores' and hits' own events name), salts (those, and the salts
    only inferred from a chain marked so), sessions; most hits first. Counted in one pass, the tenants
    and sessions of the chosen few in a second (a distinct count over every block of ten million events
    would be the slow part)."""
    return con.execute(
        "WITH ev AS (SELECT coalesce(replica, 'replica-0') AS replica, group_idx, block_hash, repeat, ts, "
        f"{TENANT} AS tenant, {SALT_LABEL} AS salt, session_id FROM kv_events WHERE run_id = $run AND "
        "kind = 'BlockStored' AND ts BETWEEN $a AND $b), "
        "top AS (SELECT replica, group_idx, block_hash, count(*) AS uses, count(*) FILTER (repeat) AS hits, "
        "min(ts) AS first_ts FROM ev GROUP BY ALL HAVING count(*) > 1 ORDER BY hits DESC, uses DESC, block_hash "
        "LIMIT $top) "
        "SELECT t.replica, t.group_idx, t.block_hash, t.uses, t.hits, count(DISTINCT e.tenant) AS tenants, "
        "string_agg(DISTINCT e.salt, ', ' ORDER BY e.salt) AS salts, count(DISTINCT e.session_id) AS sessions, "
        "t.first_ts FROM top t JOIN ev e ON e.replica = t.replica AND e.block_hash = t.block_hash AND "
        "e.group_idx IS NOT DISTINCT FROM t.group_idx GROUP BY ALL ORDER BY t.hits DESC, t.uses DESC, t.block_hash",
        {"run": run_id, "a": start, "b": end, "top": top}).df()


@dataclass(frozen=True)
class SharedBlocks:
    """Blocks of a range stored or hit under more than one salt (a store without one names no tenant: the
    linter's salt_mixed and cross_tier_salt speak of those): `named`, shared by two tenants the
    stream itself names (what a cross_tenant finding needs); `inferred`, the more that look shared only
    through a salt the import inferred from the chain a store continues (its own tenant unknown); and
    `events`, each store and hit of the most used of those drawn: replica, block_hash, ts, salt (the
    tenant named, else UNKNOWN, or NO_SALT), chain (an inferred row's chain salt), told, repeat, uses."""
    named: int
    inferred: int
    events: pd.DataFrame


UNKNOWN = "tenant unknown"  # a store or hit of a shared block whose event names no salt


def cross_tenant(con: duckdb.DuckDBPyConnection, run_id: str, start: float, end: float, top: int = 40,
                 inferred: bool = False) -> SharedBlocks:
    """The blocks of the range used under more than one salt (one cache entry serving two tenants), named
    and inferred apart, and the stores and hits of the `top` most used of the named ones (with
    `inferred`, of both). Two salts is a min that differs from the max: no distinct count over every block."""
    shared = (
        f"WITH {TOLD}, ev AS (SELECT replica, grp, block_hash, ts, salt, tenant, repeat FROM stores "
        "WHERE ts BETWEEN $a AND $b), "
        "shared AS (SELECT replica, grp, block_hash, count(*) AS uses, "
        "coalesce(min(tenant) <> max(tenant), false) AS named FROM ev GROUP BY ALL "
        "HAVING min(salt) <> max(salt)) ")  # a store without a salt names no tenant
    args = {"run": run_id, "a": start, "b": end}
    named, guessed = con.execute(shared + "SELECT count(*) FILTER (named), count(*) FILTER (NOT named) FROM shared",
                                 args).fetchone()
    events = con.execute(
        shared + "SELECT e.replica, e.block_hash, e.ts, CASE WHEN e.tenant IS NOT NULL THEN e.tenant WHEN e.salt IS "
        "NULL THEN $none ELSE $unknown END AS salt, CASE WHEN e.tenant IS NULL THEN e.salt END AS chain, "
        "e.tenant IS NOT NULL AS told, e.repeat, s.uses FROM ev e JOIN "
        "(SELECT * FROM shared WHERE named OR $inferred ORDER BY uses DESC, block_hash LIMIT $top) s "
        "USING (replica, grp, block_hash) ORDER BY s.uses DESC, e.block_hash, e.ts",
        {**args, "top": top, "unknown": UNKNOWN, "none": NO_SALT, "inferred": inferred}).df()
    return SharedBlocks(int(named), int(guessed), events)


def untold_restores(con: duckdb.DuckDBPyConnection, run_id: str, start: float, end: float) -> int:
    """Stores in the range of a block stored before on its replica and KV group (a later life), by an
    event that names no salt, in a capture that names tenants: vLLM names the salt in a chain's first
    block only, so the capture cannot tell which tenant stored them, and on a server that leaves the
    salt out of its hashes another tenant may have (the import gives them the chain's salt). Captures
    imported before kvviz kept `salt_named` count none."""
    return int(con.execute(
        "WITH st AS (SELECT coalesce(replica, 'replica-0') AS r, group_idx AS g, block_hash AS h, step, ts, salt_named "
        "FROM kv_events WHERE run_id = $run AND kind = 'BlockStored' AND NOT coalesce(repeat, false)), "
        "lives AS (SELECT r, g, h, min(step) AS first FROM st GROUP BY ALL HAVING count(*) > 1) "
        "SELECT count(*) FROM st JOIN lives l ON st.r = l.r AND st.g IS NOT DISTINCT FROM l.g AND st.h = l.h "
        "WHERE st.step > l.first AND st.salt_named = false AND st.ts BETWEEN $a AND $b "
        "AND EXISTS (SELECT 1 FROM kv_events WHERE run_id = $run AND salt IS NOT NULL)",
        {"run": run_id, "a": start, "b": end}).fetchone()[0])


def untold_segments(con: duckdb.DuckDBPyConnection, run_id: str, start: float, end: float) -> dict[str, int]:
    """Stored segments in the range (an event's new blocks continuing a cached chain) whose event names
    no salt, per tenant of the chain they continue, in a capture that names tenants: the capture cannot
    tell which tenant stored them (explain says so of each: continues_chain_of, tenant unknown)."""
    return dict(con.execute(
        "SELECT coalesce(salt, '(no salt)') AS chain, count(*) FROM kv_events WHERE run_id = $run AND "
        f"{UNTOLD_SEGMENT} AND ts BETWEEN $a AND $b "
        "AND EXISTS (SELECT 1 FROM kv_events WHERE run_id = $run AND salt IS NOT NULL) GROUP BY chain ORDER BY chain",
        {"run": run_id, "a": start, "b": end}).fetchall())


def chain(con: duckdb.DuckDBPyConnection, run_id: str, replica: str, block_hash: int,
          group: int | None = None) -> pd.DataFrame:
    """A block and its ancestors, root first: depth, block_hash, salt, token_ids (from each block's
    first store on the replica and KV group)."""
    df = con.execute(
        "WITH RECURSIVE blocks AS (SELECT block_hash, any_value(parent_hash) AS parent_hash, "
        "any_value(salt) AS salt, any_value(token_ids) AS token_ids FROM kv_events WHERE run_id = $run AND "
        "kind = 'BlockStored' AND coalesce(replica, 'replica-0') = $replica AND group_idx IS NOT DISTINCT FROM $group "
        "AND NOT coalesce(repeat, false) GROUP BY block_hash), "
        "up(n, block_hash, parent_hash, salt, token_ids) AS (SELECT 0, * FROM blocks WHERE block_hash = $hash "
        "UNION ALL SELECT n + 1, b.* FROM up JOIN blocks b ON b.block_hash = up.parent_hash WHERE n < 4096) "
        "SELECT n, block_hash, salt, token_ids FROM up ORDER BY n DESC",
        {"run": run_id, "replica": replica, "group": group, "hash": block_hash}).df()
    return df.assign(depth=range(len(df)))[["depth", "block_hash", "salt", "token_ids"]]


def measured(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """Were lifetimes and removed blocks' tenants kept (imported by kvviz 6 or later, or nothing removed)?"""
    removals, measured_ = con.execute(
        f"SELECT count(*) FILTER (kind = 'BlockRemoved' AND {_NEW}), count(lifetime_s) FROM kv_events "
        "WHERE run_id = ?", [run_id]).fetchone()
    return bool(measured_) or not removals


def reports_hits(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """Does the capture hold any hit (a repeated store of a cached block)? Without them (vLLM's default
    report mode) a capture cannot tell what was served from the cache."""
    return bool(con.execute("SELECT count(*) FILTER (repeat) FROM kv_events WHERE run_id = ? AND kind = 'BlockStored'",
                            [run_id]).fetchone()[0])


def steps_in(con: duckdb.DuckDBPyConnection, run_id: str, start: float, end: float) -> tuple[int, int]:
    """The first and last messages of a time range (-1 where none)."""
    lo, hi = con.execute("SELECT min(step) FILTER (ts >= $a), max(step) FILTER (ts <= $b) FROM kv_events "
                         "WHERE run_id = $run", {"run": run_id, "a": start, "b": end}).fetchone()
    return (-1 if lo is None else int(lo)), (-1 if hi is None else int(hi))
