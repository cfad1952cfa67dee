"""The prefix tree of a KV-event capture: hash chains as a tree, salts as colours."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from .palette import LEAK, clear_of_modebar, request_colours


def tree_layout(nodes: pd.DataFrame) -> pd.DataFrame:
    """Depth (blocks from the root) and a row per leaf, parents centred over their children."""
    children: dict = {}
    known = set(nodes.block_hash)
    roots = []
    for h, p in zip(nodes.block_hash, nodes.parent_hash, strict=True):
        if p is None or pd.isna(p) or p not in known:
            roots.append(h)
        else:
            children.setdefault(p, []).append(h)
    depth, row = {}, {}
    next_row = 0
    stack = [(r, 0, False) for r in reversed(roots)]
    while stack:
        h, d, done = stack.pop()
        if done:
            kids = children.get(h, [])
            row[h] = sum(row[k] for k in kids) / len(kids) if kids else row[h]
            continue
        depth[h] = d
        kids = children.get(h, [])
        if not kids:
            row[h] = next_row
            next_row += 1
        stack.append((h, d, True))
        stack.extend((k, d + 1, False) for k in reversed(kids))
    return nodes.assign(depth=nodes.block_hash.map(depth), row=nodes.block_hash.map(row))


def prefix_tree(nodes: pd.DataFrame, token_text=lambda ids: str(list(ids)[:8])) -> go.Figure:
    """nodes: block_hash, parent_hash, salt, lora_name, stored_step, removed_step, token_ids (and
    salts: how many, a hash stored under several is outlined in red; media: the tiers that held it;
    untold: its store events named no salt, so the salt is the chain's and its own tenant unknown).
    Colour: salt; hollow: evicted; diamond: own tenant unknown."""
    laid = tree_layout(nodes)
    pos = dict(zip(laid.block_hash, zip(laid.depth, laid.row, strict=True), strict=True))
    ex, ey = [], []
    for h, p in zip(laid.block_hash, laid.parent_hash, strict=True):
        if p in pos:
            ex += [pos[p][0], pos[h][0], None]
            ey += [pos[p][1], pos[h][1], None]
    fig = go.Figure(go.Scatter(x=ex, y=ey, mode="lines", line={"color": "#bbb", "width": 1}, hoverinfo="skip",
                               showlegend=False))
    colours = request_colours(laid.salt.fillna("(no salt)"))
    laid = laid.assign(salt=laid.salt.fillna("(no salt)"), evicted=laid.removed_step.notna(),
                       shared=laid.get("salts", pd.Series(1, index=laid.index)).fillna(1) > 1,
                       untold=laid.get("untold", pd.Series(False, index=laid.index)).fillna(False).astype(bool))
    for (salt, untold, evicted), part in laid.groupby(["salt", "untold", "evicted"]):
        name = f"{salt}'s chain, own tenant unknown" if untold else f"salt {salt}"
        shape = "diamond" if untold else "circle"
        fig.add_trace(go.Scatter(
            x=part.depth, y=part.row, mode="markers", name=name + (" (evicted)" if evicted else ""),
            marker={"size": 9, "color": colours[salt], "symbol": f"{shape}-open" if evicted else shape,
                    "line": {"width": [3 if s else 2 for s in part.shared],
                             "color": [LEAK if s else colours[salt] for s in part.shared]}},
            text=[f"{h:016x}<br>stored at {s}" + (f", removed at {int(r)}" if pd.notna(r) else "") +
                  (f"<br>on {m}" if isinstance(m, str) else "") + (f"<br>LoRA {lo}" if lo else "") +
                  (" <b>shared across salts</b>" if sh else "") +
                  (f"<br>its store named no salt: {name}" if untold else "") +
                  f"<br>{token_text(t) if t is not None else ''}"
                  for h, s, r, m, lo, t, sh in zip(part.block_hash, part.stored_step, part.removed_step,
                                                   part.get("media", pd.Series(None, index=part.index)),
                                                   part.lora_name, part.token_ids, part.shared, strict=True)],
            hovertemplate="%{text}<extra></extra>"))
    fig.update_layout(height=min(900, 200 + 6 * max(1, int(laid.row.max() or 0))), plot_bgcolor="white",
                      margin={"l": 10, "r": 10, "t": 30, "b": 10},
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"},  # off the depth axis
                      xaxis_title="block in chain (depth)", xaxis={"dtick": 1, "rangemode": "tozero"})
    fig.update_yaxes(visible=False)
    return clear_of_modebar(fig)


FOLDED = "#9e9e9e"  # a segment's less used children, folded into one
DEPTH = 3  # levels the icicle draws at a time, its "all blocks" root included


def drawn(df: pd.DataFrame, depth: int = DEPTH) -> pd.DataFrame:
    """The segments reuse_tree draws before any click: those within `depth` levels, root included (deeper
    ones open when their ancestor is clicked), so a caption counts what the chart shows."""
    parent = dict(zip(df.id, df.parent, strict=True))
    level = {}
    for seg in df.id:  # rows come parents first: a parent's level is known before its children's
        level[seg] = 1 if not parent[seg] else level[parent[seg]] + 1
    return df[df.id.map(level) < depth]


def reuse_tree(df: pd.DataFrame, depth: int = DEPTH) -> go.Figure:
    """df: captures.reuse_tree's segments. An icicle, depth left to right: height is use (stores and hits), a chain of
    single children is one segment, `depth` levels at a time; click a segment to open its subtree.
    Red: a segment more than one tenant used; grey: a segment's less used children, folded."""
    label = ["all blocks"] + [f"{n} more chains" if n else f"{b} blocks from {f.lstrip('0')[:8] or '0'}" if b > 1
                              else f.lstrip("0")[:12] or "0" for f, b, n in zip(df["first"], df.blocks, df.folded,
                                                                                 strict=True)]
    colour = ["#eceff1"] + [FOLDED if n else LEAK if t > 1 else "#4c78a8" for t, n in zip(df.tenants, df.folded,
                                                                                           strict=True)]
    custom = df[["first", "blocks", "tokens", "hits", "salts"]].to_numpy()
    fig = go.Figure(go.Icicle(  # one named root over the busiest subtrees, so the top band says what it is
        ids=["all", *df.id], parents=["", *df.parent.replace("", "all")], labels=label, values=[0, *df.uses],
        branchvalues="remainder", maxdepth=depth, marker={"colors": colour},
        textfont={"color": ["#333333"] + ["#ffffff"] * len(df)},
        customdata=[["", "", "", "", ""], *custom.tolist()],
        hovertext=["all blocks"] + [f"{n} chains folded: {b} blocks, {t} tokens" if n else
                                    f"from {f}: {b} blocks, {t} tokens" for f, b, t, n in
                                    zip(df["first"], df.blocks, df.tokens, df.folded, strict=True)],
        hovertemplate="%{hovertext}<br>used %{value} times, %{customdata[3]} hits<br>tenants: %{customdata[4]}"
                      "<extra></extra>",
        tiling={"orientation": "h"}))
    # a label that fits only shrunk below a readable size is hidden (its hover still says it), not drawn tiny
    fig.update_layout(height=640, margin={"l": 5, "r": 5, "t": 5, "b": 5}, uniformtext={"minsize": 11, "mode": "hide"})
    return clear_of_modebar(fig)
