"""An imported vLLM/SGLang KV-event capture: its replicas, KV groups and prefix tree, per replica
(the same hash on two replicas is two blocks)."""

from __future__ import annotations

import duckdb
import pandas as pd

from ..capture.tenants import INFERRED, NO_SALT, SALT_LABEL, TENANT


def replicas(con: duckdb.DuckDBPyConnection, run_id: str) -> list[str]:
    return [r for (r,) in con.execute("SELECT DISTINCT coalesce(replica, 'replica-0') AS r FROM kv_events "
                                      "WHERE run_id = ? ORDER BY r", [run_id]).fetchall()]


def groups(con: duckdb.DuckDBPyConnection, run_id: str, replica: str | None = None) -> list[int | None]:
    """The KV groups of a capture (of one replica): a hybrid model hashes each group apart."""
    return [g for (g,) in con.execute(
        "SELECT DISTINCT group_idx FROM kv_events WHERE run_id = $run AND kind = 'BlockStored' AND "
        "($replica IS NULL OR coalesce(replica, 'replica-0') = $replica) ORDER BY group_idx NULLS FIRST",
        {"run": run_id, "replica": replica}).fetchall()]


def prefix_tree(con: duckdb.DuckDBPyConnection, run_id: str, max_nodes: int = 3000,
                replica: str | None = None, group: int | None = None, since: int = 0) -> pd.DataFrame:
    """One row per stored block hash (of one replica and KV group, or all): its parent, its salts as
    stored, how many tenants its events name (salts; more than one: shared across tenants), LoRA, the
    tiers (media) it was stored on, when it was first stored and when it left the cache for good (its
    BlockRemoved or an AllBlocksCleared at or after its last store; null while it is still cached at the
    end), and its tokens, and untold: every store of it named no salt (its salt is the chain's, its own
    tenant unknown); the first `max_nodes` stored from message `since` on.

    The first blocks are found among the earliest stores (a top-N over the capture, not a grouping of
    all of it: 0.4 s rather than 2 s on 10 million events), widening the search when repeats crowd
    them out."""
    def first(window: int | None) -> pd.DataFrame:
        return con.execute(
            "WITH ev AS (SELECT step, kind, block_hash, parent_hash, salt, salt_named, lora_name, medium, token_ids "
            "FROM kv_events "
            "WHERE run_id = $run AND ($replica IS NULL OR coalesce(replica, 'replica-0') = $replica) "
            "AND ($group IS NULL OR group_idx = $group)), "
            "earliest AS (SELECT block_hash, step FROM ev WHERE kind = 'BlockStored' AND step >= $since "
            "ORDER BY step, block_hash "
            "LIMIT coalesce($window, 9223372036854775807)), "
            "chosen AS (SELECT block_hash FROM earliest GROUP BY block_hash ORDER BY min(step), block_hash "
            "LIMIT $max), "
            "stored AS (SELECT block_hash, any_value(parent_hash) AS parent_hash, min(step) AS stored_step, "
            "max(step) AS last_stored, string_agg(DISTINCT coalesce(salt, '(no salt)'), ', ' ORDER BY "
            f"coalesce(salt, '(no salt)')) AS salt, count(DISTINCT {TENANT}) AS salts, "
            "bool_and(NOT coalesce(salt_named, true) AND salt IS NOT NULL) AS untold, "
            "any_value(lora_name) AS lora_name, string_agg(DISTINCT medium, ', ' ORDER BY medium) AS media, "
            "any_value(token_ids) AS token_ids FROM ev "
            "SEMI JOIN chosen USING (block_hash) WHERE kind = 'BlockStored' GROUP BY block_hash), "
            "removed AS (SELECT s.block_hash, min(e.step) AS removed_step FROM stored s JOIN ev e ON e.kind = "
            "'BlockRemoved' AND e.block_hash = s.block_hash AND e.step >= s.last_stored GROUP BY s.block_hash), "
            "cleared AS (SELECT s.block_hash, min(e.step) AS cleared_step FROM stored s JOIN ev e "
            "ON e.kind = 'AllBlocksCleared' AND e.step >= s.last_stored GROUP BY s.block_hash) "
            "SELECT s.* EXCLUDE (last_stored), least(r.removed_step, c.cleared_step) AS removed_step FROM stored s "
            "LEFT JOIN removed r USING (block_hash) LEFT JOIN cleared c USING (block_hash) "
            "ORDER BY stored_step, block_hash",
            {"run": run_id, "replica": replica, "group": group, "max": max_nodes, "window": window,
             "since": since}).df()

    tree = first(20 * max_nodes)
    if len(tree) < max_nodes and len(tree) < stored_blocks(con, run_id, replica, group=group, since=since):
        tree = first(None)
    return tree


def stored_blocks(con: duckdb.DuckDBPyConnection, run_id: str, replica: str | None = None,
                  until: int | None = None, group: int | None = None, since: int = 0) -> int:
    """How many distinct blocks (replica, KV group and hash) were stored from message `since` to
    message `until`: what a capped tree leaves out."""
    return con.execute("SELECT count(DISTINCT (coalesce(replica, 'replica-0'), group_idx, block_hash)) FROM kv_events "
                       "WHERE run_id = $run AND kind = 'BlockStored' AND "
                       "($replica IS NULL OR coalesce(replica, 'replica-0') = $replica) AND "
                       "step >= $since AND ($until IS NULL OR step <= $until) AND "
                       "($group IS NULL OR group_idx = $group)",
                       {"run": run_id, "replica": replica, "until": until, "group": group, "since": since}
                       ).fetchone()[0]


def reuse_tree(con: duckdb.DuckDBPyConnection, run_id: str, start: float, end: float, replica: str | None = None,
               group: int | None = None, blocks: int = 4000, roots: int = 40, fanout: int = 12) -> pd.DataFrame:
    """The most used part of the prefix tree in a time range, readable at millions of blocks: the
    `blocks` most used blocks (stores and hits; a request that uses a block uses its ancestors, so
    the set holds its own ancestors), each chain of single children collapsed into one segment, the
    `roots` busiest subtrees, and under each segment its `fanout` busiest children, the others folded
    into one row. One row per segment: id (its last block's hash, hex), parent (the segment above, ""
    at the top), first (its first block's hash), blocks, tokens (a block stored without its tokens, as a
    hash-only trace's are, counts its block size), uses and hits of its first block,
    tenants (distinct salts the events name), salts (those, and the ones inferred from a chain marked so),
    and folded (how many children a folded row stands for, else 0)."""
    top = con.execute(
        "SELECT block_hash, any_value(parent_hash) AS parent_hash, count(*) AS uses, count(*) FILTER (repeat) AS hits, "
        f"count(DISTINCT {TENANT}) AS tenants, string_agg(DISTINCT {SALT_LABEL}, ', ' ORDER BY {SALT_LABEL}) AS salts, "
        "any_value(coalesce(len(token_ids), block_size)) AS tokens "
        "FROM kv_events "
        "WHERE run_id = $run AND kind = 'BlockStored' AND ts BETWEEN $a AND $b AND "
        "($replica IS NULL OR coalesce(replica, 'replica-0') = $replica) AND ($group IS NULL OR group_idx = $group) "
        "GROUP BY block_hash ORDER BY uses DESC, block_hash LIMIT $n",
        {"run": run_id, "a": start, "b": end, "replica": replica, "group": group, "n": blocks}).fetchall()
    info = {h: (p, uses, hits, tenants, salts, tokens or 0) for h, p, uses, hits, tenants, salts, tokens in top}
    children: dict[int, list[int]] = {}
    tops = []
    for h, (p, *_) in info.items():
        if p is not None and p in info and p != h:
            children.setdefault(p, []).append(h)
        else:
            tops.append(h)
    tops.sort(key=lambda h: -info[h][1])
    rows, stack = [], [(h, "") for h in tops[:roots]]
    while stack:
        h, parent = stack.pop()
        chain = [h]
        while len(children.get(chain[-1], ())) == 1:
            chain.append(children[chain[-1]][0])
        _, uses, hits, tenants, salts, _ = info[h]
        segment = f"{chain[-1]:016x}"
        rows.append((segment, parent, f"{h:016x}", len(chain), sum(info[c][5] for c in chain), uses, hits, tenants,
                     salts, 0))
        kids = sorted(children.get(chain[-1], ()), key=lambda k: (-info[k][1], k))
        stack.extend((k, segment) for k in kids[:fanout])
        if rest := kids[fanout:]:
            salts_of = sorted({s for k in rest for s in info[k][4].split(", ")})
            named = [s for s in salts_of if s != NO_SALT and not s.endswith(INFERRED)]
            rows.append((f"{segment}+{len(rest)}", segment, "", len(rest), sum(info[k][5] for k in rest),
                         sum(info[k][1] for k in rest), sum(info[k][2] for k in rest), len(named),
                         ", ".join(salts_of), len(rest)))
    return pd.DataFrame(rows, columns=["id", "parent", "first", "blocks", "tokens", "uses", "hits", "tenants",
                                       "salts", "folded"])


def cross_tenant_findings(con: duckdb.DuckDBPyConnection, run_id: str, limit: int = 2000) -> pd.DataFrame:
    """A capture's cross_tenant findings as an operator reads them: the tenant (salt) that stored a block
    hash another had stored first, that first one, the message where it happened, the replica and the
    block hash. A finding keeps its message and block index only; several events of a message (and
    the replicas' messages of one number) share those, so its event is one there whose hash the first
    tenant had stored on that replica, the k-th finding of a (tenant, message, index) taking the k-th."""
    return con.execute("""
        WITH f AS (
            SELECT request_id AS tenant, source_request AS stored_first_by, step, position,
                   row_number() OVER (PARTITION BY request_id, source_request, step, position) AS k
            FROM findings WHERE run_id = $run AND kind = 'cross_tenant' ORDER BY step, position LIMIT $limit),
        stored AS (
            SELECT replica, block_hash, coalesce(salt, '(no salt)') AS salt, step, block_index, event_index
            FROM kv_events WHERE run_id = $run AND kind = 'BlockStored'),
        candidates AS (
            SELECT f.tenant, f.stored_first_by, f.step, f.position, e.replica, e.block_hash,
                   row_number() OVER (PARTITION BY f.tenant, f.stored_first_by, f.step, f.position
                                      ORDER BY e.replica, e.event_index) AS k
            FROM (SELECT DISTINCT tenant, stored_first_by, step, position FROM f) f
            JOIN stored e ON e.step = f.step AND e.block_index = f.position AND e.salt = f.tenant
            WHERE EXISTS (SELECT 1 FROM stored o WHERE o.replica = e.replica AND o.block_hash = e.block_hash
                          AND o.salt = f.stored_first_by))
        SELECT f.tenant, f.stored_first_by, c.replica, printf('%016x', c.block_hash) AS block_hash, f.step AS message
        FROM f JOIN candidates c USING (tenant, stored_first_by, step, position, k)
        ORDER BY message, replica, block_hash""", {"run": run_id, "limit": limit}).df()


SHOWN_HASHES = 5  # block hashes listed per cross_tier_salt finding (the table keeps them all)


def tier_salts(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """A capture's cross_tier_salt findings (found on import; none in a capture imported before kvviz looked
    for them): replica, group_idx, salted_medium, unsalted_medium, salt, blocks, first_blocks (the first
    SHOWN_HASHES as hex), hits, served (the tenants those hits named) and others (those of them that are
    not the salt's: another tenant served a block kept without its salt)."""
    df = con.execute(
        "SELECT replica, group_idx, salted_medium, unsalted_medium, salt, blocks, "
        "list_transform(block_hashes[1:$n], lambda h: printf('%016x', h)) AS first_blocks, hits, served, first_step "
        "FROM cross_tier_salts WHERE run_id = $run ORDER BY replica, group_idx, salted_medium, unsalted_medium, salt",
        {"run": run_id, "n": SHOWN_HASHES}).df()
    return df.assign(others=[[t for t in served if t != salt] for served, salt in zip(df.served, df.salt, strict=True)])
