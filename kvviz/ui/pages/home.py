"""The home page script (st.navigation runs it; AppTest switches to it by path)."""

from kvviz.ui import home

home.render()
