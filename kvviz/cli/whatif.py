"""`kvviz whatif`: a request trace replayed under prefix caches it never ran on (kvviz/whatif/): the hit
rate against capacity for each eviction policy and, with --tenants, what salting per tenant costs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import KvvizError
from .common import Subcommands, print_rows

if TYPE_CHECKING:
    from ..analysis.whatif_runs import RunTraces
    from ..whatif import Trace

DEFAULT_POLICIES = "lru,lfu,seed,newcomer,belady"


def cmd_whatif(args: argparse.Namespace) -> int:
    """The curve table on stdout (policy x capacity), progress on stderr, the rows to --out."""
    from ..whatif import as_table, assign_tenants, capacity_grid, curve, keyed, read_mooncake
    from ..whatif.curves import check_capacities
    from ..whatif.policies import check_policy

    policies = [check_policy(p.strip()) for p in args.policy.split(",") if p.strip()]
    if not policies:
        raise KvvizError("--policy names no policy")
    if args.points < 2:
        raise KvvizError(f"--points must be at least 2, got {args.points}")
    if args.tenants is not None and args.tenants < 1:
        raise KvvizError(f"--tenants must be at least 1, got {args.tenants}")
    if args.out and Path(args.out).suffix not in (".csv", ".parquet"):
        raise KvvizError(f"--out {args.out}: write .csv or .parquet")
    caps = check_capacities(args.capacity) if args.capacity else None
    if not Path(args.trace).exists():
        return _run(args, policies, caps)
    trace = read_mooncake(args.trace, block_size=args.block_size)
    caps = caps or capacity_grid(trace.distinct_blocks, args.points)
    print(f"{args.trace}: {trace.requests:,} requests, {trace.prompt_tokens:,} prompt tokens, {trace.lookups:,} "
          f"full-block lookups of {trace.distinct_blocks:,} distinct blocks ({trace.block_size} tokens each)")
    points = curve(trace, policies, caps, progress=_progress())
    rate = {(p.policy, p.capacity): f"{p.hit_rate:.2%}" for p in points}
    print_rows(["capacity", "tokens", *policies],
                [(_capacity(c, trace.distinct_blocks), f"{c * trace.block_size:,}", *(rate[p, c] for p in policies))
                 for c in caps], "table")
    if args.tenants:
        trace = assign_tenants(trace, args.tenants)
        for keying in ("tenant", "conversation"):
            points += curve(keyed(trace, keying), ["lru"], caps, keying=keying)
        _print_isolation(_dealt(trace), max(caps), f"{int(trace.conversation.max()) + 1:,} conversations dealt to "
                                                   f"{args.tenants} tenants in turn, each its salt")
    if args.out:
        table = as_table(points)
        if args.out.endswith(".csv"):
            import pyarrow.csv as pcsv

            pcsv.write_csv(table, args.out)
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, args.out)
        print(f"kvviz: whatif: {len(points)} rows written to {args.out}", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace, policies: list[str], caps: list[int] | None) -> int:
    """A run in the store (an engine run or a capture) replayed, its points kept as its whatif_points."""
    from ..analysis.runs import run_info
    from ..analysis.whatif_capacity import own_capacity
    from ..analysis.whatif_runs import compute, run_traces
    from ..store import RunStore

    if caps:
        raise KvvizError("--capacity applies to a trace file; a run is replayed at --points capacities and its own")
    store = RunStore.open(args.run_db)
    with store.read() as con:
        if not RunStore.has_run(con, args.trace):
            raise KvvizError(f"{args.trace}: no such trace file, and no run of that id in {store.path}")
        info = run_info(con, args.trace)
    points = compute(store, info, policies, args.points, progress=_progress())
    if not points:
        raise KvvizError(f"run {args.trace} has no lookup to replay (no request, or a capture without stored blocks)")
    rate = {(p.policy, p.capacity): f"{p.hit_rate:.2%}" for p in points}
    caps = sorted({p.capacity for p in points})
    with store.read() as con:
        own = own_capacity(con, info)
        rt = run_traces(con, info, content=True)
    mark = {own.blocks: " (own)" if own.known else " (at least own)"} if own else {}
    print_rows(["capacity", *policies], [(f"{c:,}{mark.get(c, '')}", *(rate[p, c] for p in policies)) for c in caps],
               "table")
    if own and not own.known:
        print(f"the events do not say the capture's cache size: it held at most {own.blocks:,} blocks at once on "
              f"the GPU{f' ({own.where})' if own.where else ''}, so it was at least that large")
    _print_isolation(rt, own.blocks if own else caps[-1], "each tenant its salt, as the run kept its blocks"
                     + (", shared keyed by the blocks' tokens" if info.has_kv_events else ""))
    if info.has_kv_events and not rt.unsalted and len(rt.tenants) > 1:
        print("\nwhat isolation costs needs the blocks' tokens: this capture's events carry none")
    print(f"kvviz: whatif: {len(points)} points kept in whatif_points (run {args.trace})", file=sys.stderr)
    return 0


def _dealt(trace: Trace) -> RunTraces:
    """A trace whose requests were dealt to tenants, as the runs the isolation replay takes: salted per
    tenant against shared, tenants named by number."""
    from ..analysis.whatif_runs import RunTraces
    from ..whatif import keyed

    return RunTraces(traces={"": keyed(trace, "tenant")}, keying="tenant",
                     tenants=[str(t) for t in range(int(trace.tenant.max()) + 1)], unsalted={"": trace})


def _print_isolation(rt: RunTraces, capacity: int, salted: str) -> None:
    """Per tenant, LRU's hit rate shared, salted and per conversation; then who would read whose blocks if
    shared. salted: what the salts are, said in the heading."""
    from ..analysis.whatif_isolation import isolation_costs

    found = isolation_costs(rt, capacity)
    if found is None:
        if len(rt.tenants) == 1:
            print(f"\nsalting: {salted}; one tenant only, so no cross-tenant reads to forbid and nothing to cost")
        return
    costs, reads = found
    print(f"\nsalting at capacity {_capacity(capacity, rt.distinct_blocks)} (lru), {salted}:")
    print_rows(["tenant", "prompt tokens", "shared", "per tenant", "loss", "per conversation", "loss"],
               [(c.tenant, f"{c.prompt_tokens:,}", f"{c.shared:.2%}", f"{c.salted:.2%}", f"{c.loss:.2%}",
                 f"{c.conversation:.2%}", f"{c.shared - c.conversation:.2%}") for c in costs.set_axis(
                   ["tenant", "prompt_tokens", "shared", "salted", "loss", "conversation"], axis=1).itertuples()],
               "table")
    if rt.untokened:
        print(f"blocks without tokens in the events: {rt.untokened:,} (keyed by their hash: never shared)")
    print(f"\ncross-tenant reads a shared cache allows: {int(reads.blocks.sum()):,} blocks")
    if not reads.empty:
        print_rows(["reader", "writer", "blocks", "tokens"],
                   [(r, w, f"{b:,}", f"{t:,}") for r, w, b, t in reads.itertuples(index=False)], "table")


def _capacity(blocks: int, distinct: int) -> str:
    return f"{blocks:,}" + (" (unbounded)" if blocks >= distinct else "")


def _progress() -> Callable[[str, int, int], None] | None:
    """Each per-capacity policy's progress, redrawn on stderr when it is a terminal."""
    if not sys.stderr.isatty():
        return None

    def said(policy: str, done: int, total: int) -> None:
        print(f"\rkvviz: whatif: {policy} {done}/{total} capacities", end="\n" if done == total else "",
              file=sys.stderr, flush=True)

    return said


def add_whatif(sub: Subcommands) -> None:
    p = sub.add_parser("whatif", help="a request trace replayed under other prefix caches: hit rate against "
                                      "capacity per eviction policy, and what salting per tenant costs")
    p.add_argument("trace", metavar="TRACE_OR_RUN", help="a Mooncake trace (JSONL: timestamp, input_length, "
                   "output_length, hash_ids), or the id of a run in --db (an engine run or a capture): its points "
                   "are kept in the store's whatif_points")
    p.add_argument("--db", dest="run_db", help="the run store a run id is read from (default $KVVIZ_DB, else "
                   "runs/kvviz.duckdb)")
    p.add_argument("--policy", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})")
    p.add_argument("--points", type=int, default=20, help="log-spaced capacities up to unbounded (default 20)")
    p.add_argument("--capacity", type=int, nargs="+", help="capacities in blocks instead of --points")
    p.add_argument("--block-size", type=int, default=512, help="tokens per hash id (default 512)")
    p.add_argument("--tenants", type=int, help="deal conversations to N tenants and show what salting costs")
    p.add_argument("--out", help="the rows, one per policy and capacity: .csv or .parquet")
    p.set_defaults(func=cmd_whatif)
