"""The audit page script (st.navigation runs it; AppTest switches to it by path)."""

from kvviz.ui import audit_timing_page

audit_timing_page.render()
