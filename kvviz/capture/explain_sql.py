"""Why each prefix-cache lookup stopped where it did, as SQL that runs unchanged in DuckDB, Spark SQL and
Trino (the dialect FLEET_VIEWS keeps to, fleet_sql.py), so a capture too large for one machine is
explained where it lies.

The history is blocks stored and removed (and whole caches cleared), in order, per replica and KV
group; a lookup at step t sees what was cached before t and not removed by the end of t. A lookup is
an engine run's admission (cache_lookups) or a capture's stored chain segment (it stopped where its
new blocks begin: an event's blocks, or those after the hits the event repeats). The reasons, in the
order they are checked:

- partial_block: every full block the lookup could use was served (an engine lookup; the last token is
  always computed);
- preempted: a re-admission after the request lost its blocks to preemption;
- unexplained: the block it stopped at was cached when it ran;
- reset: the same block (same tokens, same namespace) was cached until the cache was cleared (vLLM's
  AllBlocksCleared, an engine's reset, a publisher's restart);
- capacity: the same block was cached before and removed in the lookup's own step (the batch admitted
  before it needed the room);
- evicted: the same block was cached and removed in an earlier step;
- namespace: the same tokens are cached under another salt (or adapter) at the lookup's step;
- diverged: the closest cached sibling under the same parent shares tokens with it (the two cached
  siblings either side of it in token order; ties go to the one cached first);
- cold: nothing else.
A lookup whose hits were on blocks cached under another namespace names it (hits_cached_under).

A block's content is its whole token prefix (a block hash is no name for it: salts and adapters enter
the hash). A block stored without its tokens (a hash-only trace: kvviz/capture/mooncake.py) is named by
its hash instead and counts block_size tokens; no sibling shares tokens with it, so none of its lookups
is said to have diverged. Prefixes are named by pointer doubling: each round joins every block to the block 2^i above
it and names the pair, so a chain of n blocks takes log2(n) rounds, each one portable statement; the
driver (`explain`) runs them through an `Sql` (DuckDB here, Spark or Trino the same way).

Inputs, as tables or views the caller provides:

  explain_input: replica, grp, step, ev, blk (the order: step, then ev, then blk), kind ('store' |
      'remove' | 'clear': every block of the replica is removed), hash, parent, tokens,
      salt (the namespace the store names; NULL: its chain's), chain_salt (the capture's salt
      column), named (the capture's salt_named), session, bidx (a capture store's place in its
      event: 0 begins a segment, a lookup; NULL for an engine run), block_size
  explain_lookups: lid, replica, grp, request, step, salt, n_tokens, hit, preempted_at, block_size
      (an engine run's lookups; none for a capture)
  explain_lookup_blocks: lid, j, tokens (block j of each engine lookup's tokens, up to the one it
      stopped at)

CAPTURE_INPUT makes explain_input from a capture dataset's `capture_events` (fleet_sql.py;
`capture_inputs` makes all three). The answer is the table explain_result: one row per lookup, its
reason and the evidence for it (NULL where the reason has none). A history that contradicts itself is
explained where it can be: CONTRADICTIONS counts what explain could not use. In Spark:

    spark.read.parquet("s3a://bucket/capture/").createOrReplaceTempView("capture_events")
    sql = SparkSql(spark)
    capture_inputs(sql.table)
    explain(sql)
    spark.table("explain_result").write.parquet("s3a://bucket/explained/")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

ROOT = -1  # the parent name of a chain's first block
MAX_ROUNDS = 64  # chains are at most 2^64 blocks long: more rounds is a bug, not a long chain

# A capture's events as explain's input: stores and removals that change the cache (not `repeat`),
# and clears: AllBlocksCleared, and a replica's publisher restarting (its cache is gone, as the
# import counts it). A store's own namespace is the salt its event names (vLLM names it in a chain's
# first block only); the rest take their chain's.
CAPTURE_INPUT = """
WITH ev AS (
    SELECT COALESCE(replica, 'replica-0') AS replica, COALESCE(group_idx, -1) AS grp, step,
           COALESCE(event_index, 0) AS ev, COALESCE(block_index, 0) AS blk, kind, block_hash, parent_hash,
           token_ids, salt, salt_named, session_id, block_index, block_size, repeat, restart
    FROM capture_events),
messages AS (
    SELECT replica, step, MAX(COALESCE(restart, 0)) AS restart FROM ev GROUP BY replica, step),
restarts AS (
    SELECT replica, step FROM (
        SELECT replica, step, restart, LAG(restart) OVER (PARTITION BY replica ORDER BY step) AS previous
        FROM messages) m
    WHERE restart <> previous)
SELECT replica, grp, step, ev, blk,
       CASE WHEN kind = 'BlockStored' THEN 'store' WHEN kind = 'BlockRemoved' THEN 'remove' ELSE 'clear' END AS kind,
       block_hash AS hash, parent_hash AS parent, token_ids AS tokens,
       CASE WHEN parent_hash IS NULL OR salt_named THEN salt END AS salt, salt AS chain_salt, salt_named AS named,
       session_id AS session, block_index AS bidx, block_size
FROM ev
WHERE (kind IN ('BlockStored', 'BlockRemoved') AND block_hash IS NOT NULL AND NOT COALESCE(repeat, false))
   OR kind = 'AllBlocksCleared'
UNION ALL
SELECT replica, -1, step, -1, 0, 'clear', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM restarts
"""

# No engine lookups (a capture's lookups are its segments).
NO_LOOKUPS = """
SELECT CAST(NULL AS BIGINT) AS lid, CAST(NULL AS VARCHAR(64)) AS replica, CAST(NULL AS INTEGER) AS grp,
       CAST(NULL AS VARCHAR(256)) AS request, CAST(NULL AS BIGINT) AS step, CAST(NULL AS VARCHAR(256)) AS salt,
       CAST(NULL AS BIGINT) AS n_tokens, CAST(NULL AS BIGINT) AS hit, CAST(NULL AS BIGINT) AS preempted_at,
       CAST(NULL AS INTEGER) AS block_size
FROM explain_input WHERE 1 = 0
"""
NO_STOPPED_AT = """
SELECT CAST(NULL AS BIGINT) AS lid, CAST(NULL AS BIGINT) AS j, tokens FROM explain_input WHERE 1 = 0
"""

# Every event numbered in order (pos, unique across replicas: each replica's numbered on its own, after
# the replicas before it, so that the replicas are numbered side by side), with what a store's lookup needs of the
# stores before it: the how-many-th store of its hash it is (nth; and the stores less the removals of
# its hash so far, total, which LIVES reads when no clear splits the history), whether any store so far
# named a tenant,
# and the block size of the part (its first store's). A capture store's bidx is 0 where it begins a segment:
# the row before it is not the block before it in its event (its event's first block, or the first after
# the hits kv_cache_report_mode="full" repeats ahead of a request's new blocks in one event, which are no
# rows here). Tokens, salts and sessions are left out (DuckDB's
# window sorts carry every column: with them this step took 13 s at 10M events, without 9 s): LINKS takes
# each store's from explain_input by its place (replica, grp, step, ev, blk name one event row: a
# capture's step is its message's number, ev its event's place in it, blk its block's; an engine run's ev
# is its event's seq in the step).
EVENTS = """
WITH sizes AS (SELECT replica, COUNT(*) AS n FROM explain_input GROUP BY replica),
offsets AS (
    SELECT replica, CAST(SUM(n) OVER (ORDER BY replica ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) - n AS BIGINT)
           AS before
    FROM sizes),
e AS (
    SELECT i.replica, i.grp, i.step, i.ev, i.blk, i.kind, i.hash, i.parent, i.chain_salt IS NOT NULL AS tenanted,
           CASE WHEN i.bidx IS NULL THEN NULL
                WHEN i.bidx = 0
                  OR LAG(i.step) OVER (PARTITION BY i.replica ORDER BY i.step, i.ev, i.blk) IS DISTINCT FROM i.step
                  OR LAG(i.ev) OVER (PARTITION BY i.replica ORDER BY i.step, i.ev, i.blk) IS DISTINCT FROM i.ev
                  OR LAG(i.blk) OVER (PARTITION BY i.replica ORDER BY i.step, i.ev, i.blk) IS DISTINCT FROM i.blk - 1
                THEN 0 ELSE i.bidx END AS bidx,
           i.block_size,
           o.before + ROW_NUMBER() OVER (PARTITION BY i.replica ORDER BY i.step, i.ev, i.blk) AS pos
    FROM explain_input i JOIN offsets o ON o.replica = i.replica),
parts AS (
    SELECT replica, grp, kind, MIN_BY(block_size, pos) AS first_size,
           MIN(CASE WHEN kind = 'store' AND tenanted THEN pos END) AS first_tenant
    FROM e GROUP BY replica, grp, kind),
tenanted AS (SELECT replica, grp, MIN(first_tenant) AS first_tenant FROM parts GROUP BY replica, grp)
SELECT e.*,
       CAST(SUM(CASE WHEN e.kind = 'store' THEN 1 ELSE 0 END) OVER (
           PARTITION BY e.replica, e.grp, e.hash ORDER BY e.pos ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
           AS BIGINT) AS nth,
       CAST(SUM(CASE WHEN e.kind = 'store' THEN 1 WHEN e.kind = 'remove' THEN -1 ELSE 0 END) OVER (
           PARTITION BY e.replica, e.grp, e.hash ORDER BY e.pos ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
           AS BIGINT) AS total,
       CASE WHEN e.pos >= t.first_tenant THEN 1 ELSE 0 END AS tenants,
       COALESCE(NULLIF(p.first_size, 0), 16) AS bsize
FROM e JOIN parts p ON p.replica = e.replica AND p.grp = e.grp AND p.kind = e.kind
JOIN tenanted t ON t.replica = e.replica AND t.grp = e.grp
"""

# Each block's link to its parent: the parent hash's latest store before it on its replica and group
# (a child stored before its parent, or one whose chain began before the capture, has none: it is
# an orphan, as is everything stored under it); the engine lookups' blocks, chained in order, after.
def _parents(hash_col: str, parent_col: str) -> str:
    """CTEs `keyed` and `found` over a CTE `stores` (replica, grp, pos and the two columns named): for
    each store that names a parent (defines = 0), `up` is the position of the parent hash's latest
    store before it on its replica and group, and `latest` its latest store anywhere (after it: the
    parent came late)."""
    return f"""keyed AS (
    SELECT replica, grp, {hash_col} AS k, pos, 1 AS defines FROM stores
    UNION ALL
    SELECT replica, grp, {parent_col} AS k, pos, 0 AS defines FROM stores WHERE {parent_col} IS NOT NULL),
found AS (
    SELECT pos, defines,
           MAX(CASE WHEN defines = 1 THEN pos END) OVER (PARTITION BY replica, grp, k ORDER BY pos, defines
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS up,
           MAX(CASE WHEN defines = 1 THEN pos END) OVER (PARTITION BY replica, grp, k) AS latest
    FROM keyed),
"""


LINKS = """
WITH stores AS (SELECT replica, grp, step, ev, blk, pos, hash, parent FROM xp_events WHERE kind = 'store'),
""" + _parents("hash", "parent") + """asked AS (SELECT pos, up FROM found WHERE defines = 0),
virtual AS (
    SELECT b.lid, b.j, b.tokens,
           ROW_NUMBER() OVER (ORDER BY b.lid, b.j) + (SELECT COALESCE(MAX(pos), 0) FROM xp_events) AS id
    FROM explain_lookup_blocks b)
SELECT s.pos AS id, a.up, s.parent IS NOT NULL AND a.up IS NULL AS orphan, i.tokens, i.salt,
       s.parent IS NULL OR i.salt IS NOT NULL AS fixed, CAST(NULL AS BIGINT) AS lid, CAST(NULL AS BIGINT) AS j,
       i.session, i.named, CASE WHEN i.tokens IS NULL THEN s.hash END AS untokened,
       CAST(CASE WHEN i.tokens IS NULL THEN COALESCE(i.block_size, 0) ELSE cardinality(i.tokens) END AS BIGINT)
           AS width
FROM stores s LEFT JOIN asked a ON a.pos = s.pos
JOIN explain_input i ON i.replica = s.replica AND i.grp = s.grp AND i.step = s.step AND i.ev = s.ev AND i.blk = s.blk
     AND i.kind = 'store'
UNION ALL
SELECT id, CASE WHEN j > 0 THEN id - 1 END, false, tokens, CAST(NULL AS VARCHAR(256)), true, lid, j,
       CAST(NULL AS VARCHAR(256)), CAST(NULL AS BOOLEAN), NULL, CAST(COALESCE(cardinality(tokens), 0) AS BIGINT)
FROM virtual
"""

# Round 0 of the doubling: each block names its own tokens (a block stored without them, its hash) and
# whether it begins its chain, jumps to its parent, and knows its namespace if its event names one (or
# it begins its chain).
CHAIN_START = """
SELECT id, up AS jump, orphan AS dead,
       MIN(id) OVER (PARTITION BY tokens, untokened, CASE WHEN up IS NULL THEN 1 ELSE 0 END) AS lab,
       fixed, salt, width AS ntok, 1 AS depth
FROM xp_links
"""

# Round i + 1: the name of the pair (the 2^i blocks above, the 2^i blocks ending here) names the 2^(i+1)
# blocks ending here; the namespace is the nearest one named above; a block under an orphan is dead.
# Once no block jumps, each name is its whole prefix's.
CHAIN_ROUND = """
SELECT c.id, p.jump, c.dead OR COALESCE(p.dead, false) AS dead,
       MIN(c.id) OVER (PARTITION BY p.lab, c.lab) AS lab,
       c.fixed OR COALESCE(p.fixed, false) AS fixed,
       CASE WHEN c.fixed THEN c.salt ELSE p.salt END AS salt,
       c.ntok + COALESCE(p.ntok, 0) AS ntok, c.depth + COALESCE(p.depth, 0) AS depth
FROM {chain} c LEFT JOIN {chain} p ON p.id = c.jump
"""

# Every store whose chain is known, with its namespace, its prefix's name and its parent's (its tokens stay in
# xp_links, by id = pos: the tables after it are narrow).
NODES = """
SELECT e.replica, e.grp, e.pos, e.step, e.hash, e.parent, l.width,
       e.bidx, l.session, l.named,
       e.nth, e.tenants, e.bsize, f.salt, f.lab, COALESCE(pf.lab, {root}) AS plab, pf.salt AS parent_salt,
       f.ntok, f.depth,
       CASE WHEN pf.lab IS NULL AND COALESCE(cardinality(l.tokens), 0) > 0 THEN element_at(l.tokens, 1)
            ELSE 0 END AS head
FROM xp_events e
JOIN {chain} f ON f.id = e.pos
JOIN xp_links l ON l.id = e.pos
LEFT JOIN {chain} pf ON pf.id = l.up
WHERE e.kind = 'store' AND NOT f.dead
"""

# Each life of a stored block: from its store to the removal that ends it or the first clear of its
# replica after it (reset), whichever comes first (NULL: cached to the end). Two blocks may hold one
# hash at once (vLLM keeps both): a removal ends the oldest life of its hash still open, and one with
# none open removes nothing. Between two clears that is the n-th store of a hash ended by its n-th
# removal that found one open, counted as a running sum floored at zero: the floor is the running sum's
# least value (or 0), lowered by one by each removal that found none open, so the removals so far that
# found one open are the removals less the floor's depth, and the n-th is the first removal with that count
# (two window passes, the sums and then the floor, and no self-join). A block serves lookups in the steps
# after it was stored, up to its removal's step less one. A history with no clear is one epoch: its
# sums are EVENTS' (nth, total), and the running count of clears, a pass over every event of a replica in
# order, is left out (10M events: 8.5 s -> 5.6 s here, for 2 s more in EVENTS).
EPOCH = """SUM(CASE WHEN kind = 'clear' THEN 1 ELSE 0 END) OVER (
               PARTITION BY replica ORDER BY pos ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)"""
SUMMED_BY_EPOCH = """
    SELECT e.*, SUM(CASE WHEN kind = 'store' THEN 1 ELSE -1 END) OVER (
               PARTITION BY replica, grp, hash, epoch ORDER BY pos
               ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS total,
           SUM(CASE WHEN kind = 'store' THEN 1 ELSE 0 END) OVER (
               PARTITION BY replica, grp, hash, epoch ORDER BY pos
               ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS stores
    FROM epochs e WHERE kind IN ('store', 'remove')"""
SUMMED_AS_ONE = """
    SELECT replica, grp, hash, pos, step, kind, 0 AS epoch, total, nth AS stores
    FROM xp_events WHERE kind IN ('store', 'remove')"""
COUNTS = """
WITH epochs AS (
    SELECT replica, grp, hash, pos, step, kind, {epoch} AS epoch FROM xp_events),
summed AS ({summed})
SELECT s.*, LEAST(0, MIN(total) OVER (
           PARTITION BY replica, grp, hash, epoch ORDER BY pos
           ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)) AS floor_now
FROM summed s
"""
# (A table of their own: read twice in one statement, DuckDB held them in memory, which a 100M-event
# history's do not fit.)
LIVES = """
WITH ends AS (
    SELECT replica, grp, hash, epoch, stores - total + floor_now AS n, MIN(step) AS step
    FROM xp_counts WHERE kind = 'remove' GROUP BY replica, grp, hash, epoch, stores - total + floor_now),
clears AS (
    SELECT replica, {epoch} AS epoch, step FROM xp_events WHERE kind = 'clear')
SELECT v.replica, v.grp, v.salt, v.lab, v.plab, v.head, v.pos, v.step AS stored,
       COALESCE(r.step, c.step) AS removed, r.n IS NULL AND c.step IS NOT NULL AS reset
FROM xp_nodes v
JOIN xp_counts s ON s.pos = v.pos
LEFT JOIN ends r ON r.replica = s.replica AND r.grp = s.grp AND r.hash = s.hash AND r.epoch = s.epoch
     AND r.n = s.stores
LEFT JOIN clears c ON c.replica = s.replica AND c.epoch = s.epoch + 1
"""

# Every lookup, with the block it stopped at (its prefix's name, its parent's, its tokens): a capture's
# segments (a store beginning its event's blocks, with a known chain) and an engine run's admissions.
LOOKUPS = """
SELECT n.pos AS lid, n.replica, n.grp, n.pos, n.step, CAST(NULL AS VARCHAR(256)) AS request, n.salt, n.bsize,
       n.ntok AS n_tokens, n.ntok - n.width AS hit, false AS whole,
       CAST(NULL AS BIGINT) AS preempted_at, n.lab AS stop_lab, n.plab AS stop_plab, t.tokens AS stop_tokens,
       n.head, n.hash, n.session, n.nth, n.parent, n.parent_salt, n.named, n.tenants
FROM xp_nodes n JOIN xp_links t ON t.id = n.pos WHERE n.bidx = 0
UNION ALL
SELECT l.lid, l.replica, l.grp, l.lid, l.step, l.request, l.salt, COALESCE(NULLIF(l.block_size, 0), 16),
       l.n_tokens, l.hit, true, l.preempted_at, s.lab, COALESCE(p.lab, {root}), v.tokens,
       CASE WHEN p.lab IS NULL AND COALESCE(cardinality(v.tokens), 0) > 0 THEN element_at(v.tokens, 1)
            ELSE 0 END,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM explain_lookups l
LEFT JOIN xp_links v ON v.lid = l.lid
     AND v.j = CAST(floor(CAST(l.hit AS DOUBLE) / COALESCE(NULLIF(l.block_size, 0), 16)) AS BIGINT)
LEFT JOIN {chain} s ON s.id = v.id
LEFT JOIN xp_links pv ON pv.lid = l.lid AND pv.j = v.j - 1
LEFT JOIN {chain} p ON p.id = pv.id
"""

# A capture lookup's hit blocks are its chain above it, found by the same jumps, high bits first:
# each round adds the blocks 2^i further up from every block found so far.
ANCESTORS_START = "SELECT lid, lid AS a, 0 AS d FROM xp_lookups WHERE NOT whole"
ANCESTORS_ROUND = """
SELECT lid, a, d FROM {found}
UNION ALL
SELECT f.lid, c.jump, f.d + {step} FROM {found} f JOIN {chain} c ON c.id = f.a WHERE c.jump IS NOT NULL
"""

# Each lookup's hit blocks: block j's prefix name.
HITS = """
SELECT f.lid, c.depth - 1 AS j, c.lab FROM {found} f JOIN {chain} c ON c.id = f.a WHERE f.d > 0
UNION ALL
SELECT v.lid, v.j, c.lab
FROM explain_lookups l JOIN xp_links v ON v.lid = l.lid JOIN {chain} c ON c.id = v.id
WHERE v.j < CAST(floor(CAST(l.hit AS DOUBLE) / COALESCE(NULLIF(l.block_size, 0), 16)) AS BIGINT)
"""

# The reasons. A life serves a lookup at step s when it was stored before s and not removed by the end
# of s: it serves the steps stored + 1 .. removed - 1. Each reason asks which lives of some content or
# parent served each lookup; a join of every lookup with every life of its content (or parent) would
# grow as the square of the history (a tenant prefix is stored again and again), so the questions are
# answered by a sweep through time and by aligned time spans, each a pass over the lives.

# Each lookup's stop block (j = -1) and hit blocks, for each namespace the block's content was ever
# cached under on its replica and group: how many of those lives served it, and the latest one stored
# before it. Only the lives of content some lookup asks about are swept (at 10M events, 41%
# of them). A sweep through the lives' stores and removals in time order, the lookups among them: a
# removal in a lookup's own step counts before it (the life no longer serves it), a store after; a life
# stored and removed in one step serves nothing.
# (ASKED and ASKED_LIVES are tables: each is read twice, and a CTE read twice is held in memory.)
ASKED = """
SELECT lid, -1 AS j, replica, grp, stop_lab AS lab, step FROM xp_lookups
UNION ALL
SELECT h.lid, h.j, l.replica, l.grp, h.lab, l.step FROM xp_hits h JOIN xp_lookups l ON l.lid = h.lid
"""
ASKED_LIVES = """
SELECT v.replica, v.grp, v.lab, v.salt, v.stored, v.removed, v.pos
FROM xp_lives v JOIN (SELECT DISTINCT replica, grp, lab FROM xp_asked) w
     ON w.replica = v.replica AND w.grp = v.grp AND w.lab = v.lab
"""
SEEN = """
WITH salts AS (SELECT DISTINCT replica, grp, lab, salt FROM xp_asked_lives),
marks AS (
    SELECT a.replica, a.grp, a.lab, s.salt, a.step AS t, 1 AS typ, 0 AS pos, a.lid, a.j, 0 AS stores, 0 AS gone
    FROM xp_asked a JOIN salts s ON s.replica = a.replica AND s.grp = a.grp AND s.lab = a.lab
    UNION ALL
    SELECT replica, grp, lab, salt, stored, 2, pos, CAST(NULL AS BIGINT), CAST(NULL AS BIGINT), 1, 0 FROM xp_asked_lives
    UNION ALL
    SELECT replica, grp, lab, salt, removed, CASE WHEN removed > stored THEN 0 ELSE 3 END, pos,
           CAST(NULL AS BIGINT), CAST(NULL AS BIGINT), 0, 1
    FROM xp_asked_lives WHERE removed IS NOT NULL),
swept AS (
    SELECT lid, j, salt, typ,
           SUM(stores - gone) OVER (PARTITION BY replica, grp, lab, salt ORDER BY t, typ, pos
                                    ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS alive,
           MAX(CASE WHEN stores = 1 THEN pos END) OVER (PARTITION BY replica, grp, lab, salt ORDER BY t, typ, pos
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS latest
    FROM marks)
SELECT lid, j, salt, alive, latest FROM swept WHERE typ = 1
"""

# The lives under a parent some lookup stopped under (its siblings), each with its tokens' rank among
# the siblings' and the lookups' (so that siblings are compared in token order by a number) and the
# first life of its tokens; the lookups' own ranks beside them (lid; NULL pos). g names a family
# (replica, group, parent, first token, namespace) by its first life, so that the joins after match
# one number, not five columns of which one is a string (10M events: the closest siblings' join 6.6 s
# -> 2.9 s, the spans 3.5 s -> 0.9 s); a lookup with no sibling in its namespace has none.
KIN = """
WITH asked AS (SELECT DISTINCT replica, grp, stop_plab AS plab, head FROM xp_lookups),
siblings AS (
    SELECT v.replica, v.grp, v.plab, v.head, v.salt, t.tokens, v.pos, v.stored, v.removed,
           CAST(NULL AS BIGINT) AS lid
    FROM xp_lives v JOIN asked q ON q.replica = v.replica AND q.grp = v.grp AND q.plab = v.plab AND q.head = v.head
    JOIN xp_links t ON t.id = v.pos
    UNION ALL
    SELECT replica, grp, stop_plab, head, salt, stop_tokens, CAST(NULL AS BIGINT), CAST(NULL AS BIGINT),
           CAST(NULL AS BIGINT), lid
    FROM xp_lookups)
SELECT replica, grp, plab, head, salt, pos, stored, removed, lid, r,
       MIN(pos) OVER (PARTITION BY replica, grp, plab, head, salt, r) AS first_pos,
       MIN(pos) OVER (PARTITION BY replica, grp, plab, head, salt) AS g
FROM (SELECT b.*, CASE WHEN tokens IS NOT NULL THEN DENSE_RANK() OVER (
          PARTITION BY replica, grp, plab, head ORDER BY tokens) END AS r
      FROM siblings b) ranked
"""

# The steps each sibling served, as aligned spans of 2^k steps (k from xp_levels), the fewest that tile
# them: a lookup at step s finds every life that served it, once, among the spans holding s (one per
# level). A life cached to the end serves up to the last lookup's step.
STAB = """
WITH lives AS (
    SELECT g, r, stored + 1 AS a, COALESCE(removed - 1, {last}) AS b
    FROM xp_kin WHERE pos IS NOT NULL),
spans AS (
    SELECT l.g, l.r, x.k,
           CAST(ceil(CAST(l.a AS DOUBLE) / x.p) AS BIGINT) AS lo,
           CAST(floor(CAST(l.b + 1 AS DOUBLE) / x.p) AS BIGINT) AS hi
    FROM lives l CROSS JOIN xp_levels x WHERE x.p <= l.b - l.a + 1)
SELECT g, r, k, lo AS node FROM spans WHERE lo < hi AND lo % 2 = 1
UNION ALL
SELECT g, r, k, hi - 1 FROM spans WHERE lo < hi AND hi % 2 = 1
"""

# Each lookup with the block it stopped at (k) and the last block it could use (usable), around LOOKUPS.
STOPPED_AT = """
SELECT x.*, CAST(floor(CAST(hit AS DOUBLE) / bsize) AS BIGINT) AS k,
       CAST(floor(CAST(n_tokens - 1 AS DOUBLE) / bsize) AS BIGINT) AS usable
FROM ({lookups}) x
"""

# Each lookup's closest cached sibling (its tokens, and how many it shares with the lookup's): of the
# two cached either side of it in token order when it ran, the one sharing more (ties: the one cached
# first). Tables of their own (NEAR, the two either side; CLOSEST), not CTEs of the reasons': in one
# statement their joins shared the 1 GB with the reasons' and spilled (10M events: 14.6 s as one, 10.2 s
# as two), and a CTE read twice is held in memory, which a 100M-event capture's do not fit.
NEAR = """
WITH spans AS (
    SELECT l.lid, q.g, q.r, x.k, CAST(floor(CAST(l.step AS DOUBLE) / x.p) AS BIGINT) AS node
    FROM xp_lookups l JOIN xp_kin q ON q.lid = l.lid CROSS JOIN xp_levels x WHERE q.g IS NOT NULL)
SELECT l.lid, l.g, MAX(CASE WHEN v.r < l.r THEN v.r END) AS below, MIN(CASE WHEN v.r > l.r THEN v.r END) AS above
FROM spans l JOIN xp_stab v ON v.g = l.g AND v.k = l.k AND v.node = l.node
GROUP BY l.lid, l.g
"""
CLOSEST = """
WITH candidates AS (
    SELECT lid, g, below AS r FROM xp_near WHERE below IS NOT NULL
    UNION ALL
    SELECT lid, g, above FROM xp_near WHERE above IS NOT NULL),
firsts AS (
    SELECT c.lid, f.first_pos FROM candidates c JOIN xp_kin f ON f.g = c.g AND f.r = c.r AND f.pos = f.first_pos),
shared AS (
    SELECT f.lid, f.first_pos,
           CAST(COALESCE(MIN(CASE WHEN element_at(f.theirs, p.i) <> element_at(f.ours, p.i) THEN p.i END),
                         f.n + 1) - 1 AS BIGINT) AS shared
    FROM (SELECT f.lid, f.first_pos, v.tokens AS theirs, l.stop_tokens AS ours,
                 LEAST(cardinality(v.tokens), cardinality(l.stop_tokens)) AS n
          FROM firsts f JOIN xp_lookups l ON l.lid = f.lid JOIN xp_links v ON v.id = f.first_pos) f
    LEFT JOIN xp_positions p ON p.i <= f.n
    GROUP BY f.lid, f.first_pos, f.n),
closest AS (
    SELECT r.lid, v.tokens, r.shared FROM (
        SELECT s.*, ROW_NUMBER() OVER (PARTITION BY lid ORDER BY shared DESC, first_pos) AS rn FROM shared s) r
    JOIN xp_links v ON v.id = r.first_pos
    WHERE r.rn = 1)
SELECT lid, tokens, shared FROM closest
"""

REASONS = """
WITH own AS (
    SELECT s.lid, s.alive, v.stored AS stored_at, v.removed AS removed_at, v.reset
    FROM xp_seen s JOIN xp_lookups l ON l.lid = s.lid JOIN xp_lives v ON v.pos = s.latest
    WHERE s.j = -1 AND s.salt IS NOT DISTINCT FROM l.salt),
others AS (
    SELECT s.lid, COALESCE(MIN(s.salt), '(no salt)') AS cached_under
    FROM xp_seen s JOIN xp_lookups l ON l.lid = s.lid
    WHERE s.j = -1 AND s.salt IS DISTINCT FROM l.salt AND s.alive > 0
    GROUP BY s.lid),
hit_blocks AS (
    SELECT s.lid, s.j,
           MAX(CASE WHEN s.salt IS NOT DISTINCT FROM l.salt THEN 1 ELSE 0 END) AS own,
           MIN(CASE WHEN s.salt IS DISTINCT FROM l.salt THEN s.salt END) AS salt,
           MAX(CASE WHEN s.salt IS NULL AND l.salt IS NOT NULL THEN 1 ELSE 0 END) AS unsalted
    FROM xp_seen s JOIN xp_lookups l ON l.lid = s.lid
    WHERE s.j >= 0 AND s.alive > 0
    GROUP BY s.lid, s.j),
crossed AS (
    SELECT lid, MIN_BY(COALESCE(salt, '(no salt)'), j) AS hits_cached_under
    FROM hit_blocks WHERE own = 0 AND (salt IS NOT NULL OR unsalted = 1)
    GROUP BY lid),
said AS (
    SELECT l.*, o.alive, o.stored_at, o.removed_at, n.cached_under, c.tokens AS theirs_tokens, c.shared,
           x.hits_cached_under,
           CASE WHEN l.whole AND l.k >= l.usable THEN 'partial_block'
                WHEN l.preempted_at IS NOT NULL THEN 'preempted'
                WHEN o.lid IS NOT NULL AND o.alive > 0 THEN 'unexplained'
                WHEN o.lid IS NOT NULL AND o.reset THEN 'reset'
                WHEN o.lid IS NOT NULL AND o.removed_at = l.step THEN 'capacity'
                WHEN o.lid IS NOT NULL THEN 'evicted'
                WHEN n.lid IS NOT NULL THEN 'namespace'
                WHEN c.lid IS NOT NULL AND l.k * l.bsize + c.shared > 0 THEN 'diverged'
                ELSE 'cold' END AS reason,
           COALESCE(l.parent IS NOT NULL AND NOT l.named AND l.tenants = 1, false) AS tenant_unknown
    FROM xp_lookups l
    LEFT JOIN own o ON o.lid = l.lid
    LEFT JOIN others n ON n.lid = l.lid
    LEFT JOIN xp_closest c ON c.lid = l.lid
    LEFT JOIN crossed x ON x.lid = l.lid)
SELECT lid, replica, grp, pos, step, request, hash, session, nth, hit AS hit_tokens, k AS stop_block,
       k * bsize AS stop_token, reason,
       CASE WHEN reason = 'partial_block' THEN n_tokens - hit END AS tokens_after,
       CASE WHEN reason = 'preempted' THEN preempted_at END AS preempted_at,
       CASE WHEN reason IN ('capacity', 'reset', 'evicted') THEN stored_at END AS stored_at,
       CASE WHEN reason IN ('capacity', 'reset', 'evicted') THEN removed_at END AS removed_at,
       CASE WHEN reason IN ('reset', 'evicted') THEN step - removed_at END AS before_steps,
       CASE WHEN reason = 'namespace' THEN cached_under END AS cached_under,
       CASE WHEN reason = 'diverged' THEN k * bsize + shared END AS shared_tokens,
       CASE WHEN reason = 'diverged' AND shared < cardinality(stop_tokens)
            THEN element_at(stop_tokens, CAST(shared + 1 AS INTEGER)) END AS ours,
       CASE WHEN reason = 'diverged' AND shared < cardinality(theirs_tokens)
            THEN element_at(theirs_tokens, CAST(shared + 1 AS INTEGER)) END AS theirs,
       CASE WHEN reason = 'cold' THEN k * bsize END AS new_from_token,
       hits_cached_under,
       CASE WHEN hits_cached_under IS NOT NULL OR tenant_unknown THEN parent END AS continues_block,
       CASE WHEN tenant_unknown THEN COALESCE(parent_salt, '(no salt)') END AS continues_chain_of,
       tenant_unknown
FROM said
"""

# What a capture's history says that cannot be so, counted over `capture_events`: removals of a block
# not cached (removed twice, or stored before the capture began), stores whose parent was stored only
# after them (or at once: a block its own parent), and publisher sequence numbers that go back
# without a restart. Explain leaves such events out, or (a child before its parent) its chain.
CONTRADICTIONS = """
WITH stores AS (
    SELECT COALESCE(replica, 'replica-0') AS replica, COALESCE(group_idx, -1) AS grp, block_hash, parent_hash,
           ROW_NUMBER() OVER (ORDER BY COALESCE(replica, 'replica-0'), step, COALESCE(event_index, 0),
                                       COALESCE(block_index, 0)) AS pos
    FROM capture_events
    WHERE kind = 'BlockStored' AND block_hash IS NOT NULL AND NOT COALESCE(repeat, false)),
""" + _parents("block_hash", "parent_hash") + """messages AS (
    SELECT COALESCE(replica, 'replica-0') AS replica, COALESCE(restart, 0) AS restart, step, MIN(seq) AS seq
    FROM capture_events GROUP BY COALESCE(replica, 'replica-0'), COALESCE(restart, 0), step),
sequenced AS (
    SELECT seq, LAG(seq) OVER (PARTITION BY replica, restart ORDER BY step) AS previous FROM messages)
SELECT (SELECT COUNT(*) FROM capture_events WHERE kind = 'BlockRemoved' AND repeat = true) AS removed_not_cached,
       (SELECT COUNT(*) FROM found WHERE defines = 0 AND up IS NULL AND latest >= pos) AS stored_before_parent,
       (SELECT COUNT(*) FROM sequenced WHERE seq < previous) AS sequence_back
"""

RESULT_COLUMNS = (
    "lid",
    "replica",
    "grp",
    "pos",
    "step",
    "request",
    "hash",
    "session",
    "nth",
    "hit_tokens",
    "stop_block",
    "stop_token",
    "reason",
    "tokens_after",
    "preempted_at",
    "stored_at",
    "removed_at",
    "before_steps",
    "cached_under",
    "shared_tokens",
    "ours",
    "theirs",
    "new_from_token",
    "hits_cached_under",
    "continues_block",
    "continues_chain_of",
    "tenant_unknown",
)


# What `explain` is doing, in the order it does it, for a progress bar: each is one statement, or a
# statement per round where the chains need more (as many rounds as log2 of the longest chain).
STAGES = (
    "numbering the events",
    "linking each block to its parent",
    "naming each block's prefix",
    "finding what each block continues",
    "each cached block's lives",
    "the lookups",
    "each lookup's hit blocks",
    "the reasons",
)
ROUNDS = {STAGES[2], STAGES[6]}  # stages of several statements, one per round
Progress = Callable[[str, str], None]  # (a stage of STAGES, what of it: "round 3"); called as each begins


class Sql(Protocol):
    """Where the queries run: `table` materialises a query under a name the later ones read, `rows`
    answers one."""

    def table(self, name: str, query: str) -> None: ...

    def rows(self, query: str) -> list[tuple]: ...

    def drop(self, *names: str) -> None:
        """The tables `table` made under these names are read no more."""


def explain(sql: Sql, progress: Progress | None = None) -> None:
    """Run every step over the inputs (explain_input, explain_lookups, explain_lookup_blocks) into
    the table explain_result (and the steps' own tables, named xp_*); `progress` hears each stage begin.
    A step's table is dropped once no later step reads it: kept to the end, a 100M-event capture's
    spilled 47 GB."""
    said = progress or (lambda stage, detail: None)
    said(STAGES[0], "")
    sql.table("xp_events", EVENTS)
    said(STAGES[1], "")
    sql.table("xp_links", LINKS)
    chains = ["xp_chain_0"]
    said(STAGES[2], "round 1")
    sql.table(chains[0], CHAIN_START)
    while sql.rows(f"SELECT COUNT(*) FROM {chains[-1]} WHERE jump IS NOT NULL")[0][0]:
        if len(chains) > MAX_ROUNDS:
            raise RuntimeError(f"explain: chains still jumping after {MAX_ROUNDS} rounds")
        chains.append(f"xp_chain_{len(chains)}")
        said(STAGES[2], f"round {len(chains)}")
        sql.table(chains[-1], CHAIN_ROUND.format(chain=chains[-2]))
    final = chains[-1]
    said(STAGES[3], "")
    sql.table("xp_nodes", NODES.format(chain=final, root=ROOT))
    said(STAGES[4], "")
    cleared = sql.rows("SELECT COUNT(*) FROM xp_events WHERE kind = 'clear'")[0][0]
    sql.table("xp_counts", COUNTS.format(epoch=EPOCH, summed=SUMMED_BY_EPOCH) if cleared
              else COUNTS.format(epoch="0", summed=SUMMED_AS_ONE))
    sql.table("xp_lives", LIVES.format(epoch=EPOCH if cleared else "0"))
    sql.drop("xp_counts", "xp_events")
    said(STAGES[5], "")
    sql.table("xp_lookups", STOPPED_AT.format(lookups=LOOKUPS.format(chain=final, root=ROOT)))
    sql.drop("xp_nodes")
    found = "xp_up_0"
    sql.table(found, ANCESTORS_START)
    for n, i in enumerate(reversed(range(len(chains) - 1)), 1):  # chains[i] jumps 2^i blocks
        said(STAGES[6], f"round {n} of {len(chains) - 1}")
        sql.table(f"xp_up_{n}", ANCESTORS_ROUND.format(found=found, chain=chains[i], step=1 << i))
        sql.drop(found)
        found = f"xp_up_{n}"
    said(STAGES[6], "")
    sql.table("xp_hits", HITS.format(found=found, chain=final))
    sql.drop(found, *chains)
    said(STAGES[7], "")
    longest, last = sql.rows("SELECT MAX(cardinality(stop_tokens)), MAX(step) FROM xp_lookups")[0]
    sql.table("xp_positions", positions(longest or 0))
    sql.table("xp_levels", levels(last or 0))
    sql.table("xp_asked", ASKED)
    sql.drop("xp_hits")
    sql.table("xp_asked_lives", ASKED_LIVES)
    sql.table("xp_seen", SEEN)
    sql.drop("xp_asked", "xp_asked_lives")
    sql.table("xp_kin", KIN)
    sql.table("xp_stab", STAB.format(last=last or 0))
    sql.table("xp_near", NEAR)
    sql.drop("xp_stab")
    sql.table("xp_closest", CLOSEST)
    sql.drop("xp_near", "xp_kin", "xp_links")
    sql.table("explain_result", REASONS)


def capture_inputs(make) -> None:
    """explain's inputs over `capture_events`: `make(name, query)` makes each (a view or a table)."""
    make("explain_input", CAPTURE_INPUT)
    make("explain_lookups", NO_LOOKUPS)
    make("explain_lookup_blocks", NO_STOPPED_AT)


def levels(last: int) -> str:
    """Each level k of the aligned time spans and its span p = 2^k steps, up to one that holds steps
    0..last + 1 (a VALUES list)."""
    top = max(last + 2, 1).bit_length()
    return "SELECT k, p FROM (VALUES " + ", ".join(f"({k}, {1 << k})" for k in range(top + 1)) + ") AS t(k, p)"


def positions(n: int) -> str:
    """1..n as a table of one column i (a VALUES list: every engine reads it)."""
    return "SELECT i FROM (VALUES " + ", ".join(f"({i})" for i in range(1, max(n, 1) + 1)) + ") AS t(i)"


class DuckSql:
    """`Sql` on a DuckDB connection: temporary tables and views, and element_at for lists (DuckDB's is
    for maps) as a temporary macro; `close` drops them all, leaving the connection as it was."""

    def __init__(self, con) -> None:
        self.con, self.made = con, {}
        con.execute("CREATE OR REPLACE TEMP MACRO element_at(l, i) AS l[CAST(i AS BIGINT)]")

    def table(self, name: str, query: str, params: dict | None = None) -> None:
        self.made[name] = "TABLE"
        self.con.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS {query}", params)

    def view(self, name: str, query: str) -> None:
        self.made[name] = "VIEW"
        self.con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS {query}")

    def rows(self, query: str, params: dict | None = None) -> list[tuple]:
        return self.con.execute(query, params).fetchall()

    def drop(self, *names: str) -> None:
        for name in names:
            self.con.execute(f"DROP {self.made.pop(name)} IF EXISTS temp.{name}")

    def drop_steps(self) -> None:
        """Drop explain's step tables (xp_*), keeping its answer, so that their memory is free before the
        answer is read (10M events: 1.51 GB peak reading it beside them, 1.31 GB without)."""
        self.drop(*[n for n in self.made if n.startswith("xp_")])

    def close(self) -> None:
        for name, kind in reversed(self.made.items()):
            self.con.execute(f"DROP {kind} IF EXISTS temp.{name}")
        self.con.execute("DROP MACRO IF EXISTS temp.element_at")


class SparkSql:
    """`Sql` on a SparkSession: each step a checkpointed temporary view (the rounds read it more than
    once, and a plan that grew with every round would be planned again each time)."""

    def __init__(self, spark) -> None:
        self.spark = spark

    def table(self, name: str, query: str) -> None:
        self.spark.sql(query).localCheckpoint().createOrReplaceTempView(name)

    def rows(self, query: str) -> list[tuple]:
        return [tuple(r) for r in self.spark.sql(query).collect()]

    def drop(self, *names: str) -> None:
        for name in names:
            self.spark.catalog.dropTempView(name)
