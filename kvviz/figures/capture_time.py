"""A capture's cache on its time axis (seconds since the capture began): churn and hits per interval
(drag across it to choose a time range: the chart is the brush), occupancy split by replica, tier or
tenant, the distributions of lifetimes, idle times and reuse gaps on a log scale, and the evidence
of blocks shared across tenants and of blocks kept without their salt in another tier."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .cache import HIT, MISS
from .palette import clear_of_modebar, request_colours

STORED, EVICTED = "#4c78a8", "#e45756"
UNTOLD = "#8c8c8c"  # a store whose event names no salt: its own tenant unknown
REASONS = {"cold": "#bab0ac", "evicted": "#ff9da6", "capacity": "#9c2b2b", "namespace": "#b279a2",
           "diverged": "#f58518", "partial_block": "#72b7b2", "preempted": "#eeca3b", "unexplained": "#9d755d",
           "reset": "#d4a6c8"}
MARGIN = {"l": 10, "r": 10, "t": 40, "b": 10}


def activity(churn: pd.DataFrame, origin: float, width: float, reasons: pd.DataFrame | None = None) -> go.Figure:
    """churn: interval_start, stored, hits, evicted, hit_tokens, miss_tokens (summed over replicas here);
    reasons (optional): interval_start, reason, lookups. Above, blocks stored, hit and evicted per
    second; below, tokens served from the cache against tokens computed, or with `reasons` the misses
    (lookups) by why they missed. x: seconds since `origin`."""
    df = churn.groupby("interval_start", as_index=False).sum(numeric_only=True)
    x = df.interval_start - origin
    below = "misses by reason (lookups)" if reasons is not None else "tokens: served from the cache, computed"
    # each bar over its own interval [start, start + width): centred and auto-sized, sparse bars grew to the
    # gap between them and began before 0, though the caption says each bar is `width` seconds
    span = {"width": width, "offset": 0}
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1, row_heights=[0.5, 0.5],
                        subplot_titles=("blocks per second: stored, hit, evicted (down)", below))
    # each chart's bars under their own legend title: the tokens served share the hits' colour, not their entry
    blocks = {"legendgroup": "blocks", "legendgrouptitle_text": "blocks"}
    for name, y, colour in (("stored (new)", df.stored, STORED), ("hit (stored again)", df.hits, HIT),
                            ("evicted", -df.evicted, EVICTED)):
        fig.add_trace(go.Bar(x=x, y=y / width, name=name, marker_color=colour, **blocks, **span), row=1, col=1)
    if reasons is None:
        tokens = {"legendgroup": "tokens", "legendgrouptitle_text": "tokens"}
        for name, y, colour in (("tokens served from the cache", df.hit_tokens, HIT),
                                ("tokens computed (misses)", df.miss_tokens, MISS)):
            fig.add_trace(go.Bar(x=x, y=y, name=name, marker_color=colour, **tokens, **span), row=2, col=1)
    else:
        misses = {"legendgroup": "misses", "legendgrouptitle_text": "misses"}
        for reason, part in reasons.groupby("reason", sort=True):
            fig.add_trace(go.Bar(x=part.interval_start - origin, y=part.lookups, name=f"miss: {reason}",
                                 marker_color=REASONS.get(reason, "#888"), **misses, **span), row=2, col=1)
    fig.update_layout(barmode="relative", height=460, margin=MARGIN, legend={"orientation": "h", "y": -0.22},
                      dragmode="select", selectdirection="h")
    fig.update_xaxes(title="seconds since the capture began (drag across the chart to choose a range)", row=2, col=1)
    return clear_of_modebar(fig)


def occupancy(df: pd.DataFrame, origin: float, split: str, untold: str | None = None) -> go.Figure:
    """df: interval_start, series, cached: stacked areas, one per replica, tier or tenant. A series named
    a tenant's plus `untold` (its chains' blocks whose own tenant is unknown) takes that tenant's colour,
    hatched, beside it in the legend (a colour for each of them repeated colours from eight tenants on)."""
    fig = go.Figure()
    tenant = {n: n[:-len(untold)] if untold and str(n).endswith(untold) else n for n in df.series.unique()}
    colours = request_colours(tenant.values())
    for name, part in df.groupby("series", sort=True):
        colour, hatched = colours[tenant[name]], tenant[name] != name
        fig.add_trace(go.Scatter(x=part.interval_start - origin, y=part.cached, name=str(name), stackgroup="one",
                                 line={"color": colour, "shape": "hv", "width": 1}, legendgroup=str(tenant[name]),
                                 fillcolor=colour if not hatched else None,
                                 fillpattern={"shape": "/", "fgcolor": colour, "bgcolor": "white", "solidity": 0.4}
                                 if hatched else None))
    # the legend beside the plot, a series a line: under it, a row of many series ran into the axis title
    fig.update_layout(height=400, margin=MARGIN, legend={"traceorder": "normal", "title": {"text": split}},
                      showlegend=True, title=f"blocks cached, per {split}")  # named even when there is one
    fig.update_xaxes(title="seconds since the capture began", rangemode="nonnegative")  # no padding before 0
    fig.update_yaxes(title="blocks")
    return clear_of_modebar(fig)


def durations(df: pd.DataFrame, bins_per_decade: int) -> go.Figure:
    """df: measure, seconds (a bin's lower edge, bins_per_decade to a power of ten), count: one histogram
    per measure, both axes log (the durations span decades, and a tail of a few blocks next to a peak of
    thousands must still show). Each bar spans its bin, so bars are as wide at hours as at milliseconds."""
    order = ("lifetime", "idle before eviction", "reuse gap")
    step = 10 ** (1 / bins_per_decade)
    fig = make_subplots(rows=1, cols=3, subplot_titles=[f"{m} (s)" for m in order])
    for col, (measure, colour) in enumerate(zip(order, (STORED, EVICTED, HIT), strict=True), start=1):
        part = df[df.measure == measure]
        fig.add_trace(go.Bar(x=part.seconds, y=part["count"], width=part.seconds * (step - 1) * 0.95, offset=0,
                             name=measure, marker_color=colour, customdata=part.seconds * step,
                             hovertemplate="%{x:.3g} to %{customdata:.3g} s: %{y}<extra></extra>"), row=1, col=col)
        # a tick a decade: 0.01, 0.1, 1, 10 ...; the range takes in the decades around the bars, or one bar (a
        # capture with one eviction) would sit inside a decade with no tick to read it by
        edges = part.seconds[part.seconds > 0]
        span = ([math.floor(math.log10(edges.min())), math.ceil(math.log10(edges.max() * step))]
                if len(edges) else None)
        fig.update_xaxes(type="log", dtick=1, range=span, row=1, col=col)
    fig.update_layout(height=280, showlegend=False, margin=MARGIN)
    fig.update_yaxes(type="log", dtick=1)
    fig.update_yaxes(title="blocks (log)", row=1, col=1)
    return clear_of_modebar(fig)


def cross_tenant(events: pd.DataFrame, origin: float) -> go.Figure:
    """events: replica, block_hash, ts, salt, told, chain, repeat: one row per block used by two tenants or
    more (the most used at the top), a mark at each store (circle: the block was new) and hit (diamond) in
    the colour of the tenant its event names: the evidence that tenants shared a cache entry, and when. A
    row whose event names no salt (`told` false) is hollow and grey, named by `salt` (its own tenant
    unknown) with the chain it continues (`chain`) in its hover."""
    label = events.block_hash.map("{:016x}".format) + (" on " + events.replica if events.replica.nunique() > 1 else "")
    df = events.assign(block=label, x=events.ts - origin, chain=events.chain.fillna("no salt"))
    colours = request_colours(df.salt[df.told])
    fig = go.Figure()
    for (salt, told, repeat), part in df.groupby(["salt", "told", "repeat"], sort=True):
        what = "hit" if repeat else "stored"
        said = f"{salt} ({what})" if told else f"{salt} ({what}; continues %{{customdata}}'s chain)"
        fig.add_trace(go.Scatter(
            x=part.x, y=part.block, mode="markers", name=f"{salt}: {what}", legendgroup=str(salt),
            customdata=part.chain,
            marker={"color": colours[salt] if told else UNTOLD, "size": 9,
                    "symbol": ("diamond" if repeat else "circle") + ("" if told else "-open"),
                    "line": {"color": "white" if told else UNTOLD, "width": 1 if told else 2}},
            hovertemplate="block %{y}<br>%{x:.3f} s<br>" + said + "<extra></extra>"))
    rows = df.block.nunique()
    fig.update_layout(height=max(220, 26 * rows + 120), margin=MARGIN, legend={"orientation": "h", "y": -0.15},
                      title="blocks used by more than one tenant: each store and hit, by the tenant its event names")
    fig.update_xaxes(title="seconds since the capture began")
    fig.update_yaxes(title="block hash", type="category", categoryorder="array",
                     categoryarray=list(dict.fromkeys(df.block))[::-1])  # the most used at the top
    return clear_of_modebar(fig)


def tier_salts(found: pd.DataFrame) -> go.Figure:
    """found: replica, salted_medium, unsalted_medium, salt, blocks, hits (cross_tier_salts): the blocks kept
    without their salt in another tier (left) and the hits that tier served from them (right), stacked by
    the salt of the salted copy, a row per replica and pair of media."""
    df = found.assign(where=found.replica + ": " + found.salted_medium + " salted, " + found.unsalted_medium
                      + " not")
    colours = request_colours(df.salt)
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=("blocks kept without their salt", "hits served from those copies"))
    for salt, part in df.groupby("salt", sort=True):
        for col, measure in ((1, "blocks"), (2, "hits")):
            fig.add_trace(go.Bar(y=part["where"], x=part[measure], orientation="h", name=str(salt),
                                 legendgroup=str(salt), showlegend=col == 1, marker_color=colours[salt],
                                 hovertemplate=f"{salt}<br>%{{y}}<br>%{{x}} {measure}<extra></extra>"), row=1, col=col)
    # tall enough for the legend too: one row of bars has room for about four salts, and plotly scrolls
    # the rest out of sight
    fig.update_layout(barmode="stack", height=max(200, 40 * df["where"].nunique() + 140, 34 * len(colours) + 70),
                      margin=MARGIN, legend={"title": {"text": "salt of the salted copy"}})
    return clear_of_modebar(fig)
