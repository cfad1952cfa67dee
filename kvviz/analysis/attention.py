"""Attention as pictures need it: a request's query x key matrix with each key's owner and class,
and the layer x head grid of foreign mass.

The recorded classes are the oracle's (own, foreign, stale); the view adds one: an own key (an exact
copy) that another tenant wrote, which a shared prefix block across tenants gives. It is no leak, but
it is not the request's own either, so it is drawn apart and its blocks are named."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pandas as pd

from .cross_reads import BlockRead, tenant_name
from .tokens import label, request_tokens, sequence_labels, slot_contents, slot_contents_at, token_texts

UNSEEN, OWN, FOREIGN, STALE = -1, 0, 1, 2  # as recorded
CROSS = 3  # own by content, written by another tenant (the view's, never recorded)
HEAD_MEAN = -1
_MERGE_RANK = np.array([0, 1, 3, 4, 2])  # by code + 1: unseen < own < cross < foreign < stale, what a merged cell shows


@dataclass
class AttentionView:
    """weights [Q, K] (NaN where the query could not see the key: future or masked) and classes [Q, K]."""

    weights: np.ndarray
    classes: np.ndarray
    query_labels: list[str]
    key_labels: list[str]
    key_owners: list[str]  # the request that wrote each key column ("" when unknown)
    key_slots: list[int]
    head: int  # the head shown (-1: mean), which differs from the one asked for when that was not recorded
    binned: bool  # rows or columns were merged (max) to fit the screen
    query_rows: list[tuple[int, int]]  # (step, position) of each row (its first, when rows were merged)
    cross_reads: list[BlockRead] = field(default_factory=list)  # blocks of CROSS keys the rows read (before merging)

    def row_of(self, step: int, position: int | None) -> int | None:
        """The row holding this step's query at this position (a finding's), if shown."""
        if position is None:
            return None
        return next((i for i, r in enumerate(self.query_rows) if r == (step, position)), None)

    @property
    def foreign_mass(self) -> np.ndarray:
        """Per query row: the weight on foreign and stale keys."""
        return np.nansum(np.where(np.isin(self.classes, (FOREIGN, STALE)), self.weights, 0.0), axis=1)


def recorded_heads(con: duckdb.DuckDBPyConnection, run_id: str, layer: int) -> list[int]:
    return [r[0] for r in con.execute("SELECT DISTINCT head FROM attention WHERE run_id = ? AND layer = ? "
                                      "ORDER BY head", [run_id, layer]).fetchall()]


def attention_view(con: duckdb.DuckDBPyConnection, run_id: str, request: str, step: int, layer: int, head: int,
                   block_size: int, *, upto: bool = False, shared_axis: bool = False, max_rows: int = 160,
                   max_cols: int = 320) -> AttentionView | None:
    """The request's query rows at `step` (or at every step up to it) over the key slots they read.
    With shared_axis (the masked mechanism) every live slot of the step is a column, so the other
    requests' slots show as masked bands, as in the seed's shared-buffer table. None when no row of
    this request was recorded there."""
    if head != HEAD_MEAN and head not in recorded_heads(con, run_id, layer):
        head = HEAD_MEAN
    rows = con.execute(
        f"SELECT step, position, key_slots, weights, key_classes FROM attention WHERE run_id = ? AND request_id = ? "
        f"AND layer = ? AND head = ? AND step {'<=' if upto else '='} ? ORDER BY step, position",
        [run_id, request, layer, head, step]).fetchall()
    if not rows:
        return None
    read_at = {s: st for st, _, ks, *_ in rows for s in ks}  # each slot's last read (rows in step order)
    # a slot reused since this request read it is labelled by what it read then
    read = slot_contents_at(con, run_id, read_at, block_size).set_index("slot")
    slots = set(read_at)
    contents = read
    if shared_axis:  # every live slot of the step is a column, labelled by what it holds then
        now = slot_contents(con, run_id, step, block_size).set_index("slot")
        live = {b for (b,) in con.execute("SELECT DISTINCT physical_block FROM page_tables WHERE run_id = ? AND "
                                          "step = ?", [run_id, step]).fetchall()}
        slots |= {s for s in now.index if s // block_size in live}
        contents = pd.concat([now.drop(read.index, errors="ignore"), read])
    slots = sorted(slots)
    col = {s: i for i, s in enumerate(slots)}
    weights = np.full((len(rows), len(slots)), np.nan, np.float32)
    classes = np.full((len(rows), len(slots)), UNSEEN, np.int8)
    for i, (_, _, ks, ws, cs) in enumerate(rows):
        idx = [col[s] for s in ks]
        weights[i, idx] = ws
        classes[i, idx] = cs
    texts = token_texts(con, run_id)
    sequences = request_tokens(con, run_id)
    seq = sequences.get(request, [])
    named: dict[str, list[str]] = {}  # a writer's labels with a character's pieces named as one, when it shows

    def token_at(writer, pos: int, token: int | None) -> str:
        s = sequences.get(writer, [])
        if token is None or not 0 <= pos < len(s) or s[pos] != token:
            return label(texts, token)
        if writer not in named:
            named[writer] = sequence_labels(texts, s)
        return named[writer][pos]

    q_labels = [f"{pos} {token_at(request, pos, seq[pos] if pos < len(seq) else None)}" for _, pos, *_ in rows]
    held = dict(zip(contents.index, zip(contents.request_id, contents.position, contents.token, strict=True),
                    strict=True))
    owners = [str(held[s][0]) if s in held else "" for s in slots]
    tenant = dict(con.execute("SELECT request_id, tenant FROM requests WHERE run_id = ?", [run_id]).fetchall())
    crossed = {o: f" [{tenant[o] or 'no tenant'}]" for o in set(owners)  # an exact copy, written under another salt
               if o in tenant and request in tenant and tenant[o] != tenant[request]}
    k_labels = [f"{held[s][0]}:{held[s][1]} {token_at(*held[s])}{crossed.get(owners[i], '')}" if s in held
                else f"slot {s}" for i, s in enumerate(slots)]
    other = np.array([o in crossed for o in owners], bool)
    classes[(classes == OWN) & other[None, :]] = CROSS
    query_rows = [(int(st), int(pos)) for st, pos, *_ in rows]
    view = AttentionView(weights, classes, q_labels, k_labels, owners, slots, head, False, query_rows,
                         _cross_reads(weights, classes, slots, owners, query_rows, request, tenant, block_size))
    return downsample(view, max_rows, max_cols)


def _cross_reads(weights: np.ndarray, classes: np.ndarray, slots: list[int], owners: list[str],
                 query_rows: list[tuple[int, int]], request: str, tenant: dict, block_size: int) -> list[BlockRead]:
    """Per block holding CROSS keys that a row gave weight: its writer and the first and last step read."""
    hit = (classes == CROSS) & (np.nan_to_num(weights) > 0)
    steps = np.array([s for s, _ in query_rows])
    spans: dict[tuple[int, str], tuple[int, int]] = {}
    for j in np.flatnonzero(hit.any(0)):
        read = steps[hit[:, j]]
        key = (slots[j] // block_size, owners[j])
        a, b = spans.get(key, (int(read.min()), int(read.max())))
        spans[key] = (min(a, int(read.min())), max(b, int(read.max())))
    return [BlockRead(request, tenant_name(tenant[request]), writer, tenant_name(tenant[writer]), block, a, b)
            for (block, writer), (a, b) in sorted(spans.items())]


def downsample(v: AttentionView, max_rows: int, max_cols: int) -> AttentionView:
    """Merge neighbouring rows/columns by max so that a leak in any of them stays visible."""
    Q, K = v.weights.shape
    if Q <= max_rows and K <= max_cols:
        return v
    rb, cb = -(-Q // max_rows), -(-K // max_cols)
    ranks = _bin_max(_MERGE_RANK[v.classes + 1].astype(np.float32), rb, cb).astype(np.int64)
    w, c = _bin_max(v.weights, rb, cb), np.argsort(_MERGE_RANK)[ranks].astype(np.int8) - 1
    return AttentionView(w, c, [lab + ("…" if rb > 1 else "") for lab in v.query_labels[::rb]],
                         [lab + ("…" if cb > 1 else "") for lab in v.key_labels[::cb]], v.key_owners[::cb],
                         v.key_slots[::cb], v.head, True, v.query_rows[::rb], v.cross_reads)


def _bin_max(a: np.ndarray, rb: int, cb: int) -> np.ndarray:
    Q, K = a.shape
    padded = np.full((-(-Q // rb) * rb, -(-K // cb) * cb), np.nan, np.float32)
    padded[:Q, :K] = a
    blocks = padded.reshape(padded.shape[0] // rb, rb, padded.shape[1] // cb, cb)
    with warnings.catch_warnings():  # an all-unseen bin stays NaN; nanmax warns about it (errstate does not cover that)
        warnings.simplefilter("ignore", RuntimeWarning)
        out = np.nanmax(blocks, axis=(1, 3)) if np.isnan(blocks).any() else blocks.max(axis=(1, 3))
    return out


def leak_grid(con: duckdb.DuckDBPyConnection, run_id: str, step: int | None = None,
              request: str | None = None) -> pd.DataFrame:
    """Max foreign (+ stale) mass per (layer, head), at one step or over the run, for one request or all."""
    where, params = ["run_id = ?"], [run_id]
    if step is not None:
        where.append("step = ?")
        params.append(step)
    if request is not None:
        where.append("request_id = ?")
        params.append(request)
    return con.execute(f"SELECT layer, head, max(max_foreign) AS max_foreign, sum(leak_rows) AS leak_rows "
                       f"FROM leak_metrics WHERE {' AND '.join(where)} GROUP BY layer, head ORDER BY layer, head",
                       params).df()


def grid_shape(con: duckdb.DuckDBPyConnection, run_id: str) -> tuple[int, int]:
    """(layers, heads) the oracle measured in this run; (0, 0) when it has no leak metrics."""
    layers, heads = con.execute("SELECT max(layer) + 1, max(head) + 1 FROM leak_metrics WHERE run_id = ?",
                                [run_id]).fetchone()
    return int(layers or 0), int(heads or 0)
