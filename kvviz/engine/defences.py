"""The isolation defences, each a small replaceable function.

A fault (kvviz.catalogue.faults) swaps one of these for a deliberately broken variant; nothing else in the
engine changes. The leak oracle never calls them: it judges from slot provenance alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .pool_patches import PoolPatches

NOT_OWNED = 1 << 62  # owner position of a key slot the query's request does not own


def read_table(step: int, seq_ids: list[str], tables: list[list[int]]) -> list[list[int]]:
    """The page tables attention reads through: the requests' own tables."""
    return tables


def slot_mapping(tables: torch.Tensor, q_row: torch.Tensor, q_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Where each new token's K/V is written: its own page table at its position.
    tables [R, NB], q_row [T], q_pos [T] -> slots [T]."""
    return page_lookup(tables[q_row], q_pos[:, None], block_size)[:, 0]


def page_lookup(tables: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Physical slots of logical positions: `table[pos // B] * B + pos % B`, row by row.
    tables [R, NB] (padded with block 0), pos [R, L] -> slots [R, L]."""
    return tables.gather(1, pos // block_size) * block_size + pos % block_size


def causal_mask(key_pos: torch.Tensor, ctx_len: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Paged isolation: each row's keys are its own context; a query sees positions <= its own.
    key_pos [R, L], ctx_len [R], q_pos [R, Q] -> [R, Q, L] (True = may attend)."""
    return (key_pos[:, None, :] <= q_pos[:, :, None]) & (key_pos < ctx_len[:, None])[:, None, :]


def shared_axis_mask(owner_pos: torch.Tensor, q_row: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """The seed's block-diagonal AND causal mask over one shared key axis.
    owner_pos [R, S] holds the logical position of key slot s in request r's context, or NOT_OWNED;
    q_row [T] is each query's request row, q_pos [T] its position -> [T, S]."""
    return owner_pos[q_row] <= q_pos[:, None]


def grouped_attend(q, k, v, mask, scale, probs_fn):
    """Inspect-path arithmetic in float32 with a pluggable logits -> probabilities step.
    q [R,Q,H,D], k/v [R,L,KVH,D], mask [R,Q,L] -> (out [R,Q,H,D], probs [R,H,Q,L])."""
    R, Q, H, D = q.shape
    KVH = k.shape[2]
    G = H // KVH  # query head h reads KV head h // G, as transformers' repeat_kv does
    qf = q.float().view(R, Q, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(R, KVH, G * Q, D)
    logits = ((qf @ k.float().permute(0, 2, 3, 1)) * scale).view(R, H, Q, -1)
    probs = probs_fn(logits, mask[:, None])
    out = probs.view(R, KVH, G * Q, -1) @ v.float().transpose(1, 2)  # [R, KVH, G*Q, D]
    return out.view(R, H, Q, D).transpose(1, 2).to(q.dtype), probs


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Boolean mask applied as -inf before a float32 softmax; a row with no visible key is all
    zeros (never NaN, never uniform)."""
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.where(mask.any(-1, keepdim=True), probs, 0.0)


def masked_softmax_attend(q, k, v, mask, scale, layer: int | None = None):
    return grouped_attend(q, k, v, mask, scale, masked_softmax)


def sdpa_attend(q, k, v, mask, scale, layout: str = "masked"):
    """Fast path: torch SDPA; no probabilities leave it. A mask the plan found to be all-visible
    ("full") or exactly causal ("causal") is passed as such, which selects faster kernels; one where every
    query sees a key ("padded": decode rows of several lengths) needs no zeroing of rows that see none
    (SDPA gives those NaN, "masked")."""
    args = dict(scale=scale, enable_gqa=True)
    if layout == "full":
        args["attn_mask"] = None
    elif layout == "causal":
        args["is_causal"] = True
    else:
        args["attn_mask"] = mask[:, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **args)
    out = out.transpose(1, 2)
    return torch.where(mask.any(-1)[:, :, None, None], out, 0.0) if layout == "masked" else out


@dataclass(frozen=True)
class Defences:
    """The defences in force for a run. Attention side: functions of tensors. Pool side: the methods
    `pool_patches` replaces on each run's fresh KV cache manager, block pool and host tier (typed: see
    kvviz.engine.pool_patches)."""

    begin_step: Callable[[int, list[str]], None] = lambda step, seq_ids: None  # told before each step's plan
    read_table: Callable = read_table
    slot_mapping: Callable = slot_mapping
    page_lookup: Callable = page_lookup
    paged_mask: Callable = causal_mask
    shared_axis_mask: Callable = shared_axis_mask
    attend: Callable = masked_softmax_attend
    pool_patches: PoolPatches = PoolPatches()
