"""One step's plan: the packed tokens, where their K/V go, and each attention group's keys and
mask, as tensors on the model's device, built once per step (not per layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionGroup
from .defences import NOT_OWNED, Defences


@dataclass(frozen=True)
class ScheduledWork:
    """One request's share of a step: compute positions [start, start + len(token_ids))."""

    seq_id: str
    start: int
    token_ids: list[int]
    block_table: list[int]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    write_slots: torch.Tensor  # [T]
    groups: list[AttentionGroup]
    q_row: torch.Tensor  # [T] index of each query's request in `work`
    offsets: list[int]  # where each request's tokens start in the packed batch


def _tables(tables: list[list[int]], width: int, device) -> torch.Tensor:
    """Page tables as one [R, width] tensor, padded with block 0 (padding is always masked)."""
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)


def build_step(step: int, work: list[ScheduledWork], live_tables: dict[str, list[int]], block_size: int,
               num_slots: int, isolation: str, defences: Defences, device: torch.device) -> StepInputs:
    B = block_size
    defences.begin_step(step, [w.seq_id for w in work])
    offsets, ids, pos, rows = [], [], [], []
    for r, w in enumerate(work):
        offsets.append(len(ids))
        ids += w.token_ids
        pos += range(w.start, w.end)
        rows += [r] * len(w.token_ids)
    q_pos = torch.tensor(pos, dtype=torch.long, device=device)
    q_row = torch.tensor(rows, dtype=torch.long, device=device)
    width = max(-(-w.end // B) for w in work)
    write_slots = defences.slot_mapping(_tables([w.block_table for w in work], width, device), q_row, q_pos, B)
    read = defences.read_table(step, [w.seq_id for w in work], [list(w.block_table) for w in work])
    tables = _tables(read, width, device)
    if isolation == "paged":
        groups = _paged_groups(work, offsets, tables, B, defences, device)
    else:
        groups = [_shared_axis_group(work, live_tables, tables, q_row, q_pos, B, num_slots, defences, device)]
    return StepInputs(torch.tensor([ids], device=device), q_pos[None], write_slots, groups, q_row, offsets)


def _paged_groups(work, offsets, tables, B, defences, device) -> list[AttentionGroup]:
    """One group for all single-token rows (R=n, Q=1) and one per prefill chunk (R=1, Q=chunk);
    `work` lists the single-token rows first, so every group is a contiguous span of tokens."""
    singles = [r for r, w in enumerate(work) if len(w.token_ids) == 1]
    chunks = [[r] for r, w in enumerate(work) if len(w.token_ids) > 1]
    assert singles == list(range(len(singles))), "single-token rows must come first"
    groups = []
    for rows in ([singles] if singles else []) + chunks:
        Q = len(work[rows[0]].token_ids)
        L = max(work[r].end for r in rows)
        idx = torch.tensor(rows, device=device)
        q_pos = torch.tensor([work[r].start for r in rows], device=device)[:, None] + torch.arange(Q, device=device)
        key_pos = torch.arange(L, device=device).expand(len(rows), L)
        ctx_len = torch.tensor([work[r].end for r in rows], device=device)
        key_slots = defences.page_lookup(tables[idx], key_pos, B)
        groups.append(AttentionGroup(offsets[rows[0]], key_slots, defences.paged_mask(key_pos, ctx_len, q_pos)))
    return groups


def _shared_axis_group(work, live_tables, tables, q_row, q_pos, B, num_slots, defences, device) -> AttentionGroup:
    """Every live block's slots on one key axis in physical order; the mask alone isolates."""
    blocks = sorted({b for t in live_tables.values() for b in t})
    axis_slots = (torch.tensor(blocks, device=device)[:, None] * B + torch.arange(B, device=device)).flatten()
    axis_of_slot = torch.full((num_slots,), -1, dtype=torch.long, device=device)
    axis_of_slot[axis_slots] = torch.arange(len(axis_slots), device=device)
    owner_pos = torch.full((len(work), len(axis_slots)), NOT_OWNED, dtype=torch.long, device=device)
    for r, w in enumerate(work):
        p = torch.arange(w.end, device=device)
        axis = axis_of_slot[defences.page_lookup(tables[r:r + 1], p[None], B)[0]]
        owner_pos[r, axis[axis >= 0]] = p[axis >= 0]  # a slot off the live axis cannot be seen
    mask = defences.shared_axis_mask(owner_pos, q_row, q_pos)
    return AttentionGroup(0, axis_slots[None], mask[None])
