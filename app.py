"""Streamlit entry point: `streamlit run app.py` (the run store: $KVVIZ_DB, default runs/kvviz.duckdb)."""

from pathlib import Path

import streamlit as st

from kvviz.errors import KvvizError
from kvviz.ui.common import PAGES, keep_widget_state

st.set_page_config(page_title="kvviz", page_icon=str(Path(__file__).with_name("kvviz") / "ui" / "favicon.png"),
                   layout="wide")
keep_widget_state()
page = st.navigation([st.Page(p.path, title=p.title, icon=p.icon, url_path=p.url, default=p.url == "home")
                      for p in PAGES.values()], position="top")
try:
    page.run()
except KvvizError as e:  # every page's refusals, said once here in plain words; anything else is a bug
    st.error(str(e), icon=":material/error:")
