"""The upload page script (st.navigation runs it; AppTest switches to it by path)."""

from kvviz.ui import upload_page

upload_page.render()
