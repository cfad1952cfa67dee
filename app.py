"""Streamlit entry point: `streamlit run app.py` (the run store: $KVVIZ_DB, default runs/kvviz.duckdb)."""

from pathlib import Path

import streamlit as st

from kvviz.ui.common import PAGES, keep_widget_state

st.set_page_config(page_title="kvviz", page_icon=str(Path(__file__).with_name("kvviz") / "ui" / "favicon.png"),
                   layout="wide")
keep_widget_state()
st.navigation([st.Page(p.path, title=p.title, icon=p.icon, url_path=p.url, default=p.url == "home")
               for p in PAGES.values()], position="top").run()
