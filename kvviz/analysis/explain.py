"""Why did a request miss? For every prefix-cache lookup, how many tokens hit, at which block and
token the lookup stopped, and why, with the evidence (the question of LMCache #3659 and vLLM RFC
#43711 that no tool answers).

The reasons are SQL (kvviz/capture/explain_sql.py, where they are defined, in the dialect DuckDB, Spark
and Trino share); this module gives them a run of the store as input and reads the answer back.
One history serves engine runs and captures alike: blocks stored (hash, parent, tokens, salt) and
removed, in order. Engine runs record it in block_events and their lookups in cache_lookups; a
capture's kv_events are the same history, each replica's (and KV group's) its own, and each stored
chain segment is a lookup that stopped where the segment begins.

Each store is its own tenant's, for that life: a block stored under a salt that is not the chain's it
continues is kept under its own (a tenant that continued another's chain), and a lookup whose hits
lie in another namespace says where (`hits_cached_under`). A capture's segment says the block it
continues (`continues_block`) where it crosses; where its event names no salt (vLLM names it in a
chain's first block only) and the capture has tenants, it says whose chain it continues and that its
own tenant is unknown: a server that leaves salts out of its hashes lets any tenant continue it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import duckdb
import pyarrow as pa

from ..capture import explain_sql
from ..store import StoreError

# block_events kinds that change the prefix cache, as explain's kinds: a clear (one per block a reset
# of the prefix cache takes the hash from) empties the whole cache.
ENGINE_KINDS = {"cache": "store", "evict": "remove", "clear": "clear"}
UNKNOWN_TENANT = "unknown (its event names no salt)"
CAPTURE_ORDER = "step, replica, grp = -1, grp, pos"  # a capture's lookups in time order across replicas and groups
# Evidence keys in the order they are said, from the result's columns.
EVIDENCE = (
    ("tokens_after", "tokens_after"),
    ("preempted_at", "preempted_at"),
    ("stored_at", "stored_at"),
    ("removed_at", "removed_at"),
    ("before_steps", "before"),
    ("cached_under", "cached_under"),
    ("shared_tokens", "shared_tokens"),
    ("ours", "ours"),
    ("theirs", "theirs"),
    ("new_from_token", "new_from_token"),
    ("hits_cached_under", "hits_cached_under"),
)


@dataclass(frozen=True, slots=True)  # a capture's can be millions
class Explanation:
    request: str
    step: int
    hit_tokens: int
    stop_block: int
    stop_token: int
    reason: str
    evidence: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Contradictions:
    """What a capture says that cannot be so, by kind; explain leaves those events out."""

    removed_not_cached: int = 0
    stored_before_parent: int = 0
    sequence_back: int = 0

    def sentence(self) -> str | None:
        """One sentence for a reader, or None when the capture is consistent."""
        said = [
            _count(
                self.removed_not_cached,
                "removal",
                "of a block not cached (removed twice, or stored before the capture began)",
                "of blocks not cached (removed twice, or stored before the capture began)",
            ),
            _count(
                self.stored_before_parent,
                "block",
                "stored before its parent",
                "stored before their parent (left out, with what was stored under them)",
            ),
            _count(self.sequence_back, "message", "whose sequence number goes back", "whose sequence numbers go back"),
        ]
        said = [s for s in said if s]
        return None if not said else "The capture contradicts itself: " + "; ".join(said) + ". The rest is explained."


def _count(n: int, noun: str, one: str, many: str) -> str:
    return "" if not n else f"1 {noun} {one}" if n == 1 else f"{n:,} {noun}s {many}"


def explain_run(con: duckdb.DuckDBPyConnection, run_id: str,
                progress: explain_sql.Progress | None = None) -> list[Explanation]:
    """Every lookup of an engine run, or every stored chain segment of a capture, explained (by SQL, in
    this connection's temporary tables, dropped after); `progress` hears each stage begin."""
    head = con.execute("SELECT engine FROM runs WHERE run_id = ?", [run_id]).fetchone()
    if head is None:
        raise StoreError(f"no run {run_id!r}")
    if is_capture(con, run_id):
        return explain_capture(con, run_id, progress)
    sql = explain_sql.DuckSql(con)
    try:
        _engine_input(sql, run_id, int(json.loads(head[0] or "{}").get("block_size", 16)))
        explain_sql.explain(sql, progress)
        return [_explained(r["request"], r) for r in _rows(_answer(sql, "lid"))]
    finally:
        sql.close()


def explain_capture(con: duckdb.DuckDBPyConnection, run_id: str,
                    progress: explain_sql.Progress | None = None) -> list[Explanation]:
    """Every stored chain segment of a capture explained, from the connection's kv_events (the store's,
    or a connection's own view over a dataset registered in place)."""
    sql = explain_sql.DuckSql(con)
    try:
        _capture_input(sql, run_id)
        explain_sql.explain(sql, progress)
        sql.drop_steps()
        fleet, answer = _fleet(sql), _answer(sql, CAPTURE_ORDER)
    finally:
        sql.close()  # the steps' tables go before the answer becomes Python objects
    return _capture_explanations(answer, fleet)


def explain_from_result(con: duckdb.DuckDBPyConnection, run_id: str, files: str) -> list[Explanation]:
    """A capture's explanations from an explain_result another engine worked out (Spark on a cluster,
    written as Parquet `files`, a glob), named and evidenced as explain_capture names them. Hashes come
    back as Spark writes them (decimal(20,0)) or as DuckDB does (UBIGINT)."""
    sql = explain_sql.DuckSql(con)
    try:
        _capture_view(sql, run_id)
        cols = ", ".join(f"CAST({c} AS UBIGINT) AS {c}" if c in ("hash", "continues_block") else c
                         for c in explain_sql.RESULT_COLUMNS)
        sql.view("explain_result", f"SELECT {cols} FROM read_parquet('{files.replace(chr(39), chr(39) * 2)}')")
        fleet, answer = _fleet(sql), _answer(sql, CAPTURE_ORDER)
    finally:
        sql.close()
    return _capture_explanations(answer, fleet)


def _answer(sql: explain_sql.DuckSql, order: str) -> pa.Table:
    """explain_result in this order, columnar (a million lookups take tens of MB as Arrow, a GB as dicts)."""
    return sql.con.sql(f"SELECT {', '.join(explain_sql.RESULT_COLUMNS)} FROM explain_result ORDER BY {order}"
                       ).to_arrow_table()


def _rows(answer: pa.Table) -> Iterator[dict]:
    """The answer's rows as dicts, a batch at a time."""
    for batch in answer.to_batches(max_chunksize=10_000):
        yield from batch.to_pylist()


def contradictions(con: duckdb.DuckDBPyConnection, run_id: str) -> Contradictions:
    """What a capture's events say that cannot be so (an engine run's history is consistent by
    construction: its invariants are checked as it runs)."""
    if not is_capture(con, run_id):
        return Contradictions()
    sql = explain_sql.DuckSql(con)
    try:
        _capture_view(sql, run_id)
        return Contradictions(*sql.rows(explain_sql.CONTRADICTIONS)[0])
    finally:
        sql.close()


def is_capture(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    return bool(
        con.execute("SELECT count(*) FROM (SELECT 1 FROM kv_events WHERE run_id = ? LIMIT 1)", [run_id]).fetchone()[0]
    )


def _capture_view(sql: explain_sql.DuckSql, run_id: str) -> None:
    sql.view("capture_events", "SELECT * FROM kv_events WHERE run_id = '" + run_id.replace("'", "''") + "'")


def _capture_input(sql: explain_sql.DuckSql, run_id: str) -> None:
    _capture_view(sql, run_id)
    explain_sql.capture_inputs(sql.view)


def _namespace(salt: str, adapter: str) -> str:
    """What a lookup's blocks are keyed under: its salt, and its adapter when it has one (a block cached
    under another adapter is another namespace, as a salt is)."""
    return (
        f"CASE WHEN {adapter} IS NULL THEN {salt} WHEN {salt} IS NULL THEN 'adapter ' || {adapter} "
        f"ELSE {salt} || ' + adapter ' || {adapter} END"
    )


def _engine_input(sql: explain_sql.DuckSql, run_id: str, block_size: int) -> None:
    """The engine run's cache history (block_events), its lookups (cache_lookups) and each lookup's
    blocks of prompt tokens up to the one it stopped at, as explain's input (in DuckDB's SQL: an
    engine run lives in the store)."""
    args = {"run": run_id, "b": block_size}
    kinds = " ".join(f"WHEN '{k}' THEN '{v}'" for k, v in ENGINE_KINDS.items())
    changes = ", ".join(f"'{k}'" for k, v in ENGINE_KINDS.items() if v != "clear")
    clears = ", ".join([f"'{k}'" for k, v in ENGINE_KINDS.items() if v == "clear"] or ["''"])
    sql.table(
        "explain_input",
        f"""
        SELECT 'replica-0' AS replica, -1 AS grp, step, seq AS ev, 0 AS blk, CASE kind {kinds} END AS kind, hash,
               parent_hash AS parent, token_ids AS tokens,
               {_namespace("salt", "adapter")} AS salt, {_namespace("salt", "adapter")} AS chain_salt,
               true AS named, NULL::VARCHAR AS session, NULL::INTEGER AS bidx, $b::INTEGER AS block_size
        FROM block_events
        WHERE run_id = $run AND ((kind IN ({changes}) AND hash IS NOT NULL) OR kind IN ({clears}))""",
        args,
    )
    sql.table(
        "explain_lookups",
        f"""
        WITH adapters AS (
            SELECT r->>'id' AS request_id, r->>'adapter' AS adapter
            FROM (SELECT unnest(json_extract(workload, '$.requests[*]')) AS r FROM runs WHERE run_id = $run)),
        looked AS (
            SELECT c.step, c.request_id, c.salt, c.hit_tokens, a.adapter,
                   list_concat(coalesce(r.prompt_ids, []), coalesce(r.output_ids, []))[1:c.tokens] AS prompt
            FROM cache_lookups c
            LEFT JOIN requests r ON r.run_id = c.run_id AND r.request_id = c.request_id
            LEFT JOIN adapters a ON a.request_id = c.request_id
            WHERE c.run_id = $run)
        SELECT row_number() OVER (ORDER BY step, request_id) AS lid, 'replica-0' AS replica, -1 AS grp,
               request_id AS request, step, {_namespace("salt", "adapter")} AS salt, len(prompt) AS n_tokens,
               hit_tokens AS hit,
               (SELECT max(p.step) FROM block_events p WHERE p.run_id = $run AND p.kind = 'preempt'
                AND p.request_id = l.request_id AND p.step < l.step) AS preempted_at,
               $b::INTEGER AS block_size, prompt,
               floor(hit_tokens / $b)::BIGINT AS k, floor((len(prompt) - 1) / $b)::BIGINT AS usable
        FROM looked l""",
        args,
    )
    if not sql.rows("SELECT (SELECT count(*) FROM explain_input) + (SELECT count(*) FROM explain_lookups)")[0][0]:
        raise StoreError(
            f"run {run_id} has no cache lookups to explain (recorded before kvviz recorded them, or a "
            "run without the prefix cache's history)"
        )
    sql.table(
        "explain_lookup_blocks",
        """
        SELECT lid, j, prompt[j * $b + 1:(j + 1) * $b] AS tokens
        FROM (SELECT lid, prompt, unnest(range(0, CASE WHEN k < usable THEN k + 1 ELSE k END)) AS j
              FROM explain_lookups)""",
        {"b": block_size},
    )


def _evidence(row: dict) -> dict:
    evidence = {"note": "this block was cached when the lookup ran"} if row["reason"] == "unexplained" else {}
    evidence |= {key: row[col] for col, key in EVIDENCE if row[col] is not None}
    if row["continues_block"] is not None:  # a capture's segment: the chain it continues, where it is in question
        if row["tenant_unknown"]:
            evidence["continues_chain_of"] = row["continues_chain_of"]
        evidence["continues_block"] = f"{row['continues_block']:016x}"
        if row["tenant_unknown"]:
            evidence["tenant"] = UNKNOWN_TENANT
    return evidence


def _explained(request: str, row: dict) -> Explanation:
    return Explanation(
        request, row["step"], row["hit_tokens"], row["stop_block"], row["stop_token"], row["reason"], _evidence(row)
    )


def _fleet(sql: explain_sql.DuckSql) -> bool:
    """Does the capture have more than one replica (its lookups are then named by replica)?"""
    return (
        sql.rows(
            "SELECT count(DISTINCT coalesce(replica, 'replica-0')) FROM capture_events WHERE kind = 'BlockStored'"
        )[0][0]
        > 1
    )


def _capture_explanations(answer: pa.Table, fleet: bool) -> list[Explanation]:
    """A capture's lookups (the answer, in CAPTURE_ORDER), named by replica (when it has more than one,
    `fleet`) and KV group, then by session where the server says one (a conversation's turns) or by the
    block the segment begins (#n: its n-th store)."""

    def name(r: dict) -> str:
        part = ([r["replica"]] if fleet else []) + ([f"group-{r['grp']}"] if r["grp"] != -1 else [])
        own = r["session"] or f"chain-{r['hash']:016x}" + (f"#{r['nth']}" if r["nth"] > 1 else "")
        return "/".join([*part, own])

    return [_explained(name(r), r) for r in _rows(answer)]
