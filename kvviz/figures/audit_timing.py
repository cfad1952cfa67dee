"""A timing audit drawn: the empirical distribution functions of the times to first token of each
kind it timed (same-user hits, cross-user hits, misses, the null control dashed; an audit from before
the paired one has plain hits), the KS distance of each kind of hit from the misses marked where its
curve lies furthest above theirs, and the floor (a one-word prompt's median time) as a line: a server
can save no more. An order audit drawn: how often each kind of probe finished after each number of
the dummies sent before it."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

# Drawn in this order: name in the legend, colour, dash.
CURVES = {"same": ("same-user hit", "#1f77b4", None), "cross": ("cross-user hit", "#2ca02c", None),
          "hit": ("hit", "#2ca02c", None), "miss": ("miss", "#d62728", None), "null": ("null", "#7f7f7f", "dash")}
HITS = ("same", "cross", "hit")


def _ecdf(x: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """The step curve from 0 at the first time: without that point a curve starts in mid-air at 1/n,
    and a single time draws nothing at all (the first round of a live audit)."""
    xs = np.sort(np.asarray(x, dtype=float))
    return np.concatenate([xs[:1], xs]), np.arange(len(xs) + 1) / len(xs)


def _distance(fig: go.Figure, name: str, hit: list[float], miss: list[float], colour: str) -> None:
    """A segment at the largest F_hit - F_miss, labelled D, in the hit curve's colour."""
    grid = np.sort(np.concatenate([hit, miss]))
    f_hit = np.searchsorted(np.sort(hit), grid, side="right") / len(hit)
    f_miss = np.searchsorted(np.sort(miss), grid, side="right") / len(miss)
    i = int(np.argmax(f_hit - f_miss))
    d = float(f_hit[i] - f_miss[i])
    fig.add_trace(go.Scatter(x=[grid[i], grid[i]], y=[f_miss[i], f_hit[i]], mode="lines+markers",
                             line={"color": colour, "width": 3}, marker={"color": "black"},
                             name=f"{name} KS distance D = {d:.2f}",
                             hovertemplate=f"{name}: D = {d:.3f} at %{{x:.1f}} ms<extra></extra>"))


def ttft_ecdf(times: dict[str, list[float]], title: str = "", x_max: float | None = None) -> go.Figure:
    """Step curves of the kinds in `times` (same, cross, hit, miss, null; floor is the line), a
    segment for each kind of hit's distance from the misses, a dotted vertical line at the floor's
    median. `x_max` ends the time axis there, so that audits drawn side by side share one scale."""
    fig = go.Figure()
    for kind, (name, colour, dash) in CURVES.items():
        if values := times.get(kind):
            xs, ys = _ecdf(values)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line={"shape": "hv", "color": colour, "dash": dash},
                                     name=f"{name} ({len(values)})",
                                     hovertemplate=f"{name}: %{{y:.0%}} within %{{x:.1f}} ms<extra></extra>"))
    miss = times.get("miss")
    for kind in HITS:
        if miss and times.get(kind):
            _distance(fig, CURVES[kind][0], times[kind], miss, CURVES[kind][1])
    if floor := times.get("floor"):  # labelled at the top: the curves start at the bottom, next to it
        fig.add_vline(x=float(np.median(floor)), line={"color": CURVES["null"][1], "dash": "dot"},
                      annotation_text=f"floor {np.median(floor):.1f} ms", annotation_position="top right")
    fig.update_layout(title=title or None, height=340, margin={"l": 10, "r": 10, "t": 40 if title else 10, "b": 10},
                      xaxis={"title": "time to first token (ms)", "rangemode": "tozero",
                             **({"range": [0, 1.02 * x_max]} if x_max else {})},
                      yaxis={"title": "share of requests", "tickformat": ".0%", "range": [0, 1.02]},
                      legend={"orientation": "h", "y": -0.25})
    return fig


def rank_bars(ranks: dict[str, list[int]], dummies: int, title: str = "") -> go.Figure:
    """Grouped bars, one group per rank (0: the probe finished before every dummy; `dummies`: after all
    of them), a bar per kind (same, cross, null) at the share of its rounds that finished there: a
    cached probe that jumps the queue piles up on the left, a fresh one on the right."""
    fig = go.Figure()
    for kind in ("same", "cross", "null"):
        if values := ranks.get(kind):
            name, colour, _ = CURVES[kind]
            share = np.bincount(values, minlength=dummies + 1)[: dummies + 1] / len(values)
            fig.add_trace(go.Bar(x=list(range(dummies + 1)), y=share, name=f"{name} ({len(values)})",
                                 marker_color=colour,
                                 hovertemplate=f"{name}: %{{y:.0%}} after %{{x}} dummies<extra></extra>"))
    fig.update_layout(title=title or None, height=340, barmode="group",
                      margin={"l": 10, "r": 10, "t": 40 if title else 10, "b": 10},
                      xaxis={"title": f"dummies finished before the probe (of {dummies})", "dtick": 1},
                      yaxis={"title": "share of rounds", "tickformat": ".0%", "range": [0, 1.02]},
                      legend={"orientation": "h", "y": -0.25})
    return fig
