"""What if: the run replayed under prefix caches it never ran on (kvviz.whatif), any run, engine or
capture: the hit rate each eviction policy would have had at each capacity, computed on demand with
progress, kept in the store (whatif_points) and drawn against capacity."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ..analysis.runs import RunInfo, run_info
from ..analysis.whatif_capacity import OwnCapacity, own_capacity
from ..analysis.whatif_isolation import isolation_costs
from ..analysis.whatif_runs import (
    ALL_POLICIES,
    DEFAULT_POLICIES,
    compute,
    request_trace,
    run_traces,
    stored_points,
)
from ..figures import whatif as fig
from .common import EMPTY, db_path, reader, store

HELP = ("The run's lookups replayed, one request at a time in the order the cache saw them, under caches of other "
        "sizes and eviction policies: a request is served up to its first uncached full block, then stores its "
        "blocks. LRU evicts as vLLM's free queue does; LFU by use counts; the seed's advice keeps long prefixes "
        "longer; newcomer is LRU in which blocks never seen before enter cold; Belady evicts the block used "
        "furthest in the future (the optimum no online policy reaches).")


def render(info: RunInfo) -> None:
    st.caption(HELP)
    left, mid, right = st.columns([6, 2, 1.5], vertical_alignment="bottom")  # five policy chips fit
    policies = left.multiselect("Policies", list(ALL_POLICIES), default=list(DEFAULT_POLICIES), key="wi_policies",
                                format_func=lambda p: fig.POLICY_NAMES.get(p, p))
    points = mid.number_input("Capacities", 4, 60, 20, key="wi_points",
                              help="log-spaced from 4 blocks to the unbounded cache, with the run's own")
    with reader() as con:
        kept = stored_points(con, info.run_id)
        trace = request_trace(con, info.run_id)
    go = right.button("Compute again" if not kept.empty else "Compute", type="primary", key="wi_go",
                      icon=":material/query_stats:", disabled=not policies)
    if go:
        kept = _compute(info, policies, int(points))
    if kept.empty:
        st.info("Not computed yet for this run: choose the policies and press Compute (a run of thousands of "
                "requests takes seconds; Belady and the others replay once per capacity).", icon=":material/info:")
        return
    shared = kept[kept.keying == kept.keying.iloc[0]]  # one keying kept: the run's own (salted where it was)
    own = _own(str(db_path()), info.run_id)
    unbounded = int(shared.capacity.max())
    st.plotly_chart(fig.hit_rate_curve(shared, own_capacity=own.blocks if own else None, unbounded=unbounded,
                                       block_size=None if info.has_kv_events else info.block_size,
                                       inferred=bool(own and not own.known)),
                    width="stretch", key="wi_curve")
    st.markdown(_sentence(shared, own) + (" Blocks are keyed by each request's salt, as the run kept them."
                                          if shared.keying.iloc[0] == "tenant" else ""))
    if own and not own.known:
        st.caption(f"The events do not say this capture's cache size: {own.where or 'it'} held at most "
                   f"{own.blocks:,} blocks at once on the GPU, so its cache was at least that large (marked "
                   "*at least*); how much larger they cannot tell, as a cache that never filled removes nothing.")
    if info.has_kv_events and not trace:
        st.caption("A capture's capacity is per replica (each replica its own cache; their hits summed). Only full "
                   "blocks are known, and a request that stored nothing (a full hit without kv_cache_report_mode="
                   "\"full\") is not in the events, so the replay sees the requests the events name.")
    elif trace:
        st.caption("A request trace: one lookup per request, in the trace's order; the share is of all its prompt "
                   "tokens, partial blocks too, as `python -m kvviz whatif TRACE.jsonl` counts them.")
    _isolation(info, own.blocks if own else unbounded, own)
    with st.expander("The points, and the SQL that reads them"):
        st.dataframe(kept, hide_index=True, width="stretch", placeholder=EMPTY)
        st.code(f"SELECT * EXCLUDE (run_id) FROM whatif_points WHERE run_id = '{info.run_id}' "
                "ORDER BY policy, capacity", language="sql")


def _compute(info: RunInfo, policies: list[str], points: int) -> pd.DataFrame:
    bar = st.progress(0.0, text="replaying...")

    def progress(policy: str, done: int, total: int) -> None:
        at = policies.index(policy)
        bar.progress((at + done / total) / len(policies), text=f"{fig.POLICY_NAMES.get(policy, policy)}: "
                                                               f"{done} of {total} replays (capacities x caches)")

    compute(store(), info, policies, points, progress)
    bar.empty()
    with reader() as con:
        return stored_points(con, info.run_id)


def _sentence(points: pd.DataFrame, own: OwnCapacity | None) -> str:
    """What the curve says, in one line: at the run's own capacity, known or the least it can have been
    (or the middle of the range), which policy serves most, against LRU and the bound."""
    caps = sorted(points.capacity.unique())
    mark = own.blocks if own else None
    at = mark if mark in caps else caps[len(caps) // 2]
    row = points[points.capacity == at].set_index("policy").hit_rate
    online = row.drop("belady", errors="ignore")
    best = online.idxmax() if not online.empty else None
    said = ("this run's cache" if own.known else "the least this capture's cache can have been, the most blocks "
            "it held at once") if at == mark else "the middle of the range: the run's own cache size is not known"
    parts = [f"At **{at:,} blocks** ({said})"]
    if "lru" in row:
        parts.append(f"LRU serves {row['lru']:.1%} of prompt tokens")
    if best is not None and best != "lru":
        parts.append(f"{fig.POLICY_NAMES.get(best, best)} {row[best]:.1%}")
    if "belady" in row:
        parts.append(f"the optimum {row['belady']:.1%}")
    top = points[points.capacity == caps[-1]].hit_rate.max()
    return ", ".join(parts) + f"; an unbounded cache {top:.1%}."


@st.cache_data(max_entries=16, show_spinner=False)
def _own(db: str, run_id: str) -> OwnCapacity | None:
    """The run's own cache, known or inferred (a scan of a capture's occupancy: once per run)."""
    with reader() as con:
        return own_capacity(con, run_info(con, run_id))


@st.cache_data(max_entries=16, show_spinner="Replaying the run with every block shared, salted and per "
                                            "conversation (once per run)...")
def _costs(db: str, run_id: str, capacity: int) -> tuple[pd.DataFrame, pd.DataFrame, int] | None:
    """isolation_costs of the run (a capture's blocks keyed by their tokens too), and its blocks without tokens."""
    with reader() as con:
        rt = run_traces(con, run_info(con, run_id), content=True)
    found = isolation_costs(rt, capacity)
    return None if found is None else (*found, rt.untokened)


def _isolation(info: RunInfo, capacity: int, own: OwnCapacity | None) -> None:
    """What the run's salts cost: each tenant's hit rate with every block shared against as salted, and
    the reads of other tenants' blocks that sharing would have allowed (LRU at the run's own capacity)."""
    found = _costs(str(db_path()), info.run_id, capacity)
    if found is None:
        if info.has_kv_events and _salts(info.run_id) > 1:
            st.caption("What isolation costs needs the blocks' tokens: this capture's events carry none, and its "
                       "hashes hold their salts, so what a shared cache would have merged cannot be told.")
        return
    table, reads, untokened = found
    where = ("this run's cache" if own.known else "at least this capture's cache") if own and own.blocks == capacity \
        else "unbounded"
    st.markdown(f"**What isolation costs** at {capacity:,} blocks ({where}, LRU): each tenant's share of prompt "
                "tokens served with every block shared across tenants (keyed by its tokens alone), salted as this "
                "run kept them, and salted per tenant and conversation.")
    left, right = st.columns([3, 2])
    left.plotly_chart(fig.isolation_cost(table), width="stretch", key="wi_isolation")
    right.dataframe(table, hide_index=True, width="stretch", placeholder=EMPTY, column_config={
        c: st.column_config.NumberColumn(format="percent") for c in table.columns if c.startswith(("hit", "loss"))})
    if untokened:
        st.caption(f"Blocks without tokens in the events: {untokened:,} (keyed by their hash, so never shared).")
    if reads.empty:
        st.caption("Sharing would have let no tenant read another's blocks: the salts cost nothing here.")
    else:
        st.markdown(f"Sharing would have let tenants read {int(reads.blocks.sum()):,} blocks computed by another "
                    "tenant: what the salts forbid.")
        st.dataframe(reads, hide_index=True, width="stretch")


def _salts(run_id: str) -> int:
    with reader() as con:
        return con.execute("SELECT count(DISTINCT salt) FROM kv_events WHERE run_id = ? AND kind = 'BlockStored'",
                           [run_id]).fetchone()[0]
