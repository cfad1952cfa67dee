"""Streamlit entry point: `streamlit run app.py`."""

import streamlit as st

from kvviz.ui import home

st.set_page_config(page_title="kvviz", page_icon=":material/grid_view:", layout="wide")
page = st.navigation([st.Page(home.render, title="kvviz", icon=":material/home:", url_path="home", default=True)],
                     position="top")
page.run()
