"""Colours shared by every figure, so a request has the same colour in the block map, the page
tables and the heatmap."""

from __future__ import annotations

import zlib

# Distinct, readable on white and as text, and clear of what provenance colours mean: no grey or near-white
# (cached, free), blue (own, used), purple (shared, another tenant's), red (leak), orange or brown (stale):
# greens, teals, cyan, olive and magentas only. A name's slot is a hash of it (request_colours), so the
# most common names (A..H) are spread over the most distinct colours.
REQUEST_COLOURS = ["#01665e", "#a6d854", "#1b9e77", "#e78ac3", "#bcbd22", "#66a61e", "#8dd3c7", "#c51b7d",
                   "#e7298a", "#17becf", "#006d2c"]
STATE_COLOURS = {"free": "#eceff1", "cached": "#b0bec5", "used": "#4c78a8", "shared": "#6a3d9a",
                 # a host-tier block a step moved
                 "offloaded": "#59a14f", "restored": "#f28e2b", "dropped": "#9c755f"}
LEAK = "#d62728"
STALE = "#ff7f0e"
CROSS_TENANT = "#6a3d9a"  # an exact copy another tenant wrote: the shared-block purple, neither own blue nor leak red
CROSS_READ = "#111111"  # the outline of a block another tenant read: dark on any fill, the shared purple included
GRID_BG = "#f5f5f5"  # what unseen cells (future, masked) show through


def request_colours(names) -> dict[str, str]:
    """A colour per name, the same in every figure whatever other names it shows (the block map, the
    heatmap's key labels and the timelines of one run agree): its slot is a hash of the name. A name
    whose slot another of these names took (in sorted order) gets the next free one, so no two share
    a colour while there are colours left."""
    out: dict[str, str] = {}
    taken: set[int] = set()
    for n in sorted(set(names)):
        i = zlib.crc32(str(n).encode()) % len(REQUEST_COLOURS)
        while i in taken and len(taken) < len(REQUEST_COLOURS):
            i = (i + 1) % len(REQUEST_COLOURS)
        taken.add(i)
        out[n] = REQUEST_COLOURS[i]
    return out


def grid_columns(n: int) -> int:
    """Columns of a square-marker grid of n cells: roughly twice as wide as tall."""
    cols = 8
    while cols * cols < 2 * n:
        cols *= 2
    return cols
