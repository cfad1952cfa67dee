"""Runs: every stored run with its status and leak summary; open, compare two, export, delete."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
import streamlit as st

from ..analysis import leaks, runs
from ..figures import timeline
from ..store.chrome import export_chrome
from ..store.trace import export_run
from .common import BREACHES, EMPTY, db_path, open_run, reader, runs_or_hint, store

FIRST = ["run_id", "status", "model", "scenario", "fault", "findings", "breaches", "leak_rate"]


def render() -> None:
    st.title("Runs")
    listing = runs_or_hint()
    if listing is None:
        return
    st.caption(f"{len(listing)} runs in `{db_path()}`. Select one to open, export or delete it; two to compare.")
    gen = st.session_state.get("runs_gen", 0)  # a new table (no selection) after every delete
    event = st.dataframe(listing, hide_index=True, width="stretch", on_select="rerun", selection_mode="multi-row",
                         key=f"runs_table_{gen}", placeholder=EMPTY, column_order=FIRST + [
                             c for c in listing.columns if c not in FIRST],  # what tells runs apart, in view
                         column_config={"created_at": st.column_config.DatetimeColumn("created"),
                                        "breaches": BREACHES})
    picked = [listing.run_id.iloc[i] for i in event.selection.rows] if event else []
    if not picked:
        picked_text = st.text_input("Or paste run ids (comma-separated, as the CLI prints them)", key="runs_ids")
        picked = [r.strip() for r in picked_text.split(",") if r.strip() in set(listing.run_id)]
    picked = list(dict.fromkeys(picked))  # the same id pasted twice is one run
    if len(picked) == 1:
        _one(picked[0], listing.set_index("run_id").status[picked[0]])
    elif len(picked) == 2:
        _compare(*picked)
    elif len(picked) > 2:
        st.info("Select one run to open, export or delete it, or two to compare them.")


def _one(run_id: str, status: str) -> None:
    st.markdown(f"Selected: run `{run_id}` ({status})")
    c = st.columns(4)
    if c[0].button("Open in the inspector", key="runs_open", type="primary", icon=":material/grid_view:"):
        open_run(run_id)
    if c[1].button("Prepare exports", key="runs_export", icon=":material/download:"):
        with tempfile.TemporaryDirectory() as tmp:
            trace = export_run(store(), run_id, Path(tmp) / f"{run_id}.zip").read_bytes()
            chrome = export_chrome(store(), run_id, Path(tmp) / f"{run_id}.json").read_bytes()
        st.session_state["runs_exports"] = {"run": run_id, "trace": trace, "chrome": chrome}
    exports = st.session_state.get("runs_exports")
    if exports and exports["run"] == run_id:
        c[2].download_button("kvviz trace (.zip)", exports["trace"], f"{run_id}.zip", "application/zip",
                             key="runs_dl_trace")
        c[3].download_button("Chrome trace (Perfetto)", exports["chrome"], f"{run_id}.json", "application/json",
                             key="runs_dl_chrome")
    with st.expander("Delete this run"):
        if status == "running":
            st.warning("This run is still recording, or its process ended before it could say so. Deleting "
                       "it stops the recording: the run that records it ends with that reason.",
                       icon=":material/warning:")
        sure = st.checkbox(f"Yes, delete run {run_id} and everything recorded for it", key=f"runs_sure_{run_id}")
        if st.button("Delete", key="runs_delete", disabled=not sure, icon=":material/delete:"):
            runs.delete_run(store(), run_id)
            if st.session_state.get("run_id") == run_id:
                st.session_state.pop("run_id")
            st.session_state["runs_gen"] = st.session_state.get("runs_gen", 0) + 1
            st.toast(f"Deleted run {run_id}")
            st.rerun()


def _compare(a: str, b: str) -> None:
    with reader() as con:
        info = {r: runs.list_runs(con).set_index("run_id").loc[r] for r in (a, b)}
        over = {r: leaks.leak_over_time(con, r) for r in (a, b)}
        found = {r: leaks.findings(con, r) for r in (a, b)}
        texts = {r: runs.requests_frame(con, r).set_index("request_id").text for r in (a, b)}
        cache = {r: runs.cache_use(con, r) for r in (a, b)}
    how = ["status", "model", "engine", "kernel", "isolation", "scenario", "fault", "steps", "tokens"]
    summary = pd.DataFrame({r: pd.concat([info[r][how], pd.Series(cache[r], dtype=object),
                                          info[r][["leak_rate", "max_foreign_mass", "findings"]]]) for r in (a, b)})
    measures = ["leak_rate", "max_foreign_mass"]  # four places, as the listing draws them (str() gives all)
    summary.loc[measures] = summary.loc[measures].map(lambda v: v if pd.isna(v) else round(float(v), 4))
    st.dataframe(summary.astype(str).where(summary.notna(), EMPTY), width="stretch",
                 column_config={"_index": st.column_config.Column(width="medium")})  # "max_foreign_mass" whole
    measured = [o.assign(run=r) for r, o in over.items() if not o.empty]
    if measured:  # captures have no leak metrics
        both = pd.concat(measured)
        st.plotly_chart(timeline.leak_timeline(both), width="stretch", key="runs_cmp_timeline")
    kinds = pd.DataFrame({r: found[r].kind.value_counts() for r in (a, b)}).fillna(0).astype(int)
    if not kinds.empty:
        st.markdown("Findings by kind")
        st.dataframe(kinds, width="stretch")
    generated = pd.DataFrame(texts)
    if generated.empty:
        st.caption("Neither run generated text: a capture holds the cache's events, not the requests' outputs.")
    else:
        st.markdown("Generated texts")
        st.dataframe(generated, width="stretch")
