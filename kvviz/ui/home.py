"""Landing page until the debugger pages land: what kvviz is and what works today."""

import streamlit as st

from kvviz import __version__


def render() -> None:
    st.title("kvviz")
    st.caption(f"version {__version__} · a visual debugger for KV-cache sharing and attention isolation")
    st.markdown(
        """
Inference servers keep one physically shared KV cache for many requests. Isolation (masks, page
tables, block lifecycles) must keep each request from seeing another's tokens; when it breaks,
nothing crashes. kvviz runs a real paged engine, classifies every attention weight by provenance
and records it all, so the leak becomes visible.
        """
    )
    st.info(
        "The debugger pages (run, inspect, scenarios, runs, upload, SQL) are being built. "
        "Available now: the shared block pool and model loading, from Python and the CLI "
        "(`python -m kvviz fetch-model`).",
        icon=":material/construction:",
    )
