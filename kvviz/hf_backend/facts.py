"""What the adapter tells kvviz about transformers' continuous batching, in kvviz's terms: plain
records with no transformers type in them, so that kvviz imports (and refuses another transformers
release in one sentence) without reading transformers' internals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class CacheView:
    """transformers' paged cache at one instant, in kvviz's block numbering (see ContinuousBatching)."""

    tables: dict[str, list[int]]  # request -> its block table
    refcounts: list[int]  # the ledger's count for each block (1 implicit for a block one table holds)
    hashes: list[int | None]  # each block's content hash in the ledger (full blocks kept for sharing)
    cached: list[int]  # blocks no request holds, kept for their hash, in the ledger's order
    computed: dict[str, int]  # tokens each active request has in the cache


@dataclass
class Batch:
    """One forward of transformers' manager as its first attention layer saw it: the packed queries in
    request order, where their K/V were written and which slots the packed key axis read."""

    requests: list[str]
    starts: list[int]  # first position each request computes
    lengths: list[int]  # tokens it computes
    histories: list[list[int]]  # each request's tokens (prompt + generated so far)
    sampling: list[bool]  # whether its last token's logits are sampled this batch
    write_slots: torch.Tensor  # [T] the slot each packed token's K/V went to
    key_slots: torch.Tensor  # [K] the slot of every key on the packed key axis
    visible: torch.Tensor  # [T, K] what transformers' mask let each query see
    cache: CacheView  # after scheduling, before the forward


@dataclass
class Outcome:
    """What one batch produced, once transformers' manager updated its requests."""

    sampled: dict[str, int]  # request -> the token it sampled
    finished: list[str]


class Listener(Protocol):
    def on_batch(self, batch: Batch) -> None: ...

    def on_layer(self, layer: int, weights: torch.Tensor) -> None:
        """weights [H, T, K]: every head's attention of every packed query over the packed key axis."""

    def on_kernel(self, layer: int, excess: torch.Tensor) -> None:
        """excess [H, T]: a kernel that returns no weights, so those given to on_layer were recomputed; how
        far its output is from theirs, in tolerances (kvviz.engine.kernel_check)."""

    def on_logits(self, logits: torch.Tensor) -> None:
        """[n, V] float32: the logits of the n requests sampling this batch, in batch order."""
