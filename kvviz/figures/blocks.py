"""The block pool: a clickable grid at one step, occupancy over time, page tables, and memory
utilisation against a contiguous allocator."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .palette import CROSS_READ, LEAK, STATE_COLOURS, clear_of_modebar, grid_columns, request_colours


def block_map(blocks: pd.DataFrame, leaky: set[int] = frozenset(), colour_by: str = "owner",
              title: str | None = None, split: int | None = None, crossed: set[int] = frozenset()) -> go.Figure:
    """blocks: block, state, refcount, owners ("A,B"). One square per physical block, block 0 top
    left; colour by owning request (shared blocks in the shared colour) or by state; refcount in
    the square; blocks holding leaked keys outlined in red, blocks another tenant read (`crossed`)
    in near-black; a line before block `split` where one arena holds two instances' pools. Clicks
    return (x, y): see block_at."""
    cols = grid_columns(len(blocks))
    size = max(10, min(34, 900 // cols))
    owners = blocks.owners.fillna("")
    category = np.where(blocks.refcount > 1, "shared", blocks.state)
    if colour_by == "owner":
        colours = request_colours(o for o in owners if o and "," not in o)
        category = [c if c in ("free", "cached", "shared", "reserved") or not o else o
                    for c, o in zip(category, owners, strict=True)]
        palette = {**STATE_COLOURS, **colours}
    else:
        palette = STATE_COLOURS
    outline = np.where(blocks.block.isin(leaky), LEAK, np.where(blocks.block.isin(crossed), CROSS_READ, "white"))
    df = blocks.assign(x=blocks.block % cols, y=blocks.block // cols, category=category, outline=outline,
                       owners=owners)
    fig = go.Figure()
    for cat, part in df.groupby("category", sort=False):
        fig.add_trace(go.Scatter(
            x=part.x, y=part.y, mode="markers+text", name=str(cat),
            text=[str(r) if r > 0 and size >= 16 else "" for r in part.refcount], textfont={"size": size * 0.45},
            marker={"symbol": "square", "size": size, "color": palette.get(cat, STATE_COLOURS["used"]),
                    "line": {"color": part.outline, "width": np.where(part.outline != "white", 3, 1)}},
            customdata=np.stack([part.block, part.refcount, part.state, part.owners], axis=1),
            hovertemplate="block %{customdata[0]}<br>%{customdata[2]}, refcount %{customdata[1]}"
                          "<br>held by: %{customdata[3]}<extra></extra>"))
    if split is not None and 0 < split < len(blocks):
        r, c = divmod(split, cols)  # the edge between block split - 1 and split, around the grid's rows
        fig.add_shape(type="path", path=f"M -0.5 {r + 0.5} H {c - 0.5} V {r - 0.5} H {cols - 0.5}" if c else
                      f"M -0.5 {r - 0.5} H {cols - 0.5}", line={"color": "#333", "width": 2, "dash": "dash"})
    rows = -(-len(blocks) // cols)
    fig.update_layout(title=title, height=max(160, rows * (size + 4) + 90), margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      plot_bgcolor="white", legend={"orientation": "h", "y": -0.02, "yanchor": "top"},
                      clickmode="event+select", dragmode=False)
    fig.update_traces(unselected={"marker": {"opacity": 1}, "textfont": {"color": "#333"}})  # a click fades nothing
    fig.update_xaxes(visible=False, range=[-0.7, cols - 0.3])
    fig.update_yaxes(visible=False, autorange="reversed", scaleanchor="x")
    return clear_of_modebar(fig)


def block_at(point: dict, num_blocks: int) -> int | None:
    """The block under a clicked point of block_map (None outside the pool)."""
    if "x" not in point or "y" not in point:
        return None
    block = int(round(point["y"])) * grid_columns(num_blocks) + int(round(point["x"]))
    return block if 0 <= block < num_blocks else None


def occupancy(grid: np.ndarray, steps: list[int], current: int | None = None, per_row: int = 1) -> go.Figure:
    """Blocks x steps coloured free / cached / used / shared, like a memory timeline; a row is
    per_row neighbouring blocks in a big pool."""
    names = ["free", "cached", "used", "shared"]
    scale = [[edge, STATE_COLOURS[n]] for i, n in enumerate(names) for edge in (i / 4, (i + 1) / 4)]
    rows = np.arange(len(grid)) * per_row
    what = "block" if per_row == 1 else f"blocks (groups of {per_row})"
    fig = go.Figure(go.Heatmap(z=grid, x=steps, y=rows, zmin=-0.5, zmax=3.5, colorscale=scale,
                               colorbar={"tickvals": [0, 1, 2, 3], "ticktext": names, "title": "state"},
                               hovertemplate=f"step %{{x}}, {what.split(' ')[0]} %{{y}}<extra></extra>"))
    if current is not None:
        fig.add_vline(x=current, line={"color": "black", "width": 1, "dash": "dot"})
    # the plot at least 200 px tall (a pool of a few blocks was a thin strip), 12 px a row up to 480 px in all; a
    # tick a row while they fit
    fig.update_layout(height=max(300, min(480, 100 + 12 * len(grid))), margin={"l": 10, "r": 10, "t": 30, "b": 10},
                      xaxis_title="step", yaxis_title=what)
    fig.update_yaxes(autorange="reversed", **({"dtick": per_row} if len(grid) <= 24 else {}))
    return clear_of_modebar(whole_steps(fig, steps))


def whole_steps(fig: go.Figure, steps) -> go.Figure:
    """Steps are whole numbers: a short run's axis gets a tick per step, not ticks at 0.5."""
    if len(steps) and max(steps) - min(steps) <= 20:
        fig.update_xaxes(tick0=0, dtick=1)
    return fig


ALLOCATOR_COLOURS = {"paged": STATE_COLOURS["used"], "contiguous": "#e6ab02"}


def memory_utilisation(frame: pd.DataFrame, article: dict[str, float], current: int | None = None) -> go.Figure:
    """frame: step, allocator (paged | contiguous), utilisation, live, allocated, waiting (analysis.memory).
    Above, the share of allocated slots holding tokens per step with the article's figures dotted; below,
    the requests the contiguous allocator kept waiting for a region."""
    waits = int(frame.waiting.fillna(0).max()) if len(frame) else 0
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1, row_heights=[0.72, 0.28],
                        subplot_titles=("allocated KV slots holding a token",
                                        "requests waiting (contiguous)" + ("" if waits else ": none waited")))
    for name, part in frame.groupby("allocator", sort=False):
        colour = ALLOCATOR_COLOURS[name]
        fig.add_trace(go.Scatter(x=part.step, y=part.utilisation, name=name, mode="lines+markers",
                                 line={"color": colour, "shape": "hv"}, marker={"size": 4},
                                 customdata=np.stack([part.live, part.allocated], axis=1),
                                 hovertemplate=f"{name}, step %{{x}}: %{{y:.0%}} "
                                               "(%{customdata[0]} of %{customdata[1]} slots)<extra></extra>"),
                      row=1, col=1)
        if name in article:
            fig.add_hline(y=article[name], line={"color": colour, "width": 1, "dash": "dot"}, row=1, col=1,
                          annotation_text=f"article: {name} {article[name]:.0%}", annotation_position="top left")
        if part.waiting.notna().any():
            fig.add_trace(go.Bar(x=part.step, y=part.waiting, name=f"{name}: waiting", marker_color=colour,
                                 showlegend=False, hovertemplate="step %{x}: %{y} waiting<extra></extra>"),
                          row=2, col=1)
    if current is not None:
        fig.add_vline(x=current, line={"color": "black", "width": 1, "dash": "dot"})
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=2, col=1, **({"dtick": 1} if waits <= 5 else {}))
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(height=420, margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      legend={"orientation": "h", "y": 1.12, "x": 1, "xanchor": "right"})
    return clear_of_modebar(whole_steps(fig, frame.step.tolist()))


PAGE_COLUMNS = 16
PAGE_KINDS = {"own": ("white", 1), "shared": ("black", 3), "copy-on-write copy": ("#e377c2", 4)}


def page_tables(entries: pd.DataFrame) -> go.Figure:
    """entries: request_id, logical_block, physical_block, refcount, shared, cow. Rows are requests,
    columns logical blocks, the number the physical block; shared blocks and CoW copies outlined."""
    colours = request_colours(entries.request_id)
    kinds = entries.assign(kind=np.where(entries.cow, "copy-on-write copy", np.where(entries.shared, "shared", "own")))
    fig = go.Figure()
    for kind, part in kinds.groupby("kind", sort=False):
        line, width = PAGE_KINDS[kind]
        fig.add_trace(go.Scatter(
            x=part.logical_block, y=part.request_id, mode="markers+text", name=str(kind), text=part.physical_block,
            textfont={"color": "black"},
            marker={"symbol": "square", "size": 30, "color": [colours[r] for r in part.request_id],
                    "line": {"color": line, "width": width}},
            customdata=part.refcount,
            hovertemplate=f"%{{y}} logical %{{x}} -> block %{{text}}, refcount %{{customdata}} ({kind})"
                          "<extra></extra>"))
    fig.update_layout(height=90 + 40 * entries.request_id.nunique(), margin={"l": 10, "r": 10, "t": 30, "b": 10},
                      plot_bgcolor="white", xaxis_title="logical block", legend={"orientation": "h"})
    # at least PAGE_COLUMNS columns' room: two logical blocks stretched over the page sat at its far edges
    fig.update_xaxes(dtick=1, range=[-0.5, max(PAGE_COLUMNS, int(entries.logical_block.max()) + 1) - 0.5])
    fig.update_yaxes(autorange="reversed", type="category")
    return clear_of_modebar(fig)
