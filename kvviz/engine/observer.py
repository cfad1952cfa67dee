"""What the engine tells an attention observer (the leak oracle, a recorder) about each step.

Only facts: which slots each query read and with what weight, where each token's K/V was written
(slot provenance) and each request's own token history. Never the masks or page tables that the
observer may be judging. An observer that judges kernels also defines on_kernel_check (the
provenance oracle does): the transformers backend calls it when a kernel returned no weights and
those given to on_attention were recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .attention import AttentionGroup
from .plan import ScheduledWork
from .provenance import SlotProvenance


@dataclass(kw_only=True)
class StepContext:
    step: int
    work: list[ScheduledWork]  # in packed order: request r's tokens come r-th
    q_row: torch.Tensor  # [T] index into `work` of each packed query token
    q_pos: torch.Tensor  # [T] logical position of each packed query token
    block_size: int
    provenance: SlotProvenance  # includes this step's writes (a backend decoding in parts: as each part is judged)
    block_lifetimes: list[int] | np.ndarray  # an int64 array is read live, as the provenance is
    prefix_ids: list[list[int]]  # per work row: the request's prefix ids up to its context end
    tenants: list[str | None]  # per work row: the request's cache salt


class AttentionObserver(Protocol):
    def begin_step(self, ctx: StepContext) -> None: ...

    def on_attention(self, layer: int, group: AttentionGroup, probs: torch.Tensor) -> None:
        """probs [R, H, Q, L]: row r's queries are group.span, its keys group.key_slots[r]."""

    def end_step(self) -> None: ...
