"""The inspector page script (st.navigation runs it; AppTest switches to it by path)."""

from kvviz.ui import inspector

inspector.render()
