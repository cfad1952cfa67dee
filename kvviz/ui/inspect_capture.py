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
    if view == "Prefix tree":
        nodes = captures.prefix_tree(con, info.run_id)
        if nodes.empty:
            st.info("The capture stored no blocks.")
            return
        nodes = nodes[nodes.stored_step <= step]
        st.plotly_chart(tree_fig.prefix_tree(nodes), width="stretch", key="insp_tree")
        st.caption(f"{len(nodes)} blocks stored up to message {step}; hollow: removed (evicted) later. "
                   "Colour: cache salt (tenant).")
    elif view == "Cache over time":
        st.plotly_chart(timeline.cache_timeline(captures.cache_over_time(con, info.run_id)), width="stretch",
                        key="insp_cache")
    else:
        found = leaks.findings(con, info.run_id)
        if found.empty:
            st.success("No block hash was stored under two salts.", icon=":material/verified_user:")
        else:
            st.caption("cross_tenant: one block hash stored under two salts (request_id: the salt; "
                       "source_request: the salt that stored it first).")
            st.dataframe(found, hide_index=True, width="stretch")
