"""Colours shared by every figure, so a request has the same colour in the block map, the page
tables and the heatmap."""

from __future__ import annotations

# Distinct, readable on white and as text; no grey or near-white (cached, free), purple (shared) or the
# leak red and stale orange.
REQUEST_COLOURS = ["#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#e5c494", "#1b9e77", "#d95f02",
                   "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#17becf", "#bcbd22", "#8c564b",
                   "#2ca02c", "#1f77b4"]
STATE_COLOURS = {"free": "#eceff1", "cached": "#b0bec5", "used": "#4c78a8", "shared": "#6a3d9a",
                 # a host-tier block a step moved
                 "offloaded": "#59a14f", "restored": "#f28e2b", "dropped": "#9c755f"}
LEAK = "#d62728"
STALE = "#ff7f0e"
CROSS_TENANT = "#6a3d9a"  # an exact copy another tenant wrote: the shared-block purple, neither own blue nor leak red
CROSS_READ = "#111111"  # the outline of a block another tenant read: dark on any fill, the shared purple included
GRID_BG = "#f5f5f5"  # what unseen cells (future, masked) show through


def request_colours(names) -> dict[str, str]:
    """A stable colour per request name: sorted names take the palette in order."""
    return {n: REQUEST_COLOURS[i % len(REQUEST_COLOURS)] for i, n in enumerate(sorted(set(names)))}


def grid_columns(n: int) -> int:
    """Columns of a square-marker grid of n cells: roughly twice as wide as tall."""
    cols = 8
    while cols * cols < 2 * n:
        cols *= 2
    return cols
