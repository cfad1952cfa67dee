"""Inspector, Leaks and Requests views: leak over time, the findings (click one to jump to it),
divergence from the isolated run, and what each request generated."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import streamlit as st

from ..analysis import cross_reads, leaks, runs
from ..analysis.runs import RunInfo
from ..figures import timeline
from .common import EMPTY

NO_FINDINGS_YET = "No findings yet: a run's findings are written when it ends."


def render(con, info: RunInfo, step: int, focus: Callable[[leaks.Focus, str | None], None]) -> None:
    over_time = leaks.leak_over_time(con, info.run_id)
    if not over_time.empty:
        st.plotly_chart(timeline.leak_timeline(over_time, step), width="stretch", key="insp_timeline")
    found = _shown(leaks.findings(con, info.run_id))
    st.subheader(f"Findings ({len(found)})")
    said = cross_reads.sentence(cross_reads.from_store(con, info.run_id))
    if said:  # the header says why they move no figure
        st.markdown(f":violet-badge[:material/domain_disabled: cross_tenant] {said}")
    if found.empty and info.recording:  # not a clean run: its findings are not written yet
        st.info(NO_FINDINGS_YET, icon=":material/pending:")
    elif found.empty:
        st.success("No findings: every attention weight of every request stayed on its own tokens.",
                   icon=":material/verified_user:")
    else:
        def jump_to(row: int) -> None:
            focus(leaks.focus_of(found.iloc[row].to_dict()), "Attention")

        def clicked() -> None:
            rows = st.session_state["insp_findings"]["selection"]["rows"]
            if rows:
                jump_to(rows[0])

        st.caption("Click a finding to jump to its step, request, layer and head. Kinds: **foreign**, weight on "
                   "another request's keys (source_request); **stale**, on a slot not written since its block was "
                   "reallocated; **duplicate**, two visible keys for one position (the weights may all be own, the "
                   "output still differs); **cross_tenant**, a block another tenant wrote (the same content, "
                   "under another salt) that request_id read from step to last_step, in every layer (no layer, "
                   "head, position or mass), one row per block; "
                   "**normalisation** and **non_finite**, weights that do not sum to 1 or are not numbers; "
                   "**kernel_mismatch**, a kernel that returns no weights (transformers' sdpa_paged) whose output "
                   "is not that of the weights kvviz recomputed for it; "
                   "**telemetry_mismatch**, a reply whose cached-token count (mass) is not what its first forward "
                   "was served (position: where that forward started; source_request: whose K/V it was). "
                   "**mass**: the share of the query's attention on such keys at that layer and head (for "
                   "duplicate and non_finite, 1 marks it; for normalisation, how far the weights are from 1; for "
                   "kernel_mismatch, how far the outputs are apart, in tolerances).")
        st.dataframe(found, hide_index=True, width="stretch", on_select=clicked, selection_mode="single-row",
                     key="insp_findings", height=min(400, 38 + 35 * len(found)), placeholder=EMPTY)
        for line in telemetry_sentences(found):  # its columns hold counts, not a place and a mass: said in words
            st.markdown(f":orange-badge[:material/receipt_long: telemetry_mismatch] {line}")
        heaviest = found.mass.notna().iloc[0]  # a cross-tenant read carries no mass: the first is no heaviest
        st.button("Go to the heaviest finding" if heaviest else "Go to the first finding", key="insp_top_finding",
                  on_click=jump_to, args=(0,), icon=":material/my_location:")
    div = leaks.divergence(con, info.run_id)
    if not div.empty:
        st.subheader("Divergence from each request run alone")
        st.caption("leak: the oracle saw foreign or stale attention in this request (its output may still match: "
                   "first_divergent_step says where it first changed, if it did); divergence: the output moved with "
                   "no foreign attention; batch_variance: tiny logit differences from batching, no leak; identical: "
                   "the same logits.")
        st.dataframe(div, hide_index=True, width="stretch", placeholder=EMPTY)
    render_entropy(con, info)


def telemetry_sentences(found: pd.DataFrame) -> list[str]:
    """Each telemetry_mismatch finding in words: what the reply said against what the oracle saw served
    (position: the tokens its first forward was served; mass: the cached tokens its reply reported)."""
    out = []
    for r in found[found.kind == "telemetry_mismatch"].head(20).to_dict("records"):
        served = "nothing" if pd.isna(r["position"]) else f"{int(r['position'])} prompt tokens"
        whose = "" if pd.isna(r["source_request"]) or not r["source_request"] else f" ({r['source_request']}'s K/V)"
        said = "no count" if pd.isna(r["mass"]) else f"{int(r['mass'])} cached tokens"
        out.append(f"{r['request_id']}'s reply reported {said}, but its first forward (step {int(r['step'])}) was "
                   f"served {served} from the cache{whose}.")
    return out


def _shown(found: pd.DataFrame) -> pd.DataFrame:
    """The findings as the table shows them: a cross-tenant read is a block over a range of steps, so
    its block and steps come first and it has no position (the first query that read the block says
    nothing of the block)."""
    first = ["kind", "request_id", "step", "last_step", "block", "source_request"]
    return found.assign(position=found.position.mask(found.kind == "cross_tenant"))[
        first + [c for c in found.columns if c not in first]]


def render_entropy(con, info: RunInfo) -> None:
    """The seed's section 2.3: under a correct mask, entropy tells whether the model uses the distant
    history at all, and should rise with the length of the context while the leak rate stays 0."""
    layers = leaks.layer_count(con, info.run_id)
    if not layers:
        return
    st.subheader("Positional entropy")
    layer = st.selectbox("layer", ["all", *range(layers)], key="insp_entropy_layer",
                         format_func=lambda v: "mean of all layers" if v == "all" else f"layer {v}")
    df = leaks.entropy_by_position(con, info.run_id, None if layer == "all" else layer)
    st.plotly_chart(timeline.entropy_by_position(df), width="stretch", key="insp_entropy")
    trend = leaks.entropy_trend(df)
    st.caption("How spread each query's attention is over the keys it may see, in nats (the mean over heads), "
               "by query position; a prefill chunk's queries sit at their mean position. The seed expects it to "
               "rise with position while the leak rate stays 0. Per request: entropy at its first and last "
               "position and the rank correlation with position (+1: it only rises).")
    st.dataframe(trend.round(3), hide_index=True, width="stretch", placeholder=EMPTY)


def render_requests(con, info: RunInfo) -> None:
    df = runs.requests_frame(con, info.run_id)
    # the engine's "no token yet" (-1): a request cancelled or refused before its first token has no such step
    df["first_token_step"] = df.first_token_step.astype("Int64").mask(df.first_token_step < 0)
    wide = {"text": st.column_config.TextColumn("text", width="large"),
            "prompt": st.column_config.TextColumn("prompt", width="medium")}
    st.dataframe(df, hide_index=True, width="stretch", column_config=wide, placeholder=EMPTY)
    with st.expander("Prompts and generated texts in full"):
        for r in df.to_dict("records"):
            prompt = f"{r['prompt']}\n--- generated ---\n" if isinstance(r.get("prompt"), str) else ""
            st.markdown(f"**{r['request_id']}**")
            st.code(prompt + (r["text"] or f"(nothing: {r['finish_reason'] or 'no token'})"), language=None,
                    wrap_lines=True)
