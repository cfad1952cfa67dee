"""Home: what kvviz is, what is in the store, and where to start."""

import streamlit as st

from kvviz import __version__

from .common import BREACHES, EMPTY, PAGES, db_path, runs_or_hint


def render() -> None:
    st.title("kvviz")
    st.caption(f"version {__version__} · a visual debugger for KV-cache sharing and attention isolation · "
               f"run store `{db_path()}`")
    st.markdown(
        """
Inference servers keep one physically shared KV cache for many requests. Isolation (masks, page
tables, block lifecycles) must keep each request from seeing another's tokens; when it breaks,
nothing crashes. kvviz runs a real paged engine, classifies every attention weight by provenance
(own, foreign, stale), compares each request with itself run alone, and records every step.
"The seed" in these pages is the article kvviz started from: its passphrase experiment, its three
leak patterns and the metrics it says to watch are all reproduced here.
        """
    )
    links = [("scenarios", "Replay a leak", "The seed's boundary, global and positional leaks, and every fault "
                                             "in the catalogue, each beside its clean control."),
             ("run", "Run the engine", "Any model, workload, engine settings, fault and recording options, with "
                                       "the pool filling up live."),
             ("upload", "Open a production capture", "A kvviz trace, a vLLM/SGLang KV-event capture or a Mooncake "
                                                     "trace."),
             ("audit", "Audit a server", "Does a server you run (vLLM, llama.cpp, kvviz serve) share its cache "
                                         "across users, isolate them, or cache nothing? Timed from outside."),
             ("live", "Watch a fleet live", "KV events from your servers' publishers, or a capture replayed: "
                                            "hit rate, utilisation and the seed's alerts as they come."),
             ("sql", "Query the runs", "Every step, block event and finding in DuckDB, with SQL.")]
    for row in (links[:3], links[3:]):
        for col, (page, title, text) in zip(st.columns(3), row, strict=True):
            with col.container(border=True):  # the link first: a row's links in one line, whatever each text's length
                st.page_link(PAGES[page].path, label=f"**{title}**", icon=":material/arrow_forward:")
                st.markdown(text)
    listing = runs_or_hint()
    if listing is None:
        return
    st.subheader("Recent runs")
    shown = ["run_id", "created_at", "status", "model", "engine", "kernel", "isolation", "scenario", "fault",
             "findings", "breaches", "max_foreign_mass"]
    st.dataframe(listing.head(10)[shown], hide_index=True, width="stretch", placeholder=EMPTY,
                 column_config={"breaches": BREACHES})
