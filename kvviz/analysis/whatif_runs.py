"""A stored run replayed under other prefix caches (kvviz.whatif): the trace it is, and the curve points
kept in the store (whatif_points) so that a user can query them with SQL next to the run.

What a run's trace is:
- an engine run: each request's first lookup, in the order the cache saw them, its prompt's full blocks
  keyed by their tokens and the request's salt (so a salted run is replayed salted), capacity in the
  run's blocks, the run's own pool (num_blocks) marked;
- a capture: each BlockStored event on a device medium is one request's lookup, its chain from the
  root (the stored blocks after their cached ancestors, found through parent hashes), replayed per
  replica (each replica its own cache; a capacity is per replica and the hits of all are summed);
  only full blocks are known, so prompt tokens are full blocks x block size. A capture of requests that
  stored nothing (full hits without kv_cache_report_mode="full") does not show them: the replay sees the
  requests that the events name.
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
    cross_reads,
    curve,
    keyed,
    tenant_costs,
    trace_from_blocks,
)
from ..whatif.salting import conversations
from .runs import RunInfo

DEFAULT_POLICIES = ("lru", "lfu", "seed", "newcomer", "belady")
ALL_POLICIES = tuple(POLICIES)  # what the views offer
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class RunTraces:
    """The traces of one run, one per independent cache (a capture's replicas), keyed as the run keyed its
    blocks, and what the run had."""

    traces: dict[str, Trace]  # cache (replica) -> its trace
    own_capacity: int | None  # the run's own cache in blocks (per replica), where known
    tenants: list[str | None] = field(default_factory=list)  # an engine run's salts, by the traces' tenant ids
    prompt_tokens: int | None = None  # a request trace's own count (partial blocks too), where the capture has it
    unsalted: Trace | None = None  # an engine run's trace with every block shared, tenants kept

    @property
    def keying(self) -> str:
        """How the traces key their blocks, as the run did: per salt where any request had one."""
        return "tenant" if any(t is not None for t in self.tenants) else "shared"

    @property
    def distinct_blocks(self) -> int:
        return max((t.distinct_blocks for t in self.traces.values()), default=0)


def run_traces(con: duckdb.DuckDBPyConnection, info: RunInfo) -> RunTraces:
    """The run as traces a replay takes (see the module docstring)."""
    if info.has_kv_events:
        return _capture_traces(con, info.run_id)
    rows = con.execute(
        "SELECT any_value(r.prompt_ids), any_value(r.tenant), min(l.step) AS first FROM requests r "
        "JOIN cache_lookups l ON l.run_id = r.run_id AND l.request_id = r.request_id WHERE r.run_id = ? "
        "GROUP BY r.request_id "
        "ORDER BY first, r.request_id", [info.run_id]).fetchall()
    if not rows:
        return RunTraces(traces={}, own_capacity=None)
    bs = info.block_size
    ids = [[hash(tuple(p[i * bs:(i + 1) * bs])) for i in range(len(p) // bs)] for p, _, _ in rows]
    names = list(dict.fromkeys(t for _, t, _ in rows))
    tenant = np.array([names.index(t) for _, t, _ in rows], np.int64)
    shared = trace_from_blocks(ids, [len(p) for p, _, _ in rows], block_size=bs)
    shared = replace(shared, tenant=tenant, conversation=conversations(shared, system_ends=2))
    return RunTraces(traces={"": keyed(shared, "tenant")}, own_capacity=int(info.engine.get("num_blocks", 0)) or None,
                     tenants=names, unsalted=shared)


def _capture_traces(con: duckdb.DuckDBPyConnection, run_id: str) -> RunTraces:
    replicas = [r for (r,) in con.execute("SELECT DISTINCT replica FROM kv_events WHERE run_id = ? AND kind = "
                                          "'BlockStored' ORDER BY replica", [run_id]).fetchall()]
    traces = {}
    for replica in replicas:  # one replica's columns at a time: memory is the largest replica's
        cols = con.execute(
            # hashes shifted into BIGINT (a bijection of UBIGINT): numpy keeps them exact
            "SELECT step, event_index, CAST(block_hash::HUGEINT - 9223372036854775808 AS BIGINT) AS block_hash, "
            "coalesce(CAST(parent_hash::HUGEINT - 9223372036854775808 AS BIGINT), 0) AS parent_hash, "
            "parent_hash IS NULL AS root, coalesce(block_size, 16) AS block_size FROM kv_events "
            "WHERE run_id = ? AND replica IS NOT DISTINCT FROM ? AND kind = 'BlockStored' "
            "AND coalesce(medium, 'GPU') = 'GPU' ORDER BY step, event_index, block_index",
            [run_id, replica]).fetchnumpy()
        traces[str(replica)] = capture_trace(pd.DataFrame(cols))
    (said,) = con.execute("SELECT TRY_CAST(workload->>'prompt_tokens' AS BIGINT) FROM runs WHERE run_id = ?",
                          [run_id]).fetchone()
    return RunTraces(traces=traces, own_capacity=None, prompt_tokens=said)


def capture_trace(part: pd.DataFrame) -> Trace:
    """Each event's lookup: the ancestors of its first block (through parent hashes, to the root), then its
    blocks; in arrays: a block hash names its whole prefix, so the hashes are the keys (made dense)."""
    step, event = part.step.to_numpy(), part.event_index.to_numpy()
    hashes, parents, roots = part.block_hash.to_numpy(), part.parent_hash.to_numpy(), part.root.to_numpy()
    starts = np.flatnonzero(np.r_[True, (np.diff(step) != 0) | (np.diff(event) != 0)])
    uniq, key = np.unique(hashes, return_inverse=True)
    # each block's parent, from the row that first stored it: a row's parent hash, or the row before it
    first = np.unique(key, return_index=True)[1]
    named = np.searchsorted(uniq, parents).clip(0, len(uniq) - 1)
    known = ~roots & (uniq[named] == parents)
    parent = np.full(len(uniq), -1, np.int64)
    parent[key[first]] = np.where(known, named, -1)[first]
    depth = _depths(parent)  # ancestors of each block
    head = parent[key[starts]]  # the block each event continues (-1: the root)
    up = np.where(head >= 0, depth[head.clip(0)] + 1, 0)
    own = np.diff(np.r_[starts, len(hashes)])
    offsets = np.zeros(len(starts) + 1, np.int64)
    np.cumsum(up + own, out=offsets[1:])
    keys = np.empty(offsets[-1], np.int64)
    at, cur = offsets[:-1] + up - 1, head.copy()  # ancestors, filled from the nearest up
    while (live := cur >= 0).any():
        keys[at[live]] = cur[live]
        at, cur = at - 1, np.where(live, parent[cur.clip(0)], -1)
    fill = np.repeat(offsets[:-1] + up - starts, own) + np.arange(len(hashes))
    keys[fill] = key
    bs = int(part.block_size.iloc[0]) if len(part) else 16
    n = len(starts)
    return Trace(timestamp=np.zeros(n), input_length=(up + own) * bs, output_length=np.zeros(n, np.int64),
                 offsets=offsets, keys=keys, block_size=bs)


def _depths(parent: np.ndarray) -> np.ndarray:
    """How many ancestors each node of a forest has, by pointer doubling: each round adds the count of the
    node it jumps to and jumps twice as far, so the deepest chain takes log2 of its length in rounds."""
    depth, jump = (parent >= 0).astype(np.int64), parent.copy()
    while (live := jump >= 0).any():
        depth = depth + np.where(live, depth[jump.clip(0)], 0)
        jump = np.where(live, jump[jump.clip(0)], -1)
    return depth


def compute(store: RunStore, info: RunInfo, policies: Sequence[str] = DEFAULT_POLICIES, points: int = 20,
            progress: Progress | None = None) -> list[CurvePoint]:
    """The run's curve for each policy at `points` capacities (and its own), kept as its whatif_points
    (replacing any kept before); the points, summed over the run's caches."""
    with store.read() as con:
        rt = run_traces(con, info)
    if not rt.traces:
        return []
    caps = sorted(set(capacity_grid(rt.distinct_blocks, points)) | ({rt.own_capacity} if rt.own_capacity else set()))
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


def isolation_costs(rt: RunTraces, capacity: int) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """What the run's salts cost at one capacity (LRU), each tenant's hit rate with every block shared and
    as the run keyed them, and the reads of other tenants' blocks that sharing would have allowed; None
    for a run of one tenant (or a capture: its block hashes hold their salts, so they cannot be unsalted)."""
    if rt.unsalted is None or len(rt.tenants) < 2:
        return None
    name = {i: t or "(no salt)" for i, t in enumerate(rt.tenants)}
    costs = pd.DataFrame([{"tenant": name[c.tenant], "prompt tokens": c.prompt_tokens,
                           "hit rate shared": c.shared_hit_rate, "hit rate salted": c.hit_rate, "loss": c.loss}
                          for c in tenant_costs(rt.unsalted, capacity)])
    reads = pd.DataFrame([{"reader": name[r.reader], "would read blocks of": name[r.writer], "blocks": r.blocks,
                           "tokens": r.tokens} for r in cross_reads(rt.unsalted, capacity)],
                         columns=["reader", "would read blocks of", "blocks", "tokens"])
    return costs, reads


def request_trace(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """Whether the run is an imported request trace (Mooncake's format), not a KV-event capture."""
    row = con.execute("SELECT workload->>'format' = 'mooncake' FROM runs WHERE run_id = ?", [run_id]).fetchone()
    return bool(row and row[0])
