"""Streamlit's AppTest for the suite, without its per-instance scan of the installed packages.

Each AppTest scans the metadata of every installed distribution for component manifests (about
0.5 s here, a third of a typical page test). The installed packages do not change while the suite
runs, so the scan is done once per process; every AppTest still gets a component registry of its
own, built from that one scan.
"""

from __future__ import annotations

import functools

from streamlit.components.v2 import manifest_scanner
from streamlit.testing.v1 import AppTest

manifest_scanner.scan_component_manifests = functools.cache(manifest_scanner.scan_component_manifests)

__all__ = ["AppTest"]
