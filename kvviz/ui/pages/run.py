"""The run page script (st.navigation runs it; AppTest switches to it by path)."""

from kvviz.ui import run_page

run_page.render()
