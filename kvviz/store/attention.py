"""Records attention rows: one per (step, layer, head, request, query position), holding the key
slots a query read, their weights and each key's class (0 own, 1 foreign, 2 stale).

The weights are the big part of a run (SmolLM2: 270 rows per generated token), so by default only
the head mean of every layer and all heads of three layers (first, middle, last) are kept, plus all
heads of any layer where the oracle saw a leak in that step (so every finding's head can be shown);
keys a query could not see and gave no weight are dropped. Rows are buffered as flat arrays with offsets
and become Arrow list columns without a Python loop per row.

The keys a query could see are the same in every layer and head, so they are written once per query
(attention_keys) and its rows hold only their weights (null key lists; the store's `attention` view
joins them back). A row keeps its own keys only where its head put weight on a key its query could not
see (a fault), since its cells then differ from its query's.

A layer's kept rows wait, up to PENDING_CELLS cells, and are cut into cells with the step's other
layers of the same group in one pass: a decode step's 30 small layers were 30 rounds of the same
half-dozen torch calls on the engine's thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from ..engine.attention import AttentionGroup
from ..engine.observer import StepContext
from ..oracle import ProvenanceOracle

HEAD_MEAN = -1  # the head column of a row that averages all heads
PENDING_CELLS = 1 << 22  # kept cells (float32: 16 MB) held back before they are cut (see the docstring)


@dataclass
class _Cells:
    """A group's kept cells in one layer, all but the weights: (request, head, query) rows and the key
    slots and classes of their cells, flat."""

    group: AttentionGroup  # held so that its id stays this group's for the step
    visible: torch.Tensor  # the kept cells' mask
    head: np.ndarray
    row: np.ndarray
    position: np.ndarray
    lengths: np.ndarray
    slots: np.ndarray | None  # None: the rows read their query's keys, recorded once in attention_keys
    classes: np.ndarray | None


@dataclass(frozen=True)
class AttentionSelection:
    """Which rows to keep. mode: "default" (head mean of every layer, all heads of full_layers),
    "all" (every head of every layer) or "none"; optionally only some steps and requests."""

    mode: str = "default"
    full_layers: frozenset[int] | None = None  # None: first, middle and last layer
    steps: frozenset[int] | None = None
    requests: frozenset[str] | None = None

    def layers_with_all_heads(self, num_layers: int) -> frozenset[int]:
        if self.mode == "all":
            return frozenset(range(num_layers))
        return self.full_layers if self.full_layers is not None else frozenset({0, num_layers // 2, num_layers - 1})


class AttentionRecorder:
    """An AttentionObserver; attach after the oracle, whose key classes it reuses."""

    def __init__(self, oracle: ProvenanceOracle, num_layers: int, selection: AttentionSelection):
        self.oracle, self.selection = oracle, selection
        self.full = selection.layers_with_all_heads(num_layers)
        self.chunks: list[dict] = []

    def begin_step(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.names = [w.seq_id for w in ctx.work]
        sel = self.selection
        self.skip = sel.mode == "none" or (sel.steps is not None and ctx.step not in sel.steps)
        self.wanted = torch.tensor([sel.requests is None or n in sel.requests for n in self.names],
                                   device=ctx.q_row.device)  # per request of the step, for every layer
        self.layouts: dict[tuple[int, int], _Cells] = {}  # (group, heads kept) -> its cells this step
        self.keyed: dict[int, torch.Tensor] = {}  # group -> its queries' key counts [R, Q], keys recorded
        self.kept: dict[int, bool] = {}  # group -> whether any of its requests is recorded
        self.classes: dict[int, torch.Tensor] = {}  # group -> the oracle's key classes (gone after its end_step)
        self.pending: dict[tuple[int, int], tuple[AttentionGroup, list[int], list[tuple[int, torch.Tensor]]]] = {}
        self.pending_cells = 0

    def on_attention(self, layer: int, group: AttentionGroup, probs: torch.Tensor) -> None:
        if self.skip or not self._kept(group):
            return
        every_head = layer in self.full or (self.selection.mode == "default" and self.oracle.leaked_in(layer, group))
        heads = [HEAD_MEAN] + (list(range(probs.shape[1])) if every_head else [])
        rows = torch.cat([probs.mean(1, keepdim=True), probs], 1) if every_head else probs.mean(1, keepdim=True)
        _, _, layers = self.pending.setdefault((id(group), len(heads)), (group, heads, []))
        layers.append((layer, rows))
        self.pending_cells += rows.numel()
        if self.pending_cells >= PENDING_CELLS:
            self._cut_pending()

    def end_step(self) -> None:
        self._cut_pending()

    def _kept(self, group: AttentionGroup) -> bool:
        if (kept := self.kept.get(id(group))) is None:
            qr = self.ctx.q_row[group.span]
            kept = self.kept[id(group)] = bool(self.wanted[qr].any())
            if kept:
                self.classes[id(group)] = self.oracle.key_classes(group)
        return kept

    def _cut_pending(self) -> None:
        """The held rows as chunks, layer by layer: per group, one check for weight on keys a query could
        not see, and one select over the layers that put none there (their cells are their query's keys)."""
        for group, heads, layers in self.pending.values():
            # [layers, R, heads, Q, L]; a prefill chunk's layer, cut alone, is not copied
            stack = layers[0][1][None] if len(layers) == 1 else torch.stack([rows for _, rows in layers])
            strays = self._strays(group, stack)
            clean = [i for i, stray in enumerate(strays) if not stray]
            if clean:
                cells = self._layout(group, heads)
                picked = stack if len(clean) == len(layers) else stack[clean]
                weights = np.split(picked.masked_select(cells.visible[None, :, None]).float().cpu().numpy(),
                                   len(clean))
                for i, w in zip(clean, weights, strict=True):
                    self._chunk(layers[i][0], cells, w)
            for i in (i for i, stray in enumerate(strays) if stray):
                self._chunk(layers[i][0], *self._cells_per_head(group, heads, stack[i]))
        self.pending.clear()
        self.pending_cells = 0

    def _chunk(self, layer: int, cells: _Cells, weights: np.ndarray) -> None:
        self.chunks.append({"step": self.ctx.step, "layer": layer, "head": cells.head, "row": cells.row,
                            "position": cells.position, "lengths": cells.lengths, "slots": cells.slots,
                            "weights": weights, "classes": cells.classes, "names": self.names})

    @staticmethod
    def _strays(group: AttentionGroup, stack: torch.Tensor) -> list[bool]:
        """Per layer of a [layers, R, heads, Q, L] stack: whether a row put weight on a key its query could
        not see (which a fault gives): its cells are then its own, not its query's."""
        return ((stack > 0) & ~group.mask[None, :, None]).flatten(1).any(1).tolist()

    def _rows(self, group: AttentionGroup, heads: list[int]) -> tuple[np.ndarray, ...]:
        """The kept rows of a group as (request, head, query) arrays: which to keep, head, row, position."""
        R, Q, _ = group.mask.shape
        qr, qp = self.ctx.q_row[group.span].view(R, Q), self.ctx.q_pos[group.span].view(R, Q)
        keep = self.wanted[qr][:, None, :].expand(R, len(heads), Q).reshape(-1).cpu().numpy()
        return (keep, np.repeat(np.tile(np.array(heads), R), Q)[keep],
                qr[:, None, :].expand(R, len(heads), Q).reshape(-1).cpu().numpy()[keep],
                qp[:, None, :].expand(R, len(heads), Q).reshape(-1).cpu().numpy()[keep])

    def _layout(self, group: AttentionGroup, heads: list[int]) -> _Cells:
        """The cells kept when every head keeps the keys its query could see: the same in every layer of
        the step with as many heads, so found once (the nonzero and the slot and class gathers over a
        prefill chunk's keys were most of the recorder's cost when done per layer)."""
        key = (id(group), len(heads))
        if key not in self.layouts:
            keep, head, row, position = self._rows(group, heads)
            qr = self.ctx.q_row[group.span].view(group.mask.shape[:2])
            visible = group.mask & self.wanted[qr][..., None]  # [R, Q, L]
            per_query = self._keys(group, visible, qr)
            lengths = per_query[:, None].expand(-1, len(heads), -1).reshape(-1).cpu().numpy()[keep]
            self.layouts[key] = _Cells(group, visible, head, row, position, lengths, None, None)
        return self.layouts[key]

    def _keys(self, group: AttentionGroup, visible: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        """The keys each kept query of the group could see, recorded once per step (an attention_keys
        chunk); returns the count per query [R, Q]."""
        if id(group) not in self.keyed:
            per_query = self.keyed[id(group)] = visible.sum(-1)
            r, q, k = visible.nonzero(as_tuple=True)  # in (request, query, key) order
            kept = self.wanted[qr].reshape(-1).cpu().numpy()
            R, Q = qr.shape
            self.chunks.append({
                "keys": True, "step": self.ctx.step, "row": qr.reshape(-1).cpu().numpy()[kept],
                "position": self.ctx.q_pos[group.span].reshape(-1).cpu().numpy()[kept],
                "lengths": per_query.reshape(-1).cpu().numpy()[kept], "names": self.names,
                "slots": group.key_slots[r, k].to(torch.int32).cpu().numpy(),
                "classes": self.classes[id(group)][r, q, k].cpu().numpy()})
        return self.keyed[id(group)]

    def _cells_per_head(self, group: AttentionGroup, heads: list[int], rows: torch.Tensor
                        ) -> tuple[_Cells, np.ndarray]:
        keep_rows, head, row, position = self._rows(group, heads)
        qr = self.ctx.q_row[group.span].view(group.mask.shape[:2])
        keep = ((rows > 0) | group.mask[:, None]) & self.wanted[qr][:, None, :, None]  # [R, heads, Q, L]
        lengths, slots, weights, classes = _cells_per_head(keep, rows, group.key_slots, self.classes[id(group)])
        return _Cells(group, keep, head, row, position, lengths[keep_rows], slots, classes), weights

    def take_chunks(self) -> list[dict]:
        """What was captured since the last call (numpy arrays the engine no longer touches): the
        engine thread hands these over and the recorder's writer thread builds the table."""
        chunks, self.chunks = self.chunks, []
        return chunks


def _cells_per_head(keep: torch.Tensor, rows: torch.Tensor, key_slots: torch.Tensor,
                    classes: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Kept cells of [R, heads, Q, L] rows that differ by head: one pass finds them; their row, query
    and key follow by arithmetic, so slots and classes are read without expanding them over the heads."""
    _, n_heads, Q, L = keep.shape
    idx = keep.view(-1).nonzero().squeeze(1)
    r, q, k = idx // (n_heads * Q * L), (idx // L) % Q, idx % L
    return (keep.sum(-1).reshape(-1).cpu().numpy(), key_slots.reshape(-1)[r * L + k].to(torch.int32).cpu().numpy(),
            rows.reshape(-1)[idx].float().cpu().numpy(), classes.reshape(-1)[(r * Q + q) * L + k].cpu().numpy())


def attention_tables(chunks: list[dict], run_id: str) -> dict[str, pa.Table]:
    """Captured chunks as Arrow tables: `attention` rows (null key lists where they read their query's
    keys) and `attention_keys`."""
    rows = [c for c in chunks if "keys" not in c]
    keys = [c for c in chunks if "keys" in c]
    out = {}
    if rows:
        out["attention"] = _table(rows, run_id, ("layer", "head"), weights=True)
    if keys:
        out["attention_keys"] = _table(keys, run_id, (), weights=False)
    return out


def _table(chunks: list[dict], run_id: str, per_chunk: tuple[str, ...], weights: bool) -> pa.Table:
    """Chunks of rows (flat cells with a length per row) as one table; a chunk without slots gives its
    rows null key lists."""
    cols: dict[str, list] = {k: [] for k in ("step", *per_chunk, "request_id", "position")}
    lengths, key_lengths, slots, classes, values = [], [], [], [], []
    for c in chunks:
        n = len(c["row"])
        cols["step"].append(np.full(n, c["step"], np.int32))
        for k in per_chunk:
            cols[k].append(np.full(n, c[k], np.int32) if k == "layer" else c[k].astype(np.int32))
        cols["request_id"].append(np.array(c["names"], dtype=object)[c["row"]])
        cols["position"].append(c["position"].astype(np.int32))
        lengths.append(c["lengths"])
        if weights:
            values.append(c["weights"])
        own = c["slots"] is not None
        key_lengths.append(c["lengths"] if own else np.zeros(n, np.int64))
        if own:
            slots.append(c["slots"])
            classes.append(c["classes"])
    table = {"run_id": pa.array([run_id] * sum(len(x) for x in lengths))}
    table.update({k: pa.array(np.concatenate(v)) for k, v in cols.items()})
    shared = pa.array(np.concatenate([np.full(len(c["row"]), c["slots"] is None) for c in chunks]))
    key_offsets = pa.array(_offsets(key_lengths))
    table["key_slots"] = pa.ListArray.from_arrays(key_offsets, _flat(slots, np.int32), mask=shared)
    if weights:
        table["weights"] = pa.ListArray.from_arrays(pa.array(_offsets(lengths)), _flat(values, np.float32))
    table["key_classes"] = pa.ListArray.from_arrays(key_offsets, _flat(classes, np.uint8), mask=shared)
    return pa.table(table)


def _offsets(lengths: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int32)


def _flat(parts: list[np.ndarray], dtype) -> pa.Array:
    return pa.array(np.concatenate(parts) if parts else np.zeros(0, dtype))
