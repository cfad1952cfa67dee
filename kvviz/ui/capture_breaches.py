"""The capture inspector's word on the KV-event contract: the breaches its import found, in a short
table at the top, above each view the ones that distort what it draws, and beside a figure's number
those that make it wrong (a hit rate computed from a stream with lost messages says so)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ..analysis import breaches


def read(con, run_id: str) -> pd.DataFrame | None:
    """The run's breaches; None where its import did not lint it (a request trace, an older import)."""
    return breaches.breaches(con, run_id) if breaches.linted(con, run_id) else None


def table(found: pd.DataFrame | None) -> None:
    """The breaches of the whole capture, folded away under their count."""
    if found is None or found.empty:
        if found is not None:
            st.caption("Its KV-event stream keeps the contract its consumers trust: no breach was found on import.")
        return
    with st.expander(f":material/report: The stream breaks the KV-event contract: {breaches.counted(found)}"):
        st.caption("Found on import (`python -m kvviz lint` says the same; SQL: capture_breaches). Each is counted, "
                   "not refused: the views below use the rest of the stream, and say where a breach distorts them. "
                   "Step: the message of the first occurrence.")
        st.dataframe(found.drop(columns=["kind", "first_ts"]), hide_index=True, width="stretch",
                     key="insp_breaches", column_config={"what": "breach", "first_step": "first at step",
                                                         "first_seq": "its seq"})


def warn(found: pd.DataFrame | None, view: str) -> None:
    """The breaches that distort this view, said above it."""
    said = None if found is None else breaches.warning(found, view)
    if said:
        st.warning(said, icon=":material/report:")


def caption(found: pd.DataFrame | None, figure: str) -> None:
    """Say under a figure the breaches that make its number wrong (analysis.breaches.FIGURES)."""
    said = breaches.beside(found, figure)
    if said:
        st.caption(f":orange[:material/report: {said}]")
