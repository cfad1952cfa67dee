"""Inspector views of an imported vLLM/SGLang KV-event capture, on its time axis: a time range (a
slider, or drag across the activity chart) and what happened in it, aggregated so a capture of
millions of events draws hundreds of points. A capture holds block hashes, tokens and salts, but no
physical block ids and no attention, so it has no block map and no heatmap."""

from __future__ import annotations

from datetime import UTC, datetime

import pandas as pd
import streamlit as st

from ..analysis import capture_time, captures, cross_reads
from ..analysis.breaches import beside
from ..analysis.explained import contradiction_sentence, explain_seconds, explained_in, kept, reasons_per_interval
from ..analysis.runs import RunInfo
from ..analysis.whatif_runs import request_trace
from ..errors import StoreError
from ..figures import capture_time as time_fig
from ..figures import captures as tree_fig
from ..runners import explain_jobs
from . import capture_breaches, inspect_whatif
from .common import db_path, lookups_table, reader, store

VIEWS = ("Activity", "Occupancy", "Lifetimes", "Shared prefixes", "Prefix tree", "Cross-tenant", "What if")
PROGRESS_S = 1.0  # how often the progress of an explanation in the background is looked at


def render(info: RunInfo) -> None:
    with reader() as con:
        trace = request_trace(con, info.run_id)
        names = captures.replicas(con, info.run_id)
        span = capture_time.span(con, info.run_id) if names else None
        found = capture_breaches.read(con, info.run_id)
    st.info("This run is an imported request trace (Mooncake's format): one lookup per request, its full blocks "
            "stored after it as an unbounded cache would, hashes without tokens, times from the trace's start. No "
            "block ids, evictions or attention: the block map and heatmaps are not available, and its own capacity "
            "is unknown (What if replays it under any)." if trace else
            "This run is an imported KV-event capture. The events carry no physical block ids and no attention "
            "weights, so the block map and the heatmaps are not available for it.", icon=":material/info:")
    if span is None:
        st.info("None of this capture's events can be read: it stored nothing, or (see above) its dataset is "
                "no longer where it was registered.", icon=":material/info:")
        return
    capture_breaches.table(found)
    above = st.container()  # the explanation's progress, said here once the views have drawn
    a, b = _time_range(info.run_id, span, trace)
    if st.session_state.get("insp_view") not in VIEWS:
        st.session_state["insp_view"] = VIEWS[0]
    view = st.segmented_control("View", VIEWS, key="insp_view", label_visibility="collapsed") or VIEWS[0]
    capture_breaches.warn(found, view)
    if view == "Activity":  # its own readers
        _activity(info, span, a, b, found)
    elif view == "What if":  # the whole capture, not the range: it writes what it computes
        inspect_whatif.render(info)
    else:
        with reader() as con:
            if view == "Occupancy":
                _occupancy(con, info, span, a, b, found)
            elif view == "Lifetimes":
                _lifetimes(con, info, a, b, found)
            elif view == "Shared prefixes":
                _shared(con, info, span, a, b)
            elif view == "Prefix tree":
                _tree(con, info, names, a, b)
            else:
                _cross_tenant(con, info, span, a, b, found)
                _tier_salts(con, info)
    with above:  # started after the views' queries: the first view does not wait behind it
        _explanation(info)


def _time_range(run_id: str, span: capture_time.Span, trace: bool = False) -> tuple[float, float]:
    """The range chosen (publisher clock; a request trace's: seconds from its start), from the slider or a
    drag across the activity chart."""
    length = float(max(span.end - span.start, 0.001))
    if st.session_state.get("insp_range_for") != run_id or "insp_range" not in st.session_state:
        st.session_state.update(insp_range_for=run_id, insp_range=(0.0, length), insp_brushed=None)
    pending = st.session_state.pop("insp_range_pending", None)
    if pending is not None:  # a drag across the chart, applied before the slider is drawn
        st.session_state["insp_range"] = pending
    left, right = st.columns([6, 1])
    step = float(capture_time.interval_s(0.0, length, 1000))
    left.slider("Time range: seconds since the capture began", 0.0, length, key="insp_range", step=step,
                format="%.3f" if length < 10 else "%.1f")
    right.button("Whole capture", key="insp_range_all", icon=":material/zoom_out_map:",
                 on_click=lambda: st.session_state.update(insp_range=(0.0, length)))
    lo, hi = st.session_state["insp_range"]
    a, b = span.start + lo, span.start + hi
    st.caption(f"{a:,.3f} s to {b:,.3f} s from the trace's start ({hi - lo:,.3g} s of {length:,.3g} s)." if trace else
               f"{_clock(a)} to {_clock(b)} UTC on the publishers' clocks ({hi - lo:,.3g} s of {length:,.3g} s).")
    return a, b


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _activity(info: RunInfo, span: capture_time.Span, a: float, b: float, found: pd.DataFrame | None) -> None:
    width = capture_time.interval_s(a, b)
    with reader() as con:
        churn = capture_time.churn(con, info.run_id, a, b, width)
        hits_reported = capture_time.reports_hits(con, info.run_id)
        events = con.execute("SELECT count(*) FROM kv_events WHERE run_id = ?", [info.run_id]).fetchone()[0]
        is_kept = kept(con, info.run_id)
    if churn.empty:
        st.info("No block was stored or removed in this range.")
        return
    total = churn.sum(numeric_only=True)
    c = st.columns(4)
    c[0].metric("new blocks", f"{int(total.stored):,}")
    rate = capture_time.hit_ratio(total.hit_tokens, total.miss_tokens)
    if hits_reported:
        c[1].metric("hits", f"{int(total.hits):,}", help="stores of a block already cached: vLLM reports them with "
                    "kv_cache_report_mode=\"full\" (otherwise a capture sees no hits)")
        distorted = beside(found, "hit rate")
        c[2].metric("hit rate (tokens)" + (" :material/report:" if distorted else ""),
                    "-" if rate is None else f"{rate:.0%}", help=distorted)
    else:  # a 0 would say nothing was served from the cache, which the capture cannot tell
        unreported = ("This capture holds no repeated store of a cached block: its server did not report hits "
                      "(vLLM: kv_cache_report_mode=\"full\"), so the events cannot tell what the cache served.")
        c[1].metric("hits", "not reported", help=unreported)
        c[2].metric("hit rate (tokens)", "not reported", help=unreported)
    c[3].metric("evicted", f"{int(total.evicted):,}")
    if hits_reported:
        capture_breaches.caption(found, "hit rate")
    reasons = _reasons(info, a, b, width) if _explain_wanted(info, events, is_kept) and is_kept else None
    event = st.plotly_chart(time_fig.activity(churn, span.start, width, reasons), width="stretch",
                            key="insp_activity", on_select="rerun", selection_mode="box")
    st.caption(f"Each bar is {width:g} s" + (f", summed over {churn.replica.nunique()} replicas" if
                                             churn.replica.nunique() > 1 else "") +
               ". Drag across the chart to look at that time range.")
    if reasons is not None:
        _lookups(info, a, b)
    boxes = (event or {}).get("selection", {}).get("box", []) if event else []
    if boxes and boxes[0].get("x"):
        x0, x1 = sorted(float(x) for x in boxes[0]["x"][:2])
        lo, hi = max(0.0, x0), min(span.end - span.start, x1)
        if hi > lo and st.session_state.get("insp_brushed") != (x0, x1):
            st.session_state.update(insp_brushed=(x0, x1), insp_range_pending=(lo, hi))
            st.rerun()


def _explanation(info: RunInfo) -> None:
    """The first time a complete capture is opened its misses are explained in the background (one job
    per capture for every session of this process; the answer kept in the store for all, the CLI too):
    its progress while it runs, or why it failed with a button to try again."""
    job = explain_jobs.current(store(), info.run_id)
    if job is None or job.done:
        with reader() as con:
            if kept(con, info.run_id) or info.status != "complete":
                return
        job = explain_jobs.ensure(store(), info.run_id)
    if job.error is not None:
        st.error(f"{job.error} The capture's views are as they were; only the reasons are missing.",
                 icon=":material/error:")
        st.button("Explain again", key="insp_explain_retry", icon=":material/refresh:",
                  on_click=lambda: explain_jobs.retry(store(), info.run_id))
    elif not job.done:
        st.fragment(run_every=PROGRESS_S)(_progress)(job)


def _progress(job: explain_jobs.ExplainJob) -> None:
    """The job's progress bar; once it has ended, the page again (the reasons are there, or why not)."""
    if job.done:
        st.rerun(scope="app")
    p = job.progress()
    st.progress(p.fraction, text="Explaining why each stored chain missed the cache, in the background (once, kept "
                f"for every session; the views work meanwhile): {p.sentence()}.")


def _explain_wanted(info: RunInfo, events: int, is_kept: bool) -> bool:
    """The toggle: on once the capture's explanation is kept (worked out in the background the first time
    it was opened, or by the CLI)."""
    if is_kept:
        why = "Kept from when this capture was explained: why each stored chain was not served from the cache."
    elif info.status == "complete":
        why = ("Being worked out in the background (the progress bar above): for each stored chain, why it was not "
               "served from the cache: cold, evicted, reset (the cache was cleared), namespace (cached under another "
               f"salt), diverged, partial block. About {explain_seconds(events):,} s for this capture, once: the "
               "answer is kept for everyone.")
    else:
        why = "A capture is explained once it is complete."
    return st.toggle("Explain the misses (why each lookup stopped)", key="insp_explain", disabled=not is_kept,
                     help=why)


def _reasons(info: RunInfo, a: float, b: float, width: float) -> pd.DataFrame:
    """Misses (lookups) per interval and reason, from the kept explanation."""
    with reader() as con:
        return reasons_per_interval(con, info.run_id, a, b, width)


def _lookups(info: RunInfo, a: float, b: float) -> None:
    """The explained lookups of the range with their evidence: whose chain a segment continues, and
    that its own tenant is unknown where its event names no salt."""
    said = _contradictions(info)
    if said:
        st.warning(said, icon=":material/report:")
    with reader() as con:
        n, found = explained_in(con, info.run_id, a, b)
    if not n:
        return
    st.caption("Each stored chain segment of the range is a lookup that stopped where the segment begins"
               + (f" ({len(found):,} of {n:,} shown, the earliest)" if len(found) < n else "") +
               "; reasons and evidence as `python -m kvviz explain` gives them. Step: the capture's message.")
    st.dataframe(lookups_table(found), hide_index=True, width="stretch", key="insp_capture_lookups")


def _contradictions(info: RunInfo) -> str | None:
    """What the capture says that cannot be so, in a sentence: counted by the background explanation
    (nothing said while it counts: the page is drawn again when it ends), else once for every session of
    this process (a scan of its events, which do not change once imported)."""
    job = explain_jobs.current(store(), info.run_id)
    if job is not None and job.error is None:
        return job.contradictions if job.done else None
    return _contradictions_of(str(db_path()), info.run_id)


@st.cache_data(show_spinner="Counting what the capture's events contradict (once for every session)...",
               max_entries=64)
def _contradictions_of(db: str, run_id: str) -> str | None:
    try:
        return contradiction_sentence(store(), run_id)
    except StoreError:
        return None  # its dataset has gone since: the page says so above


def _occupancy(con, info: RunInfo, span: capture_time.Span, a: float, b: float, found: pd.DataFrame | None) -> None:
    split = st.radio("Split by", list(capture_time.SPLITS), horizontal=True, key="insp_split",
                     format_func={"replica": "replica", "tier": "tier (medium)", "tenant": "tenant (cache salt)"}.get)
    if split == "tenant" and not capture_time.measured(con, info.run_id):
        st.warning("This capture was imported before kvviz kept the tenant of each removed block: import it again "
                   "to split its occupancy by tenant.", icon=":material/history:")
        return
    width = capture_time.interval_s(a, b)
    df = capture_time.occupancy(con, info.run_id, a, b, width, split)
    st.plotly_chart(time_fig.occupancy(df, span.start, split, untold=capture_time.UNTOLD), width="stretch",
                    key="insp_occupancy")
    st.caption(f"Blocks cached at the end of each {width:g} s, stacked. A store of a block already cached (a hit) "
               "and a removal of one not cached change nothing; a replica's AllBlocksCleared or restart empties it; "
               "a block moved to another tier counts on the new one." +
               (" A block whose store event named no salt (vLLM names it in a chain's first block only) counts as "
                "its chain's, own tenant unknown." if split == "tenant" else ""))
    capture_breaches.caption(found, "occupancy")
    if split == "tenant":
        capture_breaches.caption(found, "tenant counts")


def _lifetimes(con, info: RunInfo, a: float, b: float, found: pd.DataFrame | None) -> None:
    if not capture_time.measured(con, info.run_id):
        st.warning("This capture was imported before kvviz measured lifetimes: import it again to see them.",
                   icon=":material/history:")
        return
    df = capture_time.distributions(con, info.run_id, a, b)
    if df.empty:
        st.info("No block was evicted or hit in this range, so there is nothing to measure.")
        return
    st.plotly_chart(time_fig.durations(df, capture_time.BINS_PER_DECADE), width="stretch", key="insp_durations")
    st.caption("Lifetime: from the store that cached a block to its eviction; idle: from its last use to its "
               "eviction (short idle times under pressure mean thrashing); reuse gap: from a use to the next hit "
               "(only with kv_cache_report_mode=\"full\"). Evictions and hits in the range, on the publishers' "
               "clocks; bins are tenths of a decade.")
    capture_breaches.caption(found, "lifetimes")


def _shared(con, info: RunInfo, span: capture_time.Span, a: float, b: float) -> None:
    top = capture_time.shared_prefixes(con, info.run_id, a, b)
    if top.empty:
        st.info("No block was stored more than once in this range: nothing was reused (or the server does not "
                "report hits: kv_cache_report_mode=\"full\").")
        return
    table = top.assign(block_hash=top.block_hash.map("{:016x}".format), first_ts=top.first_ts - span.start).rename(
        columns={"first_ts": "first seen (s)", "group_idx": "KV group"})
    table = table.drop(columns=[c for c, empty in (("KV group", top.group_idx.isna().all()),
                                                   ("sessions", not top.sessions.any())) if empty])
    st.caption("The blocks most reused in the range (hits first). Tenants counts the salts the events that stored "
               "or hit it name: more than one is reuse across tenants; a salt marked (inferred) is the chain's, given "
               "to a store whose event named none (its own tenant unknown). A shared prefix of several blocks shows "
               "as several rows. Pick a row for its chain and token ids.")
    picked = st.dataframe(table, hide_index=True, width="stretch", key="insp_shared", on_select="rerun",
                          selection_mode="single-row")
    rows = picked.selection.rows if picked else []
    if rows:
        row = top.iloc[rows[0]]
        group = None if pd.isna(row.group_idx) else int(row.group_idx)
        chain = capture_time.chain(con, info.run_id, row.replica, int(row.block_hash), group)
        st.caption(f"Its chain on {row.replica}, root first ({len(chain)} block{'s' if len(chain) > 1 else ''}; "
                   "token ids as the server sent them):")
        st.dataframe(chain.assign(block_hash=chain.block_hash.map("{:016x}".format)), hide_index=True,
                     width="stretch", key="insp_chain")


def _tree(con, info: RunInfo, names: list[str], a: float, b: float) -> None:
    replica, group = None, None
    if len(names) > 1:  # the same hash on two replicas is two blocks: one replica's tree at a time
        replica = st.selectbox(f"Replica ({len(names)} in this capture)", names, key="insp_replica")
    kv_groups = captures.groups(con, info.run_id, replica)
    if len(kv_groups) > 1:  # and in two KV groups of a hybrid model
        group = st.selectbox(f"KV group ({len(kv_groups)} here)", kv_groups, key="insp_group")
    how = st.radio("Show", ("most used, chains collapsed", "as stored, block by block"), horizontal=True,
                   key="insp_tree_how")
    where = (f" on {replica}" if replica else "") + (f", KV group {group}" if group is not None else "")
    if how.startswith("most used"):
        tree = captures.reuse_tree(con, info.run_id, a, b, replica, group)
        if tree.empty:
            st.info("No block was stored in this range.")
            return
        st.plotly_chart(tree_fig.reuse_tree(tree), width="stretch", key="insp_reuse_tree")
        shown = tree_fig.drawn(tree)
        deeper = f" ({len(tree) - len(shown):,} deeper: click a segment to open them)" if len(shown) < len(tree) else ""
        st.caption(f"The most used blocks of the range{where}, chains growing to the right: a segment's height is "
                   "its use (stores and hits), a chain of single children is one segment; click a segment to open its "
                   "subtree, the bar left of it to go back. Red: "
                   f"used by more than one tenant. {len(shown):,} segment{'' if len(shown) == 1 else 's'} of "
                   f"{int(shown.blocks.sum()):,} blocks drawn{deeper}.")
        return
    since, step = capture_time.steps_in(con, info.run_id, a, b)
    nodes = captures.prefix_tree(con, info.run_id, replica=replica, group=group, since=since)
    nodes = nodes[nodes.stored_step <= step]
    if nodes.empty:
        st.info("No block was stored in this range.")
        return
    nodes = nodes.assign(removed_step=nodes.removed_step.where(nodes.removed_step <= step))  # not yet removed
    st.plotly_chart(tree_fig.prefix_tree(nodes), width="stretch", key="insp_tree")
    total = captures.stored_blocks(con, info.run_id, replica, step, group, since)
    shown = f"All {len(nodes):,} blocks" if total == len(nodes) else f"The first {len(nodes):,} of {total:,} blocks"
    st.caption(f"{shown} stored in the range (messages {since} to {step}){where}; hollow: removed (evicted) by "
               "its end. Colour: cache salt (tenant); diamonds: blocks whose store event named no salt, in the "
               "colour of the chain they continue (vLLM names the salt in a chain's first block only): their own "
               "tenant is unknown.")


def _cross_tenant(con, info: RunInfo, span: capture_time.Span, a: float, b: float,
                  found: pd.DataFrame | None) -> None:
    """Blocks one tenant stored and another stored or hit: the chart in the range (the tenants the stream
    names; those only inferred on demand), the findings of the whole capture below."""
    inferred = st.toggle("Also the blocks shared only through a tenant inferred from its chain", key="insp_inferred",
                         help="vLLM names the salt in a chain's first block only: a store continuing a chain is given "
                         "the chain's salt by the import, but its own tenant is unknown. Such blocks are no finding.")
    shared = capture_time.cross_tenant(con, info.run_id, a, b, inferred=inferred)
    st.markdown(f"**{shared.named:,}** block{'' if shared.named == 1 else 's'} of this range served more than one "
                f"tenant the stream names; **{shared.inferred:,}** more carry a second salt only by inference (a "
                "store whose event names no salt, given the salt of the chain it continues: its own tenant unknown).")
    capture_breaches.caption(found, "tenant counts")
    if not shared.events.empty:
        st.plotly_chart(time_fig.cross_tenant(shared.events, span.start), width="stretch", key="insp_cross_tenant")
        drawn = len(shared.events[["replica", "block_hash"]].drop_duplicates())  # a row per block on a replica
        total = shared.named + (shared.inferred if inferred else 0)  # as the counts above: per replica
        st.caption((f"The {drawn} most used of the {total:,} drawn. " if drawn < total else "")
                   + "A salt is meant to keep tenants' blocks apart (vLLM's cache_salt): one hash stored under two "
                   "salts means one cache entry served "
                   "both, which is what a timing side channel reads. Circles: stored new; diamonds: hits reported "
                   "again (kv_cache_report_mode=\"full\"); hollow grey: the event named no salt (tenant unknown; "
                   "the hover names the chain it continues).")
    segments = capture_time.untold_segments(con, info.run_id, a, b)
    untold = capture_time.untold_restores(con, info.run_id, a, b)
    if segments:
        them = "them" if sum(segments.values()) > 1 else "it"
        restores = f" {untold:,} of their stores put back a block evicted earlier." if untold else ""
        st.warning(f"{_untold(segments)}: the capture cannot tell which tenant stored {them}.{restores} vLLM names "
                   "the salt in a chain's first block only, so the import gives each the salt of the chain it "
                   "continues; on a server that leaves the salt out of its hashes, another tenant's request may have "
                   "stored it. `python -m kvviz explain` (or *Explain the misses* in the Activity view) says, per "
                   "stored segment, whose chain it continues.", icon=":material/help:")
    findings = captures.cross_tenant_findings(con, info.run_id)
    if findings.empty:
        st.info("No block hash was stored under two salts the stream names. A capture shows only the blocks a "
                "server stored: one tenant reusing another's cached blocks stores nothing (unless the server "
                "reports hits, kv_cache_report_mode=\"full\"), so this is not proof of isolation; "
                "`python -m kvviz audit-timing` tests a server from outside.", icon=":material/info:")
    else:
        st.caption("Findings of the whole capture: each block hash stored or hit under a second salt its event "
                   "names, on one replica, the message where it was, and the salt that stored it first.")
        st.dataframe(findings, hide_index=True, width="stretch", key="insp_capture_findings",
                     column_config={"tenant": "tenant (salt)", "stored_first_by": "stored first by",
                                    "block_hash": "block hash"})


def _tier_salts(con, info: RunInfo) -> None:
    """The capture's cross_tier_salt findings: blocks kept salted in one tier and unsalted in another."""
    st.subheader("Salts across tiers")
    found = captures.tier_salts(con, info.run_id)
    if found.empty:
        st.caption("No block hash is kept with its salt in one tier (medium) and without it in another (a capture "
                   "naming one medium has nothing to compare).")
        return
    blocks, crossed = int(found.blocks.sum()), found[found.others.map(len) > 0]
    st.error(f"**cross_tier_salt**: {blocks:,} block hash{'es' if blocks > 1 else ''} kept with a salt in one tier "
             "and without it in another, on " + ", ".join(sorted(set(found.replica))) + ": that tier keys them "
             "without the salt, so any tenant whose prompt reaches them is served another's block."
             + (" Hits there were named for tenants other than the salt's: "
                + ", ".join(sorted({t for ts in crossed.others for t in ts})) + "." if len(crossed) else ""),
             icon=":material/layers_clear:")
    st.plotly_chart(time_fig.tier_salts(found), width="stretch", key="insp_tier_salts")
    st.dataframe(found.drop(columns=["others", "group_idx"] if found.group_idx.isna().all() else ["others"]),
                 hide_index=True, width="stretch", key="insp_tier_salt_findings",
                 column_config={"salted_medium": "salted in", "unsalted_medium": "unsalted in",
                                "first_blocks": "first blocks", "served": "hits named",
                                "first_step": "first at message"})
    st.caption("One row per replica, pair of tiers and salt (SQL: cross_tier_salts holds every block hash). A copy "
               "is unsalted where the stream says so: its store names no salt and begins a chain, or continues one "
               "cached without a salt in that tier. Hits named: the tenants whose hits that tier served.")


def _untold(segments: dict[str, int], named: int = 3) -> str:
    """'3 stored segments continue tenant-a's chain, naming no salt': a clause for each of the `named`
    busiest chains' tenants, the rest summed."""
    busiest = sorted(segments.items(), key=lambda kv: -kv[1])
    clauses = [f"{n:,} stored segment{'s' if n > 1 else ''} continue{'' if n > 1 else 's'} "
               f"{cross_reads.tenant(t)}'s chain" for t, n in busiest[:named]]
    if rest := busiest[named:]:
        clauses.append(f"and {sum(n for _, n in rest):,} more continue those of {len(rest)} other tenant"
                       f"{'s' if len(rest) > 1 else ''}")
    return ", ".join(clauses) + ", naming no salt"
