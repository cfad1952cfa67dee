"""Inspector views of an imported vLLM/SGLang KV-event capture: it holds block hashes, tokens and
salts, but no physical block ids and no attention, so it has no block map and no heatmap."""

from __future__ import annotations

import streamlit as st

from ..analysis import captures, leaks
from ..analysis.runs import RunInfo
from ..figures import captures as tree_fig
from ..figures import timeline


def render(con, info: RunInfo, view: str, step: int) -> None:
    st.info("This run is an imported KV-event capture: it shows the prefix tree, the cache over time and "
            "evictions. The events carry no physical block ids and no attention weights, so the block map and "
            "the heatmaps are not available for it.", icon=":material/info:")
    names = captures.replicas(con, info.run_id)
    if not names:
        st.info("None of this capture's events can be read: it stored nothing, or (see above) its dataset is "
                "no longer where it was registered.", icon=":material/info:")
        return
    if view == "Prefix tree":
        replica, group = None, None
        if len(names) > 1:  # the same hash on two replicas is two blocks: one replica's tree at a time
            replica = st.selectbox(f"Replica ({len(names)} in this capture)", names, key="insp_replica")
        kv_groups = captures.groups(con, info.run_id, replica)
        if len(kv_groups) > 1:  # and in two KV groups of a hybrid model
            group = st.selectbox(f"KV group ({len(kv_groups)} here)", kv_groups, key="insp_group")
        nodes = captures.prefix_tree(con, info.run_id, replica=replica, group=group)
        if nodes.empty:
            st.info("The capture stored no blocks.")
            return
        nodes = nodes[nodes.stored_step <= step]
        nodes = nodes.assign(removed_step=nodes.removed_step.where(nodes.removed_step <= step))  # not yet removed
        st.plotly_chart(tree_fig.prefix_tree(nodes), width="stretch", key="insp_tree")
        total = captures.stored_blocks(con, info.run_id, replica, step, group)
        shown = f"{len(nodes):,} blocks" if total == len(nodes) else f"the first {len(nodes):,} of {total:,} blocks"
        st.caption(f"{shown} stored up to message {step}" + (f" on {replica}" if replica else "") +
                   (f", KV group {group}" if group is not None else "") +
                   "; hollow: removed (evicted) by then. Colour: cache salt (tenant).")
    elif view == "Cache over time":
        cache = captures.cache_over_time(con, info.run_id)
        st.plotly_chart(timeline.cache_timeline(cache, current=step), width="stretch", key="insp_cache")
        width = int(cache.step.drop_duplicates().diff().max()) if cache.step.nunique() > 1 else 1
        lines = cache.series.nunique()
        st.caption((f"{lines} lines: each replica" + (", tier and KV group" if lines > len(names) else "") +
                    " on its own. " if lines > 1 else "") +
                   (f"Each bar sums {width:,} messages. " if width > 1 else "") +
                   "A store of a block already cached (a hit) and a removal of one not cached change nothing.")
    else:
        found = leaks.findings(con, info.run_id)
        if found.empty:
            st.info("No block hash was stored under two salts. A capture shows only the blocks a server "
                    "stored: one tenant reusing another's cached blocks stores nothing (unless the server "
                    "reports hits, kv_cache_report_mode=\"full\"), so this is not proof of isolation; "
                    "`python -m kvviz audit-timing` tests a server from outside.", icon=":material/info:")
        else:
            st.caption("cross_tenant: one block hash stored under two salts on one replica (request_id: the salt; "
                       "source_request: the salt that stored it first).")
            st.dataframe(found, hide_index=True, width="stretch")
