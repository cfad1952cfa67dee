"""A stored run replayed under other prefix caches (kvviz.whatif): the trace it is, and the curve points
kept in the store (whatif_points) so that a user can query them with SQL next to the run.

What a run's trace is:
- an engine run: each request's first lookup, in the order the cache saw them, its prompt's full blocks
  keyed by their tokens and the request's salt (so a salted run is replayed salted), capacity in the
  run's blocks, the run's own pool (num_blocks) a point (a capture's: the least it can have been,
  whatif_capacity.py);
- a capture: each BlockStored event on a device medium is one request's lookup, its chain from the
  root (the stored blocks after their cached ancestors, found through parent hashes), replayed per
  replica (each replica its own cache; a capacity is per replica and the hits of all are summed);
  only full blocks are known, so prompt tokens are full blocks x block size. A capture of requests that
  stored nothing (full hits without kv_cache_report_mode="full") does not show them: the replay sees the
  requests that the events name. Asked for its content (the salting replay), each event is also the
  tenant its salt names, and its blocks are keyed by their tokens too (whatif_content.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import duckdb
import numpy as np
import pandas as pd

from ..store import RunStore
from ..whatif import (
    POLICIES,
    CurvePoint,
    Trace,
    as_table,
    capacity_grid,
    curve,
    keyed,
    trace_from_blocks,
)
from ..whatif.salting import conversations
from .runs import RunInfo
from .whatif_capacity import own_capacity
from .whatif_capture import capture_trace
from .whatif_content import with_content

DEFAULT_POLICIES = ("lru", "lfu", "seed", "newcomer", "belady")
ALL_POLICIES = tuple(POLICIES)  # what the views offer
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class RunTraces:
    """The traces of one run, one per independent cache (a capture's replicas), keyed as the run keyed its
    blocks, and what the run had."""

    traces: dict[str, Trace]  # cache (replica) -> its trace
    keying: str = "shared"  # how the traces key their blocks, as the run did: "tenant" where a request had a salt
    tenants: list[str | None] = field(default_factory=list)  # the salts, by the traces' tenant ids
    prompt_tokens: int | None = None  # a request trace's own count (partial blocks too), where the capture has it
    unsalted: dict[str, Trace] = field(default_factory=dict)  # per cache, blocks keyed by their tokens alone
    untokened: int = 0  # a capture's blocks without tokens: keyed by their hash in `unsalted` too

    @property
    def distinct_blocks(self) -> int:
        return max((t.distinct_blocks for t in self.traces.values()), default=0)


def run_traces(con: duckdb.DuckDBPyConnection, info: RunInfo, *, content: bool = False) -> RunTraces:
    """The run as traces a replay takes (see the module docstring); content: a capture's tenants and its
    blocks keyed by their tokens as well (an engine run has them always)."""
    if info.has_kv_events:
        return _capture_traces(con, info.run_id, content)
    rows = con.execute(
        "SELECT any_value(r.prompt_ids), any_value(r.tenant), min(l.step) AS first FROM requests r "
        "JOIN cache_lookups l ON l.run_id = r.run_id AND l.request_id = r.request_id WHERE r.run_id = ? "
        "GROUP BY r.request_id "
        "ORDER BY first, r.request_id", [info.run_id]).fetchall()
    if not rows:
        return RunTraces(traces={})
    bs = info.block_size
    ids = [[hash(tuple(p[i * bs:(i + 1) * bs])) for i in range(len(p) // bs)] for p, _, _ in rows]
    names = list(dict.fromkeys(t for _, t, _ in rows))
    tenant = np.array([names.index(t) for _, t, _ in rows], np.int64)
    shared = trace_from_blocks(ids, [len(p) for p, _, _ in rows], block_size=bs)
    shared = replace(shared, tenant=tenant, conversation=conversations(shared, system_ends=2))
    return RunTraces(traces={"": keyed(shared, "tenant")}, tenants=names, unsalted={"": shared},
                     keying="tenant" if any(t is not None for t in names) else "shared")


def _capture_traces(con: duckdb.DuckDBPyConnection, run_id: str, content: bool = False) -> RunTraces:
    replicas = [r for (r,) in con.execute("SELECT DISTINCT replica FROM kv_events WHERE run_id = ? AND kind = "
                                          "'BlockStored' ORDER BY replica", [run_id]).fetchall()]
    traces, parts = {}, {}
    for replica in replicas:  # one replica's columns at a time: memory is the largest replica's
        cols = con.execute(
            # hashes shifted into BIGINT (a bijection of UBIGINT): numpy keeps them exact
            "SELECT step, event_index, CAST(block_hash::HUGEINT - 9223372036854775808 AS BIGINT) AS block_hash, "
            "coalesce(CAST(parent_hash::HUGEINT - 9223372036854775808 AS BIGINT), 0) AS parent_hash, "
            "parent_hash IS NULL AS root, coalesce(block_size, 16) AS block_size"
            # an event's tenant is its first row's salt: the others' need not be materialised
            f"{', CASE WHEN block_index = 0 THEN salt END AS salt' if content else ''} "
            f"FROM kv_events WHERE run_id = ? AND replica IS NOT DISTINCT FROM ? AND kind = 'BlockStored' "
            "AND coalesce(medium, 'GPU') = 'GPU' ORDER BY step, event_index, block_index",
            [run_id, replica]).fetchnumpy()
        part = pd.DataFrame(cols)
        traces[str(replica)] = capture_trace(part)
        if content:
            parts[str(replica)] = part
    (said,) = con.execute("SELECT TRY_CAST(workload->>'prompt_tokens' AS BIGINT) FROM runs WHERE run_id = ?",
                          [run_id]).fetchone()
    if not content:
        return RunTraces(traces=traces, prompt_tokens=said)
    c = with_content(con, run_id, traces, parts)
    return RunTraces(traces=c.traces, prompt_tokens=said, tenants=c.tenants, unsalted=c.unsalted,
                     untokened=c.untokened)


def compute(store: RunStore, info: RunInfo, policies: Sequence[str] = DEFAULT_POLICIES, points: int = 20,
            progress: Progress | None = None) -> list[CurvePoint]:
    """The run's curve for each policy at `points` capacities (and its own, known or inferred), kept as its
    whatif_points (replacing any kept before); the points, summed over the run's caches."""
    with store.read() as con:
        rt = run_traces(con, info)
        own = own_capacity(con, info)
    if not rt.traces:
        return []
    caps = sorted(set(capacity_grid(rt.distinct_blocks, points)) | ({own.blocks} if own else set()))
    n = len(rt.traces)

    def overall(i: int) -> Progress | None:  # each replica's capacities as a share of the whole run's
        return None if progress is None else lambda p, done, total: progress(p, i * total + done, n * total)

    per_cache = [curve(t, policies, caps, keying=rt.keying, progress=overall(i))
                 for i, t in enumerate(rt.traces.values())]
    summed = [sum_points([pts[i] for pts in per_cache]) for i in range(len(per_cache[0]))]
    if rt.prompt_tokens:  # an imported request trace: its prompts' partial blocks count, as `whatif FILE` counts them
        summed = [replace(p, prompt_tokens=rt.prompt_tokens, hit_rate=p.tokens_saved / rt.prompt_tokens)
                  for p in summed]
    table = as_table(summed)
    with store.write() as con:
        con.execute("DELETE FROM whatif_points WHERE run_id = ?", [info.run_id])
        con.register("points", table)
        con.execute("INSERT INTO whatif_points BY NAME SELECT ? AS run_id, * FROM points", [info.run_id])
        con.unregister("points")
    return summed


def sum_points(points: list[CurvePoint]) -> CurvePoint:
    """One point of several independent caches (replicas): counts added, the rate re-divided."""
    first = points[0]
    if len(points) == 1:
        return first
    hits, lookups = sum(p.hits for p in points), sum(p.lookups for p in points)
    saved, prompt = sum(p.tokens_saved for p in points), sum(p.prompt_tokens for p in points)
    return CurvePoint(policy=first.policy, keying=first.keying, capacity=first.capacity, hits=hits, lookups=lookups,
                      tokens_saved=saved, prompt_tokens=prompt, hit_rate=saved / prompt if prompt else 0.0)


def stored_points(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """The points kept for a run, by policy and capacity."""
    return con.execute("SELECT policy, keying, capacity, hits, lookups, tokens_saved, prompt_tokens, hit_rate "
                       "FROM whatif_points WHERE run_id = ? ORDER BY policy, keying, capacity", [run_id]).df()


def request_trace(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """Whether the run is an imported request trace (Mooncake's format), not a KV-event capture."""
    row = con.execute("SELECT workload->>'format' = 'mooncake' FROM runs WHERE run_id = ?", [run_id]).fetchone()
    return bool(row and row[0])
