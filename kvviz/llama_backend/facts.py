"""What the adapter tells kvviz about llama.cpp, in kvviz's terms: plain records with no llama_cpp or
ctypes type in them, so the rest of the backend imports without llama-cpp-python installed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, kw_only=True)
class BatchToken:
    """One token of a `llama_batch`, as kvviz builds it."""

    token: int
    pos: int
    seqs: tuple[int, ...]  # its sequence ids; llama.cpp's mask reads the first
    logits: bool  # its logits are read after the decode


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One cell of llama.cpp's KV cache as its state API reports it: a position and a set of sequences."""

    pos: int
    seqs: frozenset[int]


@dataclass(frozen=True, kw_only=True)
class Ubatch:
    """One graph evaluation of a decode, as its first attention layer saw it."""

    cells: list[int]  # the cell each token's K/V went to (llama.cpp's write indices, every stream numbered on)
    n_kv: int  # keys on the attention axis: cells 0..n_kv-1 of the stream
    base: int  # the stream's first cell in kvviz's numbering (stream * its size: 0 in one unified cache)
    visible: torch.Tensor  # [T, n_kv] bool: what llama.cpp's mask let each query see


class Listener(Protocol):
    def on_ubatch(self, ubatch: Ubatch) -> None: ...

    def on_layer(self, layer: int, weights: torch.Tensor) -> None:
        """weights [H, T, n_kv] float32: every head's attention of every token of the ubatch."""

    def on_kernel(self, layer: int, excess: torch.Tensor) -> None:
        """excess [H, T]: flash attention returns no weights; those given to on_layer were recomputed from
        its own Q, K and mask, and this is how far its output is from theirs, in tolerances."""
