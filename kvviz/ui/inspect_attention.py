"""Inspector, Attention view: the layer x head grid of foreign mass and one request's heatmap."""

from __future__ import annotations

import numpy as np
import streamlit as st

from ..analysis import attention, cross_reads
from ..analysis.runs import RunInfo
from ..figures import attention as fig

NO_REQUEST_YET = ("No request has finished yet: a request's heatmap is shown once it is written, when it finishes "
                  "(or when the run ends).")


def render(con, info: RunInfo, step: int) -> None:
    layers, heads = attention.grid_shape(con, info.run_id)
    if not info.requests:
        st.info(NO_REQUEST_YET if info.recording else "This run has no requests.",
                icon=":material/pending:" if info.recording else None)
        return
    if st.session_state.get("insp_request") not in info.requests:
        st.session_state["insp_request"] = info.requests[0]
    c1, c2 = st.columns([2, 3])
    request = c1.selectbox("Request", info.requests, key="insp_request")
    whole = c2.radio("Foreign mass over", ("this step", "the whole run"), horizontal=True, key="insp_grid_scope")
    left, right = st.columns([2, 5])
    with left:
        if layers:
            cells = attention.leak_grid(con, info.run_id, None if whole == "the whole run" else step, request)
            head = st.session_state.get("insp_head")
            selected = (st.session_state.get("insp_layer"), head) if head not in (None, attention.HEAD_MEAN) else None

            def clicked() -> None:
                points = st.session_state["insp_grid"]["selection"]["points"]
                cell = fig.cell_at(points[0]) if points else None
                if cell is not None:
                    st.session_state.update(insp_layer=cell[0], insp_head=cell[1])

            st.plotly_chart(fig.leak_grid(cells, layers, heads, selected, f"{request}: max foreign mass"),
                            key="insp_grid", on_select=clicked, selection_mode="points", width="stretch")
            if whole == "this step" and not (cells.max_foreign > 0).any():  # a blank grid is an answer: say it
                st.caption(f"{request} put no weight on another request's or a stale key at step {step}: every "
                           "cell is 0. The heatmap beside it counts every step so far; *the whole run* shows where "
                           f"{request} leaked at any step.")
            st.caption("Click a cell to zoom into that layer and head.")
        else:
            st.info("The oracle recorded no leak metrics for this run.")
    with right:
        _heatmap(con, info, step, request, layers, heads)


def _heatmap(con, info: RunInfo, step: int, request: str, layers: int, heads: int) -> None:
    if not info.has_attention:
        st.info("This run recorded no attention rows (it ran with attention recording off), so there is no "
                "heatmap; the grid still shows the oracle's metrics.", icon=":material/visibility_off:")
        return
    if st.session_state.get("insp_layer") is None or st.session_state["insp_layer"] >= max(layers, 1):
        st.session_state["insp_layer"] = layers // 2
    if st.session_state.get("insp_head") not in [attention.HEAD_MEAN, *range(heads)]:
        st.session_state["insp_head"] = attention.HEAD_MEAN
    c1, c2, c3 = st.columns(3)
    layer = c1.number_input("Layer", 0, max(0, layers - 1), key="insp_layer")
    head = c2.selectbox("Head", [attention.HEAD_MEAN, *range(heads)], key="insp_head",
                        format_func=lambda h: "mean of heads" if h == attention.HEAD_MEAN else f"head {h}")
    upto = c3.radio("Queries", ("every step so far", "this step"), key="insp_upto", horizontal=True)
    view = attention.attention_view(con, info.run_id, request, step, int(layer), int(head), info.block_size,
                                    upto=upto == "every step so far", shared_axis=info.isolation == "masked")
    if view is None:
        when = "up to" if upto == "every step so far" else "at"
        st.info(f"No attention row of {request} was recorded {when} step {step}: it computed nothing then, or "
                "recording skipped it.", icon=":material/info:")
        return
    if head != attention.HEAD_MEAN and view.head == attention.HEAD_MEAN:
        st.caption(f"Head {head} of layer {layer} was not recorded at these steps (default recording keeps every "
                   "head of the first, middle and last layers and of layers where a leak was seen): showing the "
                   "mean of heads. To see every head, run again with "
                   "attention recorded 'all' (Run page) or `--attention all`.")
    shown = "mean of heads" if view.head == attention.HEAD_MEAN else f"head {view.head}"
    leak = float(np.max(view.foreign_mass)) if view.foreign_mass.size else 0.0
    title = fig.heatmap_title(request, step, layer, shown, leak, cross_reads.sentence(view.cross_reads))
    mark = view.row_of(step, st.session_state.get("insp_position"))
    st.plotly_chart(fig.attention_heatmap(view.weights, view.classes, view.query_labels, view.key_labels,
                                          view.key_owners, title, mark), width="stretch", key="insp_heatmap")
    note = " Rows or columns were merged (max) to fit." if view.binned else ""
    st.caption("Blue: the request's own keys (or exact copies: the same tokens at the same positions, as a shared "
               "prefix gives). Purple: exact copies another tenant wrote (a prefix block shared across tenants: no "
               "leak, a trust boundary crossed; their labels end [tenant]). Red: another request's keys. Orange: "
               "stale keys (a freed block's old contents). Grey: keys the query could not see (future or masked). "
               "Key labels are writer:position token, coloured by writer, as the slot held it when the request last "
               "read it (a slot reused since says what was read); lines mark where the writer changes; a black "
               f"frame marks the query at the position chosen (a finding's, when you came from one).{note}")
