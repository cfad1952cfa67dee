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
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from ..capture import explain_sql
from ..store import StoreError

# block_events kinds that change the prefix cache, as explain's kinds: a clear (one per block a reset
# of the prefix cache takes the hash from) empties the whole cache.
ENGINE_KINDS = {"cache": "store", "evict": "remove", "clear": "clear"}
UNKNOWN_TENANT = "unknown (its event names no salt)"
READING = "reading the answer back"  # the stage after explain_sql.STAGES: the answer as columns, named
CACHED_NOTE = "this block was cached when the lookup ran"  # an unexplained miss's
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

def _literal(value: str) -> str:
    """A JSON string as an SQL string literal."""
    return "'" + json.dumps(value).replace("'", "''") + "'"


def _evidence_json() -> str:
    """A lookup's evidence as a JSON object, in SQL over explain_result: the keys of EVIDENCE that have a
    value, in that order, after a note for an unexplained miss; a capture's segment adds the chain it
    continues (its parent's hash, as hex) where it crosses tenants or its own tenant is unknown."""
    def said(name: str, value: str, when: str) -> str:
        return f"CASE WHEN {when} THEN '\"{name}\": ' || {value} END"

    crossing = "continues_block IS NOT NULL"
    unknown = f"{crossing} AND tenant_unknown"
    parts = [said("note", _literal(CACHED_NOTE), "reason = 'unexplained'"),
             *(said(name, f"to_json({col})", f"{col} IS NOT NULL") for col, name in EVIDENCE),
             said("continues_chain_of", "to_json(continues_chain_of)", unknown),
             said("continues_block", "'\"' || printf('%016x', continues_block) || '\"'", crossing),
             said("tenant", _literal(UNKNOWN_TENANT), unknown)]
    return "'{' || concat_ws(', ', " + ", ".join(parts) + ") || '}'"


EVIDENCE_JSON = _evidence_json()


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


# An answer's columns: Explanation's fields, the evidence as JSON text, and a capture lookup's time (its
# message's, on the publisher's clock; NULL for an engine run).
COLUMNS = ("request", "step", "hit_tokens", "stop_block", "stop_token", "reason", "evidence", "ts")


class Explanations(Sequence[Explanation]):
    """A run's explanations as an Arrow table of COLUMNS, Explanation objects made only for the rows read:
    a capture's are millions, tens of MB as columns and GBs as objects."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return _from_row(self.table.slice(i % len(self), 1).to_pylist()[0])

    def __iter__(self) -> Iterator[Explanation]:
        for batch in self.table.to_batches(max_chunksize=10_000):
            yield from map(_from_row, batch.to_pylist())

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Sequence) and len(self) == len(other)
                and all(a == b for a, b in zip(self, other, strict=True)))

    __hash__ = None  # equal by content, like a list

    def by_reason(self) -> Counter[str]:
        """How many lookups stopped for each reason (counted in the columns, not per object)."""
        counts = self.table.column("reason").value_counts().to_pylist()
        return Counter({c["values"]: c["counts"] for c in counts})

    def of_request(self, request: str) -> Explanations:
        return Explanations(self.table.filter(pc.equal(self.table.column("request"), request)))


def _from_row(row: dict) -> Explanation:
    return Explanation(row["request"], row["step"], row["hit_tokens"], row["stop_block"], row["stop_token"],
                       row["reason"], json.loads(row["evidence"]) if row["evidence"] else {})


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
                progress: explain_sql.Progress | None = None) -> Explanations:
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
        if progress:
            progress(READING, "")
        return _answer(sql, "request", "NULL", "lid")
    finally:
        sql.close()


def explain_capture(con: duckdb.DuckDBPyConnection, run_id: str,
                    progress: explain_sql.Progress | None = None) -> Explanations:
    """Every stored chain segment of a capture explained, from the connection's kv_events (the store's,
    or a connection's own view over a dataset registered in place)."""
    sql = explain_sql.DuckSql(con)
    try:
        _capture_input(sql, run_id)
        explain_sql.explain(sql, progress)
        sql.drop_steps()  # their memory is free before the answer is read
        if progress:
            progress(READING, "")
        return _capture_answer(sql)
    finally:
        sql.close()


def explain_from_result(con: duckdb.DuckDBPyConnection, run_id: str, files: str) -> Explanations:
    """A capture's explanations from an explain_result another engine worked out (Spark on a cluster,
    written as Parquet `files`, a glob), named and evidenced as explain_capture names them. Hashes come
    back as Spark writes them (decimal(20,0)) or as DuckDB does (UBIGINT)."""
    sql = explain_sql.DuckSql(con)
    try:
        _capture_view(sql, run_id)
        cols = ", ".join(f"CAST({c} AS UBIGINT) AS {c}" if c in ("hash", "continues_block") else c
                         for c in explain_sql.RESULT_COLUMNS)
        sql.view("explain_result", f"SELECT {cols} FROM read_parquet('{files.replace(chr(39), chr(39) * 2)}')")
        return _capture_answer(sql)
    finally:
        sql.close()


def _answer(sql: explain_sql.DuckSql, request: str, ts: str, order: str, joined: str = "") -> Explanations:
    """explain_result as COLUMNS, in this order: each lookup named by the expression `request`, its
    evidence as JSON and its time `ts` (over explain_result and what `joined` joins to it), all in SQL."""
    return Explanations(sql.con.sql(
        f"SELECT {request} AS request, step, hit_tokens, stop_block, stop_token, reason, {EVIDENCE_JSON} AS evidence, "
        f"{ts} AS ts FROM explain_result {joined} ORDER BY {order}").to_arrow_table())


def _capture_answer(sql: explain_sql.DuckSql) -> Explanations:
    """A capture's lookups in time order across replicas and groups, named by replica (when it has more
    than one) and KV group, then by session where the server says one (a conversation's turns) or by the
    block the segment begins (#n: its n-th store); each at its message's time."""
    replica = "replica" if _fleet(sql) else "NULL"
    name = (f"concat_ws('/', {replica}, CASE WHEN grp <> -1 THEN 'group-' || grp END, "
            "coalesce(nullif(session, ''), 'chain-' || printf('%016x', hash) || CASE WHEN nth > 1 THEN '#' || nth "
            "ELSE '' END))")
    times = "LEFT JOIN (SELECT step AS at, min(ts) AS ts FROM capture_events GROUP BY step) t ON t.at = step"
    return _answer(sql, name, "t.ts", CAPTURE_ORDER, times)


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


def _fleet(sql: explain_sql.DuckSql) -> bool:
    """Does the capture have more than one replica (its lookups are then named by replica)?"""
    return (
        sql.rows(
            "SELECT count(DISTINCT coalesce(replica, 'replica-0')) FROM capture_events WHERE kind = 'BlockStored'"
        )[0][0]
        > 1
    )
