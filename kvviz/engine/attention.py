"""Paged attention over the shared pool, plugged into unmodified transformers models.

The model runs one forward over every scheduled token of every request (`input_ids [1, T]`), with
the step's StepBatch in its kwargs (kvviz.models.routing sends each layer's attention to it). In each
layer the batch writes that layer's new K/V into the pool by slot mapping, gathers each group's keys
by physical slot and attends under the mask the step plan built once for all layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .defences import sdpa_attend


class KVTensors:
    """The physical K/V pool of every layer, [num_slots, kv_heads, head_dim], made on first write."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def layer(self, idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if idx not in self.k:
            shape = (self.num_slots, like.shape[1], like.shape[3])  # like: [1, KVH, T, D]
            self.k[idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.v[idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.k[idx], self.v[idx]

    def copy_blocks(self, pairs: list[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: duplicate whole blocks (src -> dst) in every layer."""
        if not pairs or not self.k:
            return
        dev = next(iter(self.k.values())).device
        offs = torch.arange(block_size, device=dev)
        src = (torch.tensor([s for s, _ in pairs], device=dev)[:, None] * block_size + offs).flatten()
        dst = (torch.tensor([d for _, d in pairs], device=dev)[:, None] * block_size + offs).flatten()
        for pool in (*self.k.values(), *self.v.values()):
            pool[dst] = pool[src]


@dataclass
class AttentionGroup:
    """Queries that share one key layout: a request's prefill chunk, all decode tokens of the
    step, or (shared-axis mechanism) every query against every live slot."""

    start: int  # the group's queries are packed tokens start .. start + R*Q, row by row
    key_slots: torch.Tensor  # [R, L] physical slots read as keys (padding is masked out)
    mask: torch.Tensor  # [R, Q, L] True = may attend
    layout: str = field(init=False, default="masked")  # or "full"/"causal": lets SDPA skip the mask

    @property
    def span(self) -> slice:
        R, Q, _ = self.mask.shape
        return slice(self.start, self.start + R * Q)

    def __post_init__(self) -> None:
        R, Q, L = self.mask.shape
        if bool(self.mask.all()):
            self.layout = "full"
        elif R == 1 and Q == L and torch.equal(self.mask[0], torch.ones_like(self.mask[0]).tril()):
            self.layout = "causal"


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
        kc[self.write_slots] = key[0].transpose(0, 1)
        vc[self.write_slots] = value[0].transpose(0, 1)
        q = query[0].transpose(0, 1)  # [T, H, D]
        out = torch.empty_like(q)
        for g in self.groups:
            qg = q[g.span].view(*g.mask.shape[:2], *q.shape[1:])
            kg, vg = _gather(kc, g.key_slots), _gather(vc, g.key_slots)
            if self.attend is None:
                og = sdpa_attend(qg, kg, vg, g.mask, scaling, g.layout)
            else:
                og, probs = self.attend(qg, kg, vg, g.mask, scaling, module.layer_idx)
                if self.on_probs is not None:
                    self.on_probs(module.layer_idx, g, probs)
            out[g.span] = og.reshape(-1, *q.shape[1:])
        return out[None], None
