"""Paged attention over the shared pool, plugged into unmodified transformers models.

The model runs one forward over every scheduled token of every request (`input_ids [1, T]`), with
the step's StepBatch in its kwargs (kvviz.models.routing sends each layer's attention to it). In each
layer the batch writes that layer's new K/V into the pool by slot mapping, gathers each group's keys
by physical slot and attends under the mask the step plan built once for all layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby

import torch

from .defences import sdpa_attend


class KVTensors:
    """The physical K/V pool of every layer, [num_slots, kv_heads, head_dim], made on first write (on
    the model's device, or on `device`: the host tier's pool)."""

    def __init__(self, num_slots: int, device: str | None = None):
        self.num_slots, self.device = num_slots, device
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def layer(self, idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if idx not in self.k:
            shape = (self.num_slots, like.shape[1], like.shape[-1])  # like: [1, KVH, T, D] or a pool [S, KVH, D]
            self.k[idx] = torch.zeros(shape, dtype=like.dtype, device=self.device or like.device)
            self.v[idx] = torch.zeros(shape, dtype=like.dtype, device=self.device or like.device)
        return self.k[idx], self.v[idx]

    def bytes_per_slot(self) -> int:
        """K and V of one slot in every layer made so far."""
        return sum(t[0].numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def copy_blocks(self, pairs: list[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: duplicate whole blocks (src -> dst) in every layer."""
        _copy(self, self, pairs, block_size)

    def transfer(self, host: KVTensors, transfers: list, block_size: int) -> None:
        """Offloads (this pool -> host) and restores (host -> this pool) in the order they were decided:
        a host block offloaded to after a restore read it must be read first."""
        for kind, run in groupby(transfers, key=lambda t: t.kind):
            pairs = [(t.device_block, t.host_block) for t in run]
            if kind == "offload":
                _copy(self, host, pairs, block_size)
            else:
                _copy(host, self, [(h, d) for d, h in pairs], block_size)


def _copy(src: KVTensors, dst: KVTensors, pairs: list[tuple[int, int]], block_size: int) -> None:
    """Whole blocks (src block -> dst block) in every layer, from one pool to another or within one."""
    if not pairs or not src.k:
        return
    offs = torch.arange(block_size)
    s = (torch.tensor([a for a, _ in pairs])[:, None] * block_size + offs).flatten()
    d = (torch.tensor([b for _, b in pairs])[:, None] * block_size + offs).flatten()
    first = next(iter(src.k.values()))
    s = s.to(first.device)
    for idx in src.k:
        kd, vd = dst.layer(idx, src.k[idx])
        d = d.to(kd.device)
        kd[d] = src.k[idx][s].to(kd.device)
        vd[d] = src.v[idx][s].to(vd.device)


@dataclass
class AttentionGroup:
    """Queries that share one key layout: a request's prefill chunk, all decode tokens of the
    step, or (shared-axis mechanism) every query against every live slot."""

    start: int  # the group's queries are packed tokens start .. start + R*Q, row by row
    key_slots: torch.Tensor  # [R, L] physical slots read as keys (padding is masked out)
    mask: torch.Tensor  # [R, Q, L] True = may attend
    layout: str = field(init=False, default="masked")  # see sdpa_attend: lets SDPA skip the mask or the blind rows
    span: slice = field(init=False)

    def __post_init__(self) -> None:
        R, Q, L = self.mask.shape
        self.span = slice(self.start, self.start + R * Q)
        if bool(self.mask.all()):
            self.layout = "full"
        elif R == 1 and Q == L and torch.equal(self.mask[0], torch.ones_like(self.mask[0]).tril()):
            self.layout = "causal"
        elif bool(self.mask.any(-1).all()):
            self.layout = "padded"


def _gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool[slots] for slots [R, L]; index_select is several times faster than indexing on CPU."""
    return pool.index_select(0, slots.flatten()).view(*slots.shape, *pool.shape[1:])


@dataclass
class StepBatch:
    """Everything the attention function needs for one step, built once and shared by all layers."""

    write_slots: torch.Tensor  # [T] where each new token's K/V goes
    groups: list[AttentionGroup]
    kv: KVTensors
    attend: Callable | None  # the inspect path's attend defence; None selects the fast path
    on_probs: Callable[[int, AttentionGroup, torch.Tensor], None] | None = None

    def __call__(self, module, query, key, value, scaling=None):
        """One layer's attention; query [1, H, T, D], key/value [1, KVH, T, D] (RoPE applied)."""
        kc, vc = self.kv.layer(module.layer_idx, key)
        kc.index_copy_(0, self.write_slots, key[0].transpose(0, 1))
        vc.index_copy_(0, self.write_slots, value[0].transpose(0, 1))
        q = query[0].transpose(0, 1)  # [T, H, D]
        if len(self.groups) == 1:  # a step that only decodes (or one prefill chunk): no copy into `out`
            return self._group(module.layer_idx, self.groups[0], q, kc, vc, scaling).reshape(q.shape)[None], None
        out = torch.empty_like(q)
        for g in self.groups:
            out[g.span] = self._group(module.layer_idx, g, q, kc, vc, scaling).reshape(-1, *q.shape[1:])
        return out[None], None

    def _group(self, layer: int, g: AttentionGroup, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """One group's output [R, Q, H, D] from its queries and the keys it gathers from the pool."""
        qg = q[g.span].view(*g.mask.shape[:2], *q.shape[1:])
        kg, vg = _gather(kc, g.key_slots), _gather(vc, g.key_slots)
        if self.attend is None:
            return sdpa_attend(qg, kg, vg, g.mask, scaling, g.layout)
        og, probs = self.attend(qg, kg, vg, g.mask, scaling, layer)
        if self.on_probs is not None:
            self.on_probs(layer, g, probs)
        return og
