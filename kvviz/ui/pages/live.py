"""The live page script (st.navigation runs it; AppTest switches to it by path)."""

from kvviz.ui import live_page

live_page.render()
