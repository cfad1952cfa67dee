"""The Live page's course of a monitored fleet: the hit rate and block utilisation against their
alert thresholds, each crossing marked, and the counts that should stay at zero (cross-tenant
blocks, contract breaches, lost messages), each rise marked."""

from __future__ import annotations

from datetime import UTC, datetime

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .palette import LEAK, clear_of_modebar

RATES = (("hit_ratio", "hit rate", "#54a24b"), ("utilisation", "block utilisation", "#4c78a8"))
COUNTS = (("cross_tenant_blocks", "cross-tenant blocks", "#6a3d9a"), ("breaches", "contract breaches", "#f58518"),
          ("lost", "lost messages", "#9c755f"))


def crossed(values: pd.Series, above: bool, limit: float) -> pd.Series:
    """Where a value is past its alert threshold."""
    return (values > limit) if above else (values < limit)


def course(df: pd.DataFrame, thresholds: dict[str, tuple[bool, float]]) -> go.Figure:
    """df: t (seconds since the epoch) and the course.Point fields, oldest first; thresholds: figure ->
    (fires above, value) from the rules file. Top: the rates with their thresholds dashed and every
    point past one marked red; bottom: the counts so far, red where they rose."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4])
    when = [datetime.fromtimestamp(t, UTC) for t in df.t]
    for field, name, colour in RATES:
        values = df[field].astype(float)
        if values.isna().all():
            continue
        fig.add_trace(go.Scatter(x=when, y=values, name=name, mode="lines", line={"color": colour}), row=1, col=1)
        if field in thresholds:
            above, limit = thresholds[field]
            fig.add_hline(y=limit, line={"dash": "dash", "color": colour}, row=1, col=1,
                          annotation_text=f"{name} alert: {'over' if above else 'under'} {limit:.0%}")
            past = crossed(values, above, limit)
            fig.add_trace(go.Scatter(x=[w for w, p in zip(when, past, strict=True) if p], y=values[past],
                                     name=f"{name} past its threshold", mode="markers",
                                     marker={"color": LEAK, "symbol": "x", "size": 8}), row=1, col=1)
    for field, name, colour in COUNTS:
        values = df[field]
        fig.add_trace(go.Scatter(x=when, y=values, name=name, mode="lines", line={"color": colour, "shape": "hv"}),
                      row=2, col=1)
        rose = values.diff().fillna(values) > 0
        fig.add_trace(go.Scatter(x=[w for w, r in zip(when, rose, strict=True) if r], y=values[rose],
                                 name=f"{name} rose", mode="markers", showlegend=False,
                                 marker={"color": LEAK, "size": 7}), row=2, col=1)
    fig.update_yaxes(title="share", range=[0, 1.05], tickformat=".0%", row=1, col=1)
    fig.update_yaxes(title="so far", rangemode="tozero", row=2, col=1)
    fig.update_layout(height=480, margin={"l": 10, "r": 10, "t": 30, "b": 10}, legend={"orientation": "h"})
    return clear_of_modebar(fig)
