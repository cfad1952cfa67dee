"""The audit page script (st.navigation runs it; AppTest switches to it by path)."""

from kvviz.ui import audit_page

audit_page.render()
