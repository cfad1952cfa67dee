"""Leaks and the cache over time."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .blocks import whole_steps
from .palette import clear_of_modebar, request_colours


def _per_request_panels(df: pd.DataFrame, x: str, top: str, bottom: str, titles: tuple[str, str],
                        row_heights: list[float] | None = None, mode: str = "lines") -> go.Figure:
    """Two stacked panels sharing x, one line per request in each (the legend once; a request of one
    point is a marker). With a `run` column (runs compared), a request keeps its colour in every run
    and each run has its own dash, so the fault's line and its control's read as one request's."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.16, subplot_titles=titles,
                        row_heights=row_heights)
    colours = request_colours(df.request_id)
    runs = list(dict.fromkeys(df["run"])) if "run" in df else []
    dashes = dict(zip(runs, ("solid", "dash", "dot", "dashdot", "longdash"), strict=False))
    for key, part in df.groupby(["request_id", *(["run"] if runs else [])]):
        req, run = key if runs else (key[0], None)
        name = str(req) if run is None else f"{req} ({run})"
        line = {"color": colours[req], "dash": dashes.get(run, "solid")}
        for row, col in ((1, top), (2, bottom)):
            fig.add_trace(go.Scatter(x=part[x], y=part[col], mode=mode if len(part) > 1 else "markers",
                                     name=name, legendgroup=name, showlegend=row == 1,
                                     line=line, marker={"color": colours[req]}), row=row, col=1)
    fig.update_layout(height=420, margin={"l": 10, "r": 10, "t": 40, "b": 10})
    fig.update_yaxes(rangemode="nonnegative", row=1, col=1)  # a mass or an entropy: 0..1 when all is 0, not -1..1
    fig.update_yaxes(range=[0, 1.05], row=2, col=1)  # a rate: never below 0, at most 1
    return fig


def leak_timeline(df: pd.DataFrame, current: int | None = None) -> go.Figure:
    """df: step, request_id, leak_rate, max_foreign_mass. Max foreign mass above, leak rate below,
    one line per request."""
    fig = _per_request_panels(df, "step", "max_foreign_mass", "leak_rate",
                              ("max foreign mass", "leak rate (share of query rows x heads)"), mode="lines+markers")
    if current is not None:
        fig.add_vline(x=current, line={"color": "black", "width": 1, "dash": "dot"})
    fig.update_xaxes(title="step", row=2, col=1)
    return clear_of_modebar(whole_steps(fig, df.step.tolist()))


def entropy_by_position(df: pd.DataFrame) -> go.Figure:
    """df: request_id, position, entropy, leak_rate. Positional entropy above, leak rate below, one
    line per request: the seed expects entropy to rise with position while the leak rate stays 0."""
    fig = _per_request_panels(df, "position", "entropy", "leak_rate", ("positional entropy (nats)", "leak rate"),
                              row_heights=[0.65, 0.35])
    fig.update_xaxes(title="query position", row=2, col=1)
    return clear_of_modebar(fig)
