"""Whose block a capture's store is, as the stream itself says it, and the isolation findings that
rest on it: a block hash cached for two tenants (cross_tenant) and a block kept salted in one tier
and unsalted in another (cross_tier_salt).

vLLM names the salt in a chain's first block only. The import gives every block the salt of the
chain it continues (rows.py), which is the right namespace on a server that hashes salts, but it is
not a tenant the stream named: on a server that leaves a salt out of some hashes, another tenant's
request continues the chain. So a finding rests only on tenants the stream names (`TOLD`): the salt
a store's (or a hit's) own event names. What is only inferred is counted apart and shown as such,
never as a finding; a chain begun without a salt names no tenant (the linter's salt_mixed says when a
replica mixes them with salted ones).
"""

from __future__ import annotations

NO_SALT = "(no salt)"
INFERRED = " (inferred)"  # after a salt the import gave a row from its chain: no tenant the stream named
TENANT = "CASE WHEN salt_named IS DISTINCT FROM false THEN salt END"  # a row's tenant as its own event names it
SALT_LABEL = (f"CASE WHEN salt IS NULL THEN '{NO_SALT}' WHEN salt_named IS DISTINCT FROM false THEN salt "
              f"ELSE salt || '{INFERRED}' END")  # a row's salt as a reader should take it

# kv_events' stores and hits of run $run with `tenant`: the salt the stream names for the row (its own
# event names it), or NULL where it is only inferred from the chain the row continues or the cached block
# a hit names none for. A row without a salt names no tenant. Captures imported before kvviz kept
# salt_named (null) are taken at their word, as the views take them.
TOLD = f"""
stores AS NOT MATERIALIZED (
    SELECT coalesce(replica, 'replica-0') AS replica, coalesce(group_idx, -1) AS grp, block_hash, salt, step,
           event_index, block_index, ts, coalesce(repeat, false) AS repeat,
           {TENANT} AS tenant
    FROM kv_events WHERE run_id = $run AND kind = 'BlockStored')
"""

CROSS_TENANT = f"""
INSERT INTO findings (run_id, kind, request_id, step, position, source_request)
WITH {TOLD},
shared AS (  -- the few hashes two named tenants stored or hit: the rest need no ordering
    SELECT replica, grp, block_hash FROM stores GROUP BY ALL HAVING min(tenant) <> max(tenant)),
firsts AS (
    SELECT replica, grp, block_hash, tenant, min([step, event_index, block_index]) AS first_at
    FROM stores SEMI JOIN shared USING (replica, grp, block_hash) WHERE tenant IS NOT NULL GROUP BY ALL),
ordered AS (
    SELECT *, min(tenant) OVER (PARTITION BY replica, grp, block_hash ORDER BY first_at
                                ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS earlier
    FROM firsts)
SELECT $run, 'cross_tenant', tenant, first_at[1], first_at[3], earlier FROM ordered WHERE earlier IS NOT NULL
ORDER BY first_at
"""

# A block hash stored salted in one medium (tier) and unsalted in another of the same replica and KV
# group: the second tier keys it without the salt its first copy carried, so any tenant whose chain
# reaches that hash is served it there (the salt kept on the GPU, dropped by the offload tier). One
# row per replica, KV group, pair of media and salt: the blocks, and the hits the unsalted copies
# served with the tenants those hits' events name. A copy is unsalted where the stream says so: a store
# with no salt that begins a chain or continues one cached unsalted in that medium (not one whose parent
# the capture never saw cached there).
CROSS_TIER_SALT = """
INSERT INTO cross_tier_salts (run_id, replica, group_idx, salted_medium, unsalted_medium, salt, blocks,
                              block_hashes, hits, served, first_step)
WITH copies AS NOT MATERIALIZED (
    SELECT coalesce(replica, 'replica-0') AS replica, coalesce(group_idx, -1) AS grp,
           coalesce(medium, '(no medium)') AS medium, block_hash, salt, salt_named, step,
           coalesce(repeat, false) AS repeat, parent_cached
    FROM kv_events WHERE run_id = $run AND kind = 'BlockStored'),
tiered AS (  -- replicas that store on two media or more: the rest (most captures) need no more
    SELECT replica FROM copies GROUP BY replica HAVING min(medium) <> max(medium)),
mixed AS (  -- the few hashes with a salted copy and an unsalted one on two media
    SELECT replica, grp, block_hash FROM copies SEMI JOIN tiered USING (replica) WHERE NOT repeat GROUP BY ALL
    HAVING count(salt) > 0 AND count(*) FILTER (salt IS NULL AND coalesce(parent_cached, true)) > 0
       AND min(medium) <> max(medium)),
keys AS (
    SELECT replica, grp, medium, block_hash, salt, min(step) AS first
    FROM copies SEMI JOIN mixed USING (replica, grp, block_hash)
    WHERE NOT repeat AND (salt IS NOT NULL OR coalesce(parent_cached, true)) GROUP BY ALL),
pairs AS (
    SELECT s.replica, s.grp, s.block_hash, s.medium AS salted_medium, u.medium AS unsalted_medium, s.salt,
           greatest(s.first, u.first) AS at
    FROM keys s JOIN keys u ON u.replica = s.replica AND u.grp = s.grp AND u.block_hash = s.block_hash
        AND u.salt IS NULL AND u.medium <> s.medium
    WHERE s.salt IS NOT NULL),
served AS (
    SELECT replica, grp, medium AS unsalted_medium, block_hash, count(*) AS hits,
           list(DISTINCT salt) FILTER (salt_named IS DISTINCT FROM false AND salt IS NOT NULL) AS tenants
    FROM copies SEMI JOIN (SELECT DISTINCT replica, grp, unsalted_medium AS medium, block_hash FROM pairs)
        USING (replica, grp, medium, block_hash)
    WHERE repeat GROUP BY ALL)
SELECT $run, p.replica, nullif(p.grp, -1), p.salted_medium, p.unsalted_medium, p.salt, count(*),
       list(p.block_hash ORDER BY p.at, p.block_hash), coalesce(sum(h.hits), 0),
       list_sort(list_distinct(flatten(list(coalesce(h.tenants, []))))), min(p.at)
FROM pairs p LEFT JOIN served h USING (replica, grp, unsalted_medium, block_hash)
GROUP BY p.replica, p.grp, p.salted_medium, p.unsalted_medium, p.salt
ORDER BY p.replica, p.grp, p.salted_medium, p.unsalted_medium, p.salt
"""
