"""Records attention rows: one per (step, layer, head, request, query position), holding the key
slots a query read, their weights and each key's class (0 own, 1 foreign, 2 stale).

The weights are the big part of a run (SmolLM2: 270 rows per generated token), so by default only
the head mean of every layer and all heads of three layers (first, middle, last) are kept, plus all
heads of any layer where the oracle saw a leak in that step (so every finding's head can be shown);
keys a query could not see and gave no weight are dropped. Rows are buffered as flat arrays with offsets
and become Arrow list columns without a Python loop per row.
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
    slots: np.ndarray
    classes: np.ndarray


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

    def on_attention(self, layer: int, group: AttentionGroup, probs: torch.Tensor) -> None:
        if self.skip:
            return
        R, H, Q, L = probs.shape
        every_head = layer in self.full or (self.selection.mode == "default" and self.oracle.leaked_in(layer, group))
        heads = [HEAD_MEAN] + (list(range(H)) if every_head else [])
        rows = torch.cat([probs.mean(1, keepdim=True), probs] if len(heads) > 1 else [probs.mean(1, keepdim=True)], 1)
        qr = self.ctx.q_row[group.span].view(R, Q)
        if not bool(self.wanted[qr].any()):
            return
        if bool(((rows > 0) & ~group.mask[:, None]).any()):  # weight on keys a query could not see (a fault)
            cells, weights = self._cells_per_head(group, heads, rows)
        else:  # every head keeps the keys its query could see: the cells are the layer's, not the head's
            cells = self._layout(group, heads)
            weights = rows.masked_select(cells.visible[:, None]).float().cpu().numpy()  # (request, head, query, key)
        self.chunks.append({"step": self.ctx.step, "layer": layer, "head": cells.head, "row": cells.row,
                            "position": cells.position, "lengths": cells.lengths, "slots": cells.slots,
                            "weights": weights, "classes": cells.classes, "names": self.names})

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
            lengths, slots, classes = _cells_per_query(visible, len(heads), group.key_slots,
                                                       self.oracle.key_classes(group))
            self.layouts[key] = _Cells(group, visible, head, row, position, lengths[keep], slots, classes)
        return self.layouts[key]

    def _cells_per_head(self, group: AttentionGroup, heads: list[int], rows: torch.Tensor
                        ) -> tuple[_Cells, np.ndarray]:
        keep_rows, head, row, position = self._rows(group, heads)
        qr = self.ctx.q_row[group.span].view(group.mask.shape[:2])
        keep = ((rows > 0) | group.mask[:, None]) & self.wanted[qr][:, None, :, None]  # [R, heads, Q, L]
        lengths, slots, weights, classes = _cells_per_head(keep, rows, group.key_slots, self.oracle.key_classes(group))
        return _Cells(group, keep, head, row, position, lengths[keep_rows], slots, classes), weights

    def end_step(self) -> None:
        pass

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


def _cells_per_query(visible: torch.Tensor, n_heads: int, key_slots: torch.Tensor,
                     classes: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Row lengths, key slots and classes of the cells when every head keeps the keys its query could
    see: found once per query over [R, Q, L] and each request's repeated for its heads, in
    (request, head, query, key) order, the order of the weights' masked_select."""
    R = visible.shape[0]
    per_query = visible.sum(-1)  # [R, Q]
    r, q, k = visible.nonzero(as_tuple=True)  # in (request, query, key) order
    slots, key_classes = key_slots[r, k].to(torch.int32).cpu().numpy(), classes[r, q, k].cpu().numpy()
    if n_heads > 1:
        per_request = per_query.sum(1).cpu().numpy()
        spans = list(zip(np.cumsum(per_request) - per_request, np.cumsum(per_request), strict=True))
        slots = np.concatenate([np.tile(slots[s:e], n_heads) for s, e in spans])
        key_classes = np.concatenate([np.tile(key_classes[s:e], n_heads) for s, e in spans])
    return per_query[:, None].expand(R, n_heads, -1).reshape(-1).cpu().numpy(), slots, key_classes


def attention_table(chunks: list[dict], run_id: str) -> pa.Table | None:
    """Captured chunks as one Arrow table for the `attention` table."""
    if not chunks:
        return None
    cols: dict[str, list] = {k: [] for k in ("step", "layer", "head", "request_id", "position")}
    lengths, slots, weights, classes = [], [], [], []
    for c in chunks:
        n = len(c["head"])
        cols["step"].append(np.full(n, c["step"], np.int32))
        cols["layer"].append(np.full(n, c["layer"], np.int32))
        cols["head"].append(c["head"].astype(np.int32))
        cols["request_id"].append(np.array(c["names"], dtype=object)[c["row"]])
        cols["position"].append(c["position"].astype(np.int32))
        lengths.append(c["lengths"])
        slots.append(c["slots"])
        weights.append(c["weights"])
        classes.append(c["classes"])
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int32)
    n_rows = len(offsets) - 1
    table = {"run_id": pa.array([run_id] * n_rows)}
    table.update({k: pa.array(np.concatenate(v)) for k, v in cols.items()})
    table["key_slots"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(slots)))
    table["weights"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(weights)))
    table["key_classes"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(classes)))
    return pa.table(table)
