"""Attention pictures: the per-request heatmap with leaks highlighted, and the layer x head grid."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .palette import CROSS_TENANT, GRID_BG, LEAK, STALE, clear_of_modebar, request_colours

FOREIGN, STALE_CLASS, CROSS = 1, 2, 3  # as analysis.attention codes them
CROSS_NAME = "another tenant's (same content)"


def attention_heatmap(weights: np.ndarray, classes: np.ndarray, query_labels: list[str], key_labels: list[str],
                      key_owners: list[str], title: str = "", mark_row: int | None = None,
                      zmax: float | None = None) -> go.Figure:
    """Queries (rows) x keys (columns, physical slot order). Own weights in blue, weights on foreign
    keys in red and stale keys in orange, on exact copies another tenant wrote in purple (no leak, but
    not the request's own either); unseen cells (future, masked) stay grey. Key labels take
    their writer's colour, and where the owner changes along the key axis a band boundary is drawn,
    as in the seed's shared-buffer table. mark_row (a finding's query) is outlined. zmax: the top of the
    own and cross-tenant scales (default this figure's largest weight); figures drawn side by side share
    one, or the same colour would mean 0.2 in one and 1.0 in the other."""
    own = np.where(classes == 0, weights, np.nan)
    foreign = np.where(classes == FOREIGN, weights, np.nan)
    stale = np.where(classes == STALE_CLASS, weights, np.nan)
    cross = np.where(classes == CROSS, weights, np.nan)
    x, y = _unique(key_labels), _unique(query_labels)  # category axes: the labels are the coordinates
    hover = "query %{y}<br>key %{x}<br>weight %{z:.4f}<extra>%{fullData.name}</extra>"
    fig = go.Figure()
    if zmax is None:
        zmax = float(np.nanmax(weights)) if np.isfinite(weights).any() else 1.0
    shown = [(name, z, scale) for name, z, scale in (
        ("own", own, "Blues"), (CROSS_NAME, cross, [[0, "#efedf5"], [1, CROSS_TENANT]]),
        ("foreign", foreign, [[0, "#fde0dd"], [1, LEAK]]),
        ("stale", stale, [[0, "#fee6ce"], [1, STALE]])) if name == "own" or not np.isnan(z).all()]
    # the colour bars stacked down the right edge, each under its one-line title (within its length): side by
    # side, their titles overlapped wherever the figure is narrow (half a page, as the Scenarios page draws two)
    slot = 1 / len(shown)
    for i, (name, z, scale) in enumerate(shown):
        top = zmax if name in ("own", CROSS_NAME) else max(float(np.nanmax(z)), 1e-6)  # a small leak: full red,
        fig.add_trace(go.Heatmap(z=z, x=x, y=y, zmin=0, zmax=top, colorscale=scale, name=name,  # its bar says how small
                                 hovertemplate=hover, colorbar={
                                     "title": {"text": f"{name.split(' (')[0]} weight", "side": "top"},
                                     "x": 1.0, "y": 1 - i * slot, "yanchor": "top", "len": slot, "ypad": 4,
                                     "nticks": 3 if slot < 0.5 else 6, "thickness": 12}))
    colours = request_colours(o for o in key_owners if o)
    ticks = [f"<span style='color:{colours.get(o, '#333')}'>{lab}</span>" for lab, o in zip(key_labels, key_owners,
                                                                                            strict=True)]
    for i in range(1, len(key_owners)):
        if key_owners[i] != key_owners[i - 1]:
            fig.add_vline(x=i - 0.5, line={"color": "#333", "width": 2})
    if mark_row is not None:
        fig.add_hrect(y0=mark_row - 0.5, y1=mark_row + 0.5, line={"color": "black", "width": 2})
    step = -(-len(key_labels) // 40)  # at most 40 labels: rotated, more overlap on a half-page figure
    fig.update_xaxes(type="category", tickvals=x[::step], ticktext=ticks[::step], tickangle=-60, showgrid=False,
                     title="key (slot order; colour: writer)")
    ystep = max(1, len(query_labels) // 40)
    fig.update_yaxes(type="category", tickvals=y[::ystep], ticktext=query_labels[::ystep], autorange="reversed",
                     title="query", showgrid=False)
    fig.update_layout(title=title, plot_bgcolor=GRID_BG, height=min(900, max(380, 260 + 14 * len(query_labels))),
                      margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return clear_of_modebar(fig)


def heatmap_title(request: str, step: int, layer: int, shown: str, leak: float, cross_tenant: str | None) -> str:
    """What the heatmap shows and its foreign + stale mass; then, on a line of its own, the
    cross-tenant reads it shows (they move no mass: without the sentence the picture looks clean)."""
    title = f"{request}, step {step}, layer {layer}, {shown}: foreign + stale mass up to {leak:.4f}"
    return title if not cross_tenant else f"{title}<br><sup>{cross_tenant}</sup>"


def leak_grid(cells: pd.DataFrame, num_layers: int, num_heads: int,
              selected: tuple[int, int] | None = None, title: str = "") -> go.Figure:
    """cells: layer, head, max_foreign. Layers down, heads across, one clickable square per head,
    coloured by the max foreign (+ stale) mass; the selected cell outlined."""
    full = pd.MultiIndex.from_product([range(num_layers), range(num_heads)], names=["layer", "head"])
    df = cells.set_index(["layer", "head"]).reindex(full).reset_index()
    vmax = max(0.01, float(df.max_foreign.max(skipna=True) or 0.0))
    size = max(8, min(26, 600 // max(num_layers, 1)))
    line_w = [3 if selected == (r.layer, r.head) else 0.5 for r in df.itertuples()]
    fig = go.Figure(go.Scatter(
        x=df["head"], y=df.layer, mode="markers",
        marker={"symbol": "square", "size": size, "color": df.max_foreign.fillna(0), "cmin": 0, "cmax": vmax,
                "colorscale": [[0, "#f7f7f7"], [0.02, "#fee0d2"], [1, LEAK]], "showscale": True,
                "colorbar": {"title": "max foreign"}, "line": {"color": "black", "width": line_w}},
        hovertemplate="layer %{y}, head %{x}<br>max foreign mass %{marker.color:.4f}<extra></extra>"))
    fig.update_layout(title=title, height=max(220, num_layers * (size + 4) + 100), plot_bgcolor="white",
                      margin={"l": 10, "r": 10, "t": 40, "b": 10}, clickmode="event+select", dragmode=False)
    fig.update_xaxes(title="head", dtick=1, range=[-0.7, num_heads - 0.3])
    fig.update_yaxes(title="layer", range=[num_layers - 0.3, -0.7], dtick=max(1, num_layers // 15))
    return clear_of_modebar(fig)


def difference_grid(cells: pd.DataFrame, num_layers: int, num_heads: int, title: str = "") -> go.Figure:
    """cells: layer, head, max_foreign (one run's minus another's, the same request). Only the layers where some
    head differs, heads across, on a colour scale centred at 0: more foreign mass red, less blue, the same grey;
    each cell that differs says by how much, and even the smallest difference is tinted (on a screen of 30
    layers x 9 heads, drawn as leak_grid, a few pale squares were all it showed and less mass was white)."""
    full = pd.MultiIndex.from_product([range(num_layers), range(num_heads)], names=["layer", "head"])
    z = cells.set_index(["layer", "head"]).max_foreign.reindex(full).fillna(0.0).to_numpy().reshape(
        num_layers, num_heads)
    shown = [layer for layer in range(num_layers) if (z[layer] != 0).any()]
    top = float(np.abs(z).max()) or 1.0
    # no white in the middle: the least difference either way is a pale tint (a cell with none shows no number)
    scale = [[0, "#2166ac"], [0.5, "#d1e5f0"], [0.5, "#fddbc7"], [1, LEAK]]
    text = [[f"{v:+.3f}" if v else "" for v in z[layer]] for layer in shown]
    rows = [f"layer {layer}" for layer in shown]
    fig = go.Figure(go.Heatmap(  # a cell that does not differ is no number: it shows the grey background
        z=np.where(z[shown] == 0, np.nan, z[shown]), x=list(range(num_heads)), y=rows, zmin=-top, zmax=top, zmid=0,
        colorscale=scale, text=text, texttemplate="%{text}", textfont={"size": 10}, xgap=2, ygap=2,
        colorbar={"title": {"text": "difference", "side": "top"}, "thickness": 12},
        hovertemplate="%{y}, head %{x}<br>difference %{z:+.4f}<extra></extra>"))
    same = num_layers - len(shown)
    note = (f"{len(shown)} of {num_layers} layers differ" + (f"; the other {same} are the same in both runs"
                                                             if same else "") if shown else
            "no layer or head differs: the same foreign mass in both runs")
    fig.update_layout(title=f"{title}<br><sup>{note}</sup>" if title else note, plot_bgcolor=GRID_BG,
                      height=max(200, 110 + 30 * len(shown)), margin={"l": 10, "r": 10, "t": 40, "b": 10})
    fig.update_xaxes(title="head", dtick=1, range=[-0.5, num_heads - 0.5], showgrid=False)
    fig.update_yaxes(type="category", autorange="reversed", showgrid=False)
    return clear_of_modebar(fig)


def cell_at(point: dict) -> tuple[int, int] | None:
    """The (layer, head) under a clicked point of leak_grid."""
    if "x" not in point or "y" not in point:
        return None
    return int(round(point["y"])), int(round(point["x"]))


def _unique(labels: list[str]) -> list[str]:
    """Labels made distinct (a category axis merges equal ones) by appending zero-width spaces."""
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        n = seen.get(lab, 0)
        seen[lab] = n + 1
        out.append(lab + "\u200b" * n)
    return out
