"""A timing audit drawn: the empirical distribution functions of hit, miss and null (the control: a
second miss) times to first token, the KS distance marked where the hits' curve lies furthest above
the misses', and the floor (a one-word prompt's median time) as a line: a server can save no more."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

HIT, MISS, NULL = "#2ca02c", "#d62728", "#7f7f7f"


def _ecdf(x: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """The step curve from 0 at the first time: without that point a curve starts in mid-air at 1/n,
    and a single time draws nothing at all (the first round of a live audit)."""
    xs = np.sort(np.asarray(x, dtype=float))
    return np.concatenate([xs[:1], xs]), np.arange(len(xs) + 1) / len(xs)


def ttft_ecdf(hit: list[float], miss: list[float], title: str = "", null: list[float] | None = None,
              floor: list[float] | None = None, x_max: float | None = None) -> go.Figure:
    """Step curves (hit, miss, null dashed grey); a black segment at the largest F_hit - F_miss,
    labelled D; a dotted vertical line at the floor's median. `x_max` ends the time axis there, so
    that audits drawn side by side share one scale."""
    fig = go.Figure()
    for name, values, colour, dash in (("hit", hit, HIT, None), ("miss", miss, MISS, None),
                                       ("null", null or [], NULL, "dash")):
        if values:
            xs, ys = _ecdf(values)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line={"shape": "hv", "color": colour, "dash": dash},
                                     name=f"{name} ({len(values)})",
                                     hovertemplate=f"{name}: %{{y:.0%}} within %{{x:.1f}} ms<extra></extra>"))
    if hit and miss:
        grid = np.sort(np.concatenate([hit, miss]))
        f_hit = np.searchsorted(np.sort(hit), grid, side="right") / len(hit)
        f_miss = np.searchsorted(np.sort(miss), grid, side="right") / len(miss)
        i = int(np.argmax(f_hit - f_miss))
        d = float(f_hit[i] - f_miss[i])
        fig.add_trace(go.Scatter(x=[grid[i], grid[i]], y=[f_miss[i], f_hit[i]], mode="lines+markers",
                                 line={"color": "black", "width": 2}, name=f"KS distance D = {d:.2f}",
                                 hovertemplate=f"D = {d:.3f} at %{{x:.1f}} ms<extra></extra>"))
    if floor:  # labelled at the top: the curves start at the bottom, next to it
        fig.add_vline(x=float(np.median(floor)), line={"color": NULL, "dash": "dot"},
                      annotation_text=f"floor {np.median(floor):.1f} ms", annotation_position="top right")
    fig.update_layout(title=title or None, height=340, margin={"l": 10, "r": 10, "t": 40 if title else 10, "b": 10},
                      xaxis={"title": "time to first token (ms)", "rangemode": "tozero",
                             **({"range": [0, 1.02 * x_max]} if x_max else {})},
                      yaxis={"title": "share of requests", "tickformat": ".0%", "range": [0, 1.02]},
                      legend={"orientation": "h", "y": -0.25})
    return fig
