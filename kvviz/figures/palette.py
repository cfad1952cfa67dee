"""Colours and the top of the layout shared by every figure, so a request has the same colour in the
block map, the page tables and the heatmap, and plotly's toolbar covers no chart's title or legend."""

from __future__ import annotations

import zlib

import plotly.graph_objects as go

# Distinct, readable on white and as text, and clear of what provenance colours mean: no grey or near-white
# (cached, free), blue (own, used), purple (shared, another tenant's), red (leak), orange or brown (stale):
# greens, teals, cyan, olive and magentas only. A name's slot is a hash of it (request_colours), so the
# most common names (A..H) are spread over the most distinct colours.
REQUEST_COLOURS = ["#01665e", "#a6d854", "#1b9e77", "#e78ac3", "#bcbd22", "#66a61e", "#8dd3c7", "#c51b7d",
                   "#e7298a", "#17becf", "#006d2c"]
STATE_COLOURS = {"free": "#eceff1", "cached": "#b0bec5", "used": "#4c78a8", "shared": "#6a3d9a",
                 "reserved": "#d7ccc8",  # held back from every request (transformers' trash blocks)
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


MODEBAR_PX = 32  # the band at the top of a chart where plotly draws its toolbar (the modebar), right-aligned
LINE_PX = 22  # a line of a title, a row of subplot titles or a horizontal legend


def clear_of_modebar(fig: go.Figure) -> go.Figure:
    """Every figure's last step: plotly's toolbar (top right, on hover) covered the titles and legends drawn
    in the top margin. The title goes under the toolbar's band, a horizontal legend that was not put below
    the plot goes under the title at the left (plotly's default put it over the x axis title), subplot
    titles under both; the top margin grows to hold them and the figure by as much, so the plot keeps its
    height. A vertical legend or colour bar starts at the plot's top, under the margin: left as it is."""
    lay = fig.layout
    title = lay.title.text or ""
    lines = title.count("<br>") + 1 if title else 0
    legend_on_top = lay.legend.orientation == "h" and (lay.legend.y is None or lay.legend.y >= 1)
    subtitles = any(a.yref == "paper" and a.yanchor == "bottom" and (a.y or 0) >= 1 for a in lay.annotations)
    old = 100 if lay.margin.t is None else lay.margin.t  # plotly's default
    top = max(old, MODEBAR_PX + LINE_PX * (lines + legend_on_top + subtitles) + 6)
    height = (lay.height or 450) + top - old
    fig.update_layout(height=height, margin={"t": top})
    if lines:
        fig.update_layout(title={"yref": "container", "y": 1, "yanchor": "top", "pad": {"t": MODEBAR_PX}})
    if legend_on_top:
        fig.update_layout(legend={"yref": "container", "y": 1 - (MODEBAR_PX + LINE_PX * lines) / height,
                                  "yanchor": "top", "x": 0, "xanchor": "left"})
    return fig
