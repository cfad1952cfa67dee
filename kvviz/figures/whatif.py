"""The what-if curve: the share of prompt tokens a prefix cache would have served, against its capacity,
one line per eviction policy, so a user sees at once how much memory buys and how much a policy does."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from .palette import clear_of_modebar

# Belady is the bound the others are read against: dashed black; the rest distinct, none a provenance colour
POLICY_STYLE = {"lru": ("#4c78a8", "solid"), "lfu": ("#bcbd22", "solid"), "seed": ("#e78ac3", "solid"),
                "newcomer": ("#1b9e77", "solid"), "belady": ("#111111", "dash")}
POLICY_NAMES = {"lru": "LRU (vLLM's order)", "lfu": "LFU", "seed": "the seed's advice", "newcomer": "newcomer",
                "belady": "Belady (optimal)"}


def hit_rate_curve(points: pd.DataFrame, *, own_capacity: int | None = None, unbounded: int | None = None,
                   block_size: int | None = None, inferred: bool = False) -> go.Figure:
    """points: policy, capacity, hit_rate (one keying). Capacity on a log axis; the run's own cache and
    the unbounded one (every distinct block) marked where known. inferred: own_capacity is no known size
    but a lower bound from the events (the most blocks held at once), marked apart as that."""
    fig = go.Figure()
    curves: dict[tuple, list[str]] = {}  # policies whose points are all equal draw one line, named for all
    for policy, df in points.groupby("policy", sort=False):
        df = df.sort_values("capacity")
        curves.setdefault((tuple(df.capacity), tuple(df.hit_rate)), []).append(policy)
    for (capacity, hit_rate), policies in curves.items():
        colour, dash = POLICY_STYLE.get(policies[0], ("#888888", "dot"))
        df = pd.DataFrame({"capacity": capacity, "hit_rate": hit_rate})
        tokens = "" if block_size is None else "<br>%{customdata:,} tokens"
        fig.add_trace(go.Scatter(
            x=df.capacity, y=df.hit_rate, mode="lines+markers",
            name=" = ".join(POLICY_NAMES.get(p, p) for p in policies),
            line={"color": colour, "dash": dash}, marker={"size": 5},
            customdata=None if block_size is None else df.capacity * block_size,
            hovertemplate=f"%{{x:,}} blocks{tokens}<br>hit rate %{{y:.2%}}<extra>%{{fullData.name}}</extra>"))
    top = max(float(points.hit_rate.max()) if len(points) else 0.0, 0.01)
    own = (f"at least {own_capacity:,} blocks held at once", "dashdot", "#d95f02") if inferred else (
        "this run's cache", "dash", "#888")
    for x, (text, dash, colour) in ((own_capacity, own), (unbounded, ("unbounded", "dot", "#888"))):
        if x:  # a trace, not a shape: on a log axis a shape's or annotation's x is read as a power of ten
            fig.add_trace(go.Scatter(x=[x, x], y=[0, top * 1.05], mode="lines", name=text,
                                     line={"dash": dash, "color": colour, "width": 1},
                                     hovertemplate=f"{text}: %{{x:,}} blocks<extra></extra>"))
    fig.update_xaxes(type="log", title="cache capacity (blocks, log scale)")
    fig.update_yaxes(title="prompt tokens served from the cache", tickformat=".0%", rangemode="tozero")
    fig.update_layout(height=420, margin={"l": 10, "r": 10, "t": 40, "b": 10}, legend={"orientation": "h", "y": -0.2})
    return clear_of_modebar(fig)


def isolation_cost(costs: pd.DataFrame) -> go.Figure:
    """costs: tenant, hit rate shared, hit rate salted (one row per tenant): what each tenant's salt costs
    it, as a pair of bars, the gap the hits sharing would have given it."""
    fig = go.Figure()
    for column, colour in (("hit rate shared", "#b0bec5"), ("hit rate salted", "#4c78a8")):
        fig.add_trace(go.Bar(x=costs.tenant, y=costs[column], name=column.replace("hit rate ", "").capitalize()
                             + (" (every block shared)" if column.endswith("shared") else " (as the run kept them)"),
                             marker_color=colour, hovertemplate="%{x}: %{y:.2%}<extra>%{fullData.name}</extra>"))
    fig.update_layout(barmode="group", height=300, margin={"l": 10, "r": 10, "t": 30, "b": 10},
                      legend={"orientation": "h", "y": -0.25})
    fig.update_xaxes(title="tenant (salt)", type="category")
    fig.update_yaxes(title="prompt tokens served", tickformat=".0%", rangemode="tozero")
    return clear_of_modebar(fig)
