"""The KV-event contract linter: what a consumer of a vLLM/SGLang KV-event stream (llm-d's indexer,
Dynamo's router, kvviz's own views) silently trusts, checked on every capture import and by
`kvviz lint`. A breach is a finding with its count, first occurrence and replica, never a refusal:
the rest of the stream still says a great deal, and the count says how far to trust what it says.

Every check is a scan of columns the row builder (rows.py) keeps, so the linter costs a few seconds
at ten million events: one aggregate over the run's rows grouped by replica and medium, one window
over its messages (read from the capture's Parquet files, where even a batch without events has a
row), and a join of the few stores whose parent was not cached against the stores after them.
docs/capture-format.md says what each kind distorts downstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from .capture_file import DEFAULT_REPLICA

# kind -> what it is, in a few words (the CLI's and the views' label)
KINDS = {
    "token_count": "token_ids disagree with block_hashes x block_size",
    "remove_unstored": "a block removed that was not stored",
    "stored_twice": "a block stored again without a removal",
    "parent_after_child": "a parent stored after its child",
    "seq_gap": "sequence numbers skip (lost messages)",
    "seq_back": "sequence numbers go back",
    "never_removes": "the replica stores and never removes",
    "salt_mixed": "salts on some chains and not on others",
    "medium_removed_only": "a medium named only on removals",
}
# Kinds that a healthy stream can show too (a short capture of a server whose cache has not filled removes
# nothing): reported, but they fail no check (`kvviz lint` exits 0 on them alone) and raise no alarm.
ADVISORY = frozenset({"never_removes"})
# kind -> the figures it distorts (the views say it beside them)
DISTORTS = {
    "token_count": "these blocks have no tokens: their text, the explained misses (diverged) and token counts",
    "remove_unstored": "occupancy and lifetimes (a removal of a block not cached changes nothing here, where a "
                       "consumer may drop a copy it still needs)",
    "stored_twice": "the hit rate and occupancy (a second store of a cached block counts as a hit; a consumer that "
                    "counts copies sees one more)",
    "parent_after_child": "the prefix tree and the explained misses (the child's chain is cut where its parent "
                          "was missing; a radix-tree router drops it)",
    "seq_gap": "every count (lost messages hold stores, hits and removals no view sees): the hit rate, occupancy, "
               "lifetimes and cross-tenant findings",
    "seq_back": "every count after it (the messages may be repeats, or another publisher's)",
    "never_removes": "occupancy and lifetimes (nothing is ever evicted here, so a consumer's index only grows)",
    "salt_mixed": "the tenants (chains begun without a salt are shared by every tenant) and the cross-tenant view",
    "medium_removed_only": "occupancy per tier (such removals match no store, so the blocks they remove stay cached "
                           "here)",
}
ORDER = list(KINDS)


@dataclass(frozen=True)
class Breach:
    """One kind of breach on one replica: how often, and where it first happened."""
    kind: str
    replica: str
    count: int
    first_step: int  # the message (the capture's arrival order)
    first_seq: int | None
    first_ts: float | None
    detail: str


@dataclass(frozen=True)
class Source:
    """Where the linter reads a capture's messages (every one, a batch without events too): its Parquet
    files. `renumber`: steps are made dense, as a copied import numbers them; `evidence`: the files carry
    the columns rows.py keeps for the linter (a dataset written before them does not)."""
    files: tuple[Path, ...]
    hive: bool
    renumber: bool = False
    evidence: bool = True

    @classmethod
    def of(cls, files: list[Path], hive: bool, renumber: bool = False) -> Source:
        names = pq.read_schema(files[0]).names if files else []
        return cls(tuple(files), hive, renumber, "parent_cached" in names)


def lint_run(con: duckdb.DuckDBPyConnection, run_id: str, source: Source) -> list[Breach]:
    """Every breach of the run's capture, by kind (in ORDER) and replica."""
    found = _messages(con, source) + _events(con, run_id, source.evidence)
    return sorted(found, key=lambda b: (ORDER.index(b.kind), b.replica))


def keep(con: duckdb.DuckDBPyConnection, run_id: str, breaches: list[Breach]) -> None:
    """The run's breaches into capture_breaches (what was there for it before is replaced)."""
    con.execute("DELETE FROM capture_breaches WHERE run_id = ?", [run_id])
    if breaches:
        con.executemany("INSERT INTO capture_breaches (run_id, kind, replica, count, first_step, first_seq, first_ts, "
                        "detail) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [(run_id, b.kind, b.replica, b.count, b.first_step, b.first_seq, b.first_ts, b.detail)
                         for b in breaches])


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _files_sql(source: Source) -> str:
    files = "[" + ", ".join(_quote(str(f)) for f in source.files) + "]"
    replica = "replica" if source.hive else _quote(DEFAULT_REPLICA)
    hive = ", hive_partitioning = true, hive_types = {'replica': VARCHAR}" if source.hive else ""
    return (f"SELECT {replica} AS replica, restart, seq, step, ts, event_index, block_index "
            f"FROM read_parquet({files}{hive}, union_by_name = true)")


MESSAGES = """
WITH rows AS ({files}),
firsts AS (SELECT replica, restart, seq, {step} AS step, ts FROM rows
           WHERE event_index = 0 AND coalesce(block_index, 0) = 0),
m AS (SELECT *, lag(seq) OVER (PARTITION BY replica, restart ORDER BY step) AS before FROM firsts)
SELECT replica,
       coalesce(sum(seq - before - 1) FILTER (seq > before + 1), 0) AS lost,
       arg_min([step, before, seq], step) FILTER (seq > before + 1) AS gap_at,
       arg_min(ts, step) FILTER (seq > before + 1) AS gap_ts,
       count(*) FILTER (seq <= before) AS back,
       arg_min([step, before, seq], step) FILTER (seq <= before) AS back_at,
       arg_min(ts, step) FILTER (seq <= before) AS back_ts
FROM m GROUP BY replica
"""


def _messages(con: duckdb.DuckDBPyConnection, source: Source) -> list[Breach]:
    """Sequence numbers that skip (messages lost between the publisher and the capture) or go back
    within one publisher's life (the capture counts a restart where it saw one)."""
    if not source.files:
        return []
    step = "CAST(dense_rank() OVER (ORDER BY step) - 1 AS BIGINT)" if source.renumber else "step"
    out = []
    for replica, lost, gap_at, gap_ts, back, back_at, back_ts in con.execute(
            MESSAGES.format(files=_files_sql(source), step=step)).fetchall():
        if lost:
            s, before, seq = gap_at
            out.append(Breach("seq_gap", replica, int(lost), int(s), int(seq), gap_ts,
                              f"seq {before} then {seq}: {seq - before - 1:,} message{'s' if seq - before > 2 else ''} "
                              "lost there"))
        if back:
            s, before, seq = back_at
            out.append(Breach("seq_back", replica, int(back), int(s), int(seq), back_ts,
                              f"seq {before} then {seq}" + (" (repeated)" if seq == before else "")))
    return out


# The run's rows as the checks read them.
ROWS = """
SELECT coalesce(replica, 'replica-0') AS replica, coalesce(medium, '(none)') AS medium, kind, step, seq, ts,
       event_index, block_index, block_hash, parent_hash, salt, coalesce(repeat, false) AS rep, tokens_given,
       parent_cached, block_size
FROM kv_events WHERE run_id = $run
"""
# name -> the rows it counts. One scan counts them all per replica and medium; the first row of a count
# that is a breach is looked up after it (a clean capture looks up none).
CHECKS = {
    "stored": "kind = 'BlockStored' AND NOT rep",
    "removed": "kind = 'BlockRemoved'",
    "cleared": "kind = 'AllBlocksCleared'",
    "unfit": "tokens_given IS NOT NULL AND block_index = 0",  # one row per event
    "unstored": "kind = 'BlockRemoved' AND rep",
    "again": "kind = 'BlockStored' AND rep",
    "after_hits": "parent_cached AND block_index > 0",  # a new block after hits in its event: hits are reported
    "orphans": "NOT parent_cached",
    "salted": "kind = 'BlockStored' AND NOT rep AND parent_hash IS NULL AND salt IS NOT NULL",  # a chain's root
    "unsalted": "kind = 'BlockStored' AND NOT rep AND parent_hash IS NULL AND salt IS NULL",
}
COUNTS = (f"WITH ev AS ({ROWS}) SELECT replica, medium, "
          + ", ".join(f"count(*) FILTER ({cond}) AS {name}" for name, cond in CHECKS.items())
          + " FROM ev GROUP BY ALL ORDER BY replica, medium")


def _first_row(con: duckdb.DuckDBPyConnection, run_id: str, check: str, replica: str,
               medium: str | None = None) -> dict:
    """The earliest row a check counts on a replica (and medium)."""
    where = f"replica = $replica{' AND medium = $medium' if medium is not None else ''} AND ({CHECKS[check]})"
    cur = con.execute(f"WITH ev AS ({ROWS}) SELECT step, seq, ts, event_index AS ev, block_hash AS hash, "
                      f"tokens_given AS given, block_size AS size FROM ev WHERE {where} "
                      "ORDER BY step, event_index, block_index LIMIT 1",
                      {"run": run_id, "replica": replica} | ({"medium": medium} if medium is not None else {}))
    (row,) = cur.fetchall()  # to the end: nothing is left open on the connection
    return dict(zip([d[0] for d in cur.description], row, strict=True))


# Stores whose parent was not cached, whose parent the same replica, group and medium stored later.
ORPHANS = """
WITH o AS (
    SELECT coalesce(replica, 'replica-0') AS replica, restart, group_idx, medium, step, event_index, seq, ts,
           block_hash, parent_hash
    FROM kv_events WHERE run_id = $run AND parent_cached = false),
s AS (
    SELECT coalesce(replica, 'replica-0') AS replica, restart, group_idx, medium, step, event_index, block_hash
    FROM kv_events WHERE run_id = $run AND kind = 'BlockStored' AND NOT coalesce(repeat, false)
      AND block_hash IN (SELECT parent_hash FROM o)),
late AS (
    SELECT o.replica, o.step, o.seq, o.ts, o.block_hash, o.parent_hash, min(s.step) AS parent_step
    FROM o JOIN s ON s.replica = o.replica AND s.block_hash = o.parent_hash
        AND s.restart IS NOT DISTINCT FROM o.restart AND s.group_idx IS NOT DISTINCT FROM o.group_idx
        AND s.medium IS NOT DISTINCT FROM o.medium
        AND (s.step > o.step OR s.step = o.step AND s.event_index > o.event_index)
    GROUP BY ALL)
SELECT replica, count(*), arg_min([step, parent_step], step), arg_min(seq, step), arg_min(ts, step),
       arg_min([block_hash, parent_hash], step)
FROM late GROUP BY replica
"""


def _events(con: duckdb.DuckDBPyConnection, run_id: str, evidence: bool) -> list[Breach]:
    rows = con.execute(COUNTS, {"run": run_id}).df()
    out: list[Breach] = []
    for replica, media in rows.groupby("replica", sort=True):
        out += _replica(con, run_id, replica, media, evidence)
    if evidence and rows.orphans.sum():
        for replica, n, steps, seq, ts, hashes in con.execute(ORPHANS, {"run": run_id}).fetchall():
            out.append(Breach("parent_after_child", replica, int(n), int(steps[0]), seq, ts,
                              f"block {int(hashes[0]):016x} stored at message {steps[0]}, its parent "
                              f"{int(hashes[1]):016x} at message {steps[1]}"))
    return out


def _breach(kind: str, replica: str, count: int, at: dict, detail: str) -> Breach:
    return Breach(kind, replica, int(count), int(at["step"]), at["seq"], at["ts"], detail)


def _replica(con: duckdb.DuckDBPyConnection, run_id: str, replica: str, media, evidence: bool) -> list[Breach]:
    """The breaches of one replica, from its counts (a row per medium)."""
    out: list[Breach] = []
    total = media.sum(numeric_only=True)

    def first(check: str) -> dict:
        return _first_row(con, run_id, check, replica)

    if evidence and total.unfit:
        at = first("unfit")
        ((blocks,),) = con.execute("SELECT count(*) FROM kv_events WHERE run_id = ? AND coalesce(replica, 'replica-0') "
                                   "= ? AND step = ? AND event_index = ?",
                                   [run_id, replica, at["step"], at["ev"]]).fetchall()
        size = "no usable block_size" if at["size"] is None else f"block_size {at['size']}"
        out.append(_breach("token_count", replica, total.unfit, at, f"event {at['ev']} of seq {at['seq']}: "
                           f"{at['given']} token_ids for {blocks} block hash{'es' if blocks != 1 else ''} of {size}"))
    if total.unstored:
        at = first("unstored")
        out.append(_breach("remove_unstored", replica, total.unstored, at,
                           f"block {int(at['hash']):016x} removed while not cached here"))
    if evidence and total.again and not total.after_hits:  # no event reports hits ahead of new blocks
        at = first("again")
        out.append(_breach("stored_twice", replica, total.again, at,
                           f"block {int(at['hash']):016x} stored again while cached, and no event reports hits"))
    if total.stored and not total.removed and not total.cleared:
        out.append(_breach("never_removes", replica, total.stored, first("stored"),
                           f"{int(total.stored):,} blocks stored, none removed"))
    mixed = media[(media.salted > 0) & (media.unsalted > 0)]  # per medium: a tier without salts is cross_tier_salt
    if len(mixed):
        at = min((_first_row(con, run_id, "unsalted", replica, m) for m in mixed.medium), key=lambda a: a["step"])
        unsalted, chains = int(mixed.unsalted.sum()), int((mixed.salted + mixed.unsalted).sum())
        out.append(_breach("salt_mixed", replica, unsalted, at,
                           f"{unsalted:,} of {chains:,} chains begun without a salt on "
                           f"{', '.join(mixed.medium)} (the first: block {int(at['hash']):016x})"))
    if total.stored:
        stored = ", ".join(media.medium[media.stored > 0])
        for medium, removed in zip(*media[(media.removed > 0) & (media.stored == 0)][["medium", "removed"]].T.values,
                                   strict=True):
            out.append(_breach("medium_removed_only", replica, removed,
                               _first_row(con, run_id, "removed", replica, medium),
                               f"medium {medium} on {int(removed):,} removals, none on a store (stores name "
                               f"{stored})"))
    return out
