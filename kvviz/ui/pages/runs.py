"""The runs page script (st.navigation runs it; AppTest switches to it by path)."""

from kvviz.ui import runs_page

runs_page.render()
