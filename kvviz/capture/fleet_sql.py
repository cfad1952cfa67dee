"""Fleet questions over a capture dataset, as SQL that runs unchanged in DuckDB, Spark SQL and Trino.

Each query in FLEET_VIEWS reads a table or view named `capture_events`: the dataset's columns
(rows.py, ROW_SCHEMA) with `replica` taken from the `replica=NAME` partition folder. The SQL keeps
to what the three engines share: CASE WHEN, COUNT/MIN/MAX/SUM, COALESCE, NULLIF, floor(), CAST and
a standard window frame; no FILTER clauses, `::` casts, GROUP BY ALL or list functions. Counts are
COUNT(CASE WHEN ... THEN 1 END), so they are BIGINT everywhere (DuckDB's SUM of integers is a
HUGEINT), and ratios divide DOUBLEs (Trino divides integers as integers).

Block hashes are unsigned 64-bit. DuckDB reads the Parquet UINT64 columns as UBIGINT, Spark as
DECIMAL(20,0), and Trino's Hive connector as BIGINT (declared so; a hash at or above 2^63 then
shows as negative). The queries only group, count and compare hashes, which gives the same groups
in every engine; only the printed value of a large hash differs in Trino.

DuckDB: `register_duckdb(con, "capture/")`. Spark (pyspark):

    df = spark.read.parquet("s3a://bucket/capture/")
    df.createOrReplaceTempView("capture_events")
    spark.sql(FLEET_VIEWS["hit_rate_per_interval"]).show()

`spark.read.parquet(path)` discovers `replica` from the folders as DuckDB does. Files whose names
start with `_` (the manifest, a part still being written) are skipped by both, and by Trino.
Why each lookup missed is explain_sql.py's queries, over the same `capture_events`.
"""

from __future__ import annotations

INTERVAL = "CAST(floor(ts / 60) * 60 AS BIGINT)"  # the start of the minute a message's ts falls in

# hit_rate_per_interval: per replica and minute, how many blocks were newly stored, how many stores
# re-reported a cached hash (the hits kv_cache_report_mode="full" reports), how many cached blocks were
# removed (a removal of a block not cached, repeat = true, removes nothing),
# and the hit ratio repeated / (stored + repeated), NULL in a minute with no stores.
HIT_RATE_PER_INTERVAL = f"""
SELECT replica,
       interval_start,
       stored_blocks,
       repeated_blocks,
       removed_blocks,
       CAST(repeated_blocks AS DOUBLE) / NULLIF(stored_blocks + repeated_blocks, 0) AS hit_ratio
FROM (
    SELECT replica,
           {INTERVAL} AS interval_start,
           COUNT(CASE WHEN kind = 'BlockStored' AND repeat = false THEN 1 END) AS stored_blocks,
           COUNT(CASE WHEN kind = 'BlockStored' AND repeat = true THEN 1 END) AS repeated_blocks,
           COUNT(CASE WHEN kind = 'BlockRemoved' AND repeat = false THEN 1 END) AS removed_blocks
    FROM capture_events
    GROUP BY replica, {INTERVAL}
) per_interval
ORDER BY replica, interval_start
"""

# cross_tenant_reuse: block hashes stored or hit under more than one salt (tenant) on the same replica
# and KV group: the cross-tenant sharing that per-tenant cache salts exist to prevent. Only salts the
# stream names count (salt_named; datasets before it take every salt at its word): a store continuing a
# chain carries the chain's salt, a tenant inferred, not named, and a block without a salt names no
# tenant. first_ts is when a named tenant first stored or hit the hash.
CROSS_TENANT_REUSE = """
SELECT replica,
       COALESCE(group_idx, 0) AS group_idx,
       block_hash,
       COUNT(DISTINCT salt) AS salts,
       MIN(salt) AS min_salt,
       MAX(salt) AS max_salt,
       MIN(ts) AS first_ts
FROM capture_events
WHERE kind = 'BlockStored' AND block_hash IS NOT NULL AND salt IS NOT NULL
  AND (salt_named IS NULL OR salt_named = true)
GROUP BY replica, COALESCE(group_idx, 0), block_hash
HAVING COUNT(DISTINCT salt) > 1
ORDER BY replica, group_idx, first_ts, block_hash
"""

# occupancy_per_interval: per replica, medium and minute, the blocks newly stored and removed, their
# difference (net_change) and the running total of net_change (cached_blocks), i.e. the blocks cached
# at the end of each minute counted from the start of the capture. AllBlocksCleared is ignored here
# (resetting a running sum is not portable), so after a clear cached_blocks runs high by what was
# cached before it; a capture started on a warm server, whose removals include blocks stored before
# it began, can run low.
OCCUPANCY_PER_INTERVAL = f"""
SELECT replica,
       medium,
       interval_start,
       stored_blocks,
       removed_blocks,
       stored_blocks - removed_blocks AS net_change,
       CAST(SUM(stored_blocks - removed_blocks) OVER (
           PARTITION BY replica, medium ORDER BY interval_start
           ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS BIGINT) AS cached_blocks
FROM (
    SELECT replica,
           medium,
           {INTERVAL} AS interval_start,
           COUNT(CASE WHEN kind = 'BlockStored' AND repeat = false THEN 1 END) AS stored_blocks,
           COUNT(CASE WHEN kind = 'BlockRemoved' AND repeat = false THEN 1 END) AS removed_blocks
    FROM capture_events
    WHERE kind IN ('BlockStored', 'BlockRemoved') AND block_hash IS NOT NULL
    GROUP BY replica, medium, {INTERVAL}
) per_interval
ORDER BY replica, medium, interval_start
"""

FLEET_VIEWS: dict[str, str] = {
    "hit_rate_per_interval": HIT_RATE_PER_INTERVAL.strip(),
    "cross_tenant_reuse": CROSS_TENANT_REUSE.strip(),
    "occupancy_per_interval": OCCUPANCY_PER_INTERVAL.strip(),
}


def register_duckdb(con, path: str) -> None:
    """Create the view `capture_events` over the capture dataset at `path` (a folder, local or a URL
    DuckDB's httpfs reads) in the DuckDB connection `con`; then `con.sql(FLEET_VIEWS[name])`.

    The Spark equivalent is `spark.read.parquet(path).createOrReplaceTempView("capture_events")`.
    `replica` is read as text from the partition folders in both (hive_types here, so a replica
    named like a number stays text; replica names start with a letter, so Spark infers a string)."""
    glob = str(path).rstrip("/") + "/**/*.parquet"
    quoted = "'" + glob.replace("'", "''") + "'"
    con.execute("CREATE OR REPLACE VIEW capture_events AS SELECT * FROM read_parquet("
                f"{quoted}, hive_partitioning = true, hive_types = {{'replica': VARCHAR}})")
