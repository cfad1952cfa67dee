"""The scenarios page script (st.navigation runs it; AppTest switches to it by path)."""

from kvviz.ui import scenarios_page

scenarios_page.render()
