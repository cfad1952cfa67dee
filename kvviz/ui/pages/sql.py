"""The sql page script (st.navigation runs it; AppTest switches to it by path)."""

from kvviz.ui import sql_page

sql_page.render()
