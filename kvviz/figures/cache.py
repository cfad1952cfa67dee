"""The prefix cache of a run: tokens served from the cache against tokens computed per step, and
how long cached blocks lived and sat idle before they were evicted."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .blocks import whole_steps
from .palette import clear_of_modebar

HIT, MISS = "#54a24b", "#bab0ac"


def hit_rate(df: pd.DataFrame, current: int | None = None, steps: tuple[int, int] | None = None) -> go.Figure:
    """df: interval_start, tokens, hit_tokens, hit_rate (one row per step that looked something up):
    the prompt tokens looked up, split into served (hit) and computed (miss), and the running hit rate;
    the x axis spans `steps` (the run's first and last), whatever step is marked."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=df.interval_start, y=df.hit_tokens, name="served from the cache", marker_color=HIT,
                         width=0.8))  # a step each, however far apart the steps that looked something up
    fig.add_trace(go.Bar(x=df.interval_start, y=df.tokens - df.hit_tokens, name="computed (missed)",
                         marker_color=MISS, width=0.8))
    running = df.hit_tokens.cumsum() / df.tokens.cumsum().where(lambda t: t > 0)
    fig.add_trace(go.Scatter(x=df.interval_start, y=running, name="hit rate so far", mode="lines+markers",
                             line={"color": "#4c78a8"}), secondary_y=True)
    if current is not None:
        fig.add_vline(x=current, line={"dash": "dot", "color": "#888"})
    fig.update_layout(barmode="stack", height=320, margin={"l": 10, "r": 10, "t": 30, "b": 10},
                      legend={"orientation": "h"})
    fig.update_xaxes(title="step", range=None if steps is None else [steps[0] - 0.5, steps[1] + 0.5])
    fig.update_yaxes(title="prompt tokens looked up", secondary_y=False)
    fig.update_yaxes(title="hit rate", range=[0, 1], tickformat=".0%", dtick=0.25, secondary_y=True)
    return clear_of_modebar(whole_steps(fig, list(steps or df.interval_start)))


def lifetimes(df: pd.DataFrame) -> go.Figure:
    """df: lifetime_steps, idle_steps (lives that ended): how long blocks stayed cached, and how long
    they had gone unused when they were evicted (short idle times under pressure: thrashing)."""
    ended = df[df.lifetime_steps.notna()]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("lifetime (steps)", "idle before eviction (steps)"))
    fig.add_trace(go.Histogram(x=ended.lifetime_steps, name="lifetime", marker_color="#4c78a8"), row=1, col=1)
    fig.add_trace(go.Histogram(x=ended.idle_steps, name="idle", marker_color="#e45756"), row=1, col=2)
    fig.update_layout(height=260, showlegend=False, margin={"l": 10, "r": 10, "t": 40, "b": 10})
    fig.update_yaxes(title="lives", row=1, col=1)
    return clear_of_modebar(fig)
