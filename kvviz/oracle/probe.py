"""One query's attention over the key axis, for the seed's table: which slots the last prompt
token of a request looks at, averaged over layers and heads, with who wrote each slot."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.attention import AttentionGroup
from ..engine.observer import StepContext
from ..util.byte_level import whole_characters


@dataclass(frozen=True)
class KeyWeight:
    slot: int
    writer: str | None
    position: int
    token_id: int
    weight: float


@dataclass
class LastPromptTokenProbe:
    """An AttentionObserver capturing request `request`'s query at position `position`."""

    request: str
    position: int
    weights: list[KeyWeight] = field(default_factory=list)
    _sum: torch.Tensor | None = None
    _slots: torch.Tensor | None = None
    _layers: int = 0

    def begin_step(self, ctx: StepContext) -> None:
        self.ctx, self.token = ctx, None
        rows = [r for r, w in enumerate(ctx.work) if w.seq_id == self.request and w.start <= self.position < w.end]
        if rows:
            hit = ((ctx.q_row == rows[0]) & (ctx.q_pos == self.position)).nonzero()
            self.token = int(hit[0, 0])

    def on_attention(self, layer: int, group: AttentionGroup, probs: torch.Tensor) -> None:
        if self.token is None or not group.span.start <= self.token < group.span.stop:
            return
        R, H, Q, L = probs.shape
        r, q = divmod(self.token - group.span.start, Q)
        row = probs[r, :, q].mean(0)  # head mean, [L]
        self._sum = row if self._sum is None else self._sum + row
        self._slots, self._layers = group.key_slots[r], self._layers + 1

    def table(self, tokenizer) -> str:
        """The seed's table: each request (in the physical order of its first slot) with its tokens in
        position order, text and weight. Tokens that are pieces of one character (byte-level tokenizers
        split 红 in three) are merged, weights summed: by position, since an engine may place a request's
        blocks out of order (transformers does), and a piece left over at the end is shown, not dropped."""
        keys = [k for k in self.weights if k.writer is not None and k.token_id >= 0]
        first = {}
        for k in keys:
            first[k.writer] = min(first.get(k.writer, k.slot), k.slot)
        by_writer: dict[str, list[KeyWeight]] = {}
        for k in sorted(keys, key=lambda k: (first[k.writer], k.position)):
            by_writer.setdefault(k.writer, []).append(k)
        cells = {}
        for writer, ks in by_writer.items():
            runs = whole_characters(len(ks), lambda a, b, ks=ks: tokenizer.decode([k.token_id for k in ks[a:b]]))
            cells[writer] = [f"{text.strip() or text!r} {sum(k.weight for k in ks[a:b]):.2f}" for a, b, text in runs]
        return "\n".join(f"  {w:>6} | " + "  ".join(shown) for w, shown in cells.items())

    def end_step(self) -> None:
        if self._sum is None or self.weights:
            return
        prov, mean = self.ctx.provenance, (self._sum / self._layers).tolist()
        for slot, weight in zip(self._slots.tolist(), mean, strict=True):
            f = prov.facts(slot)
            self.weights.append(KeyWeight(slot, f.writer, f.pos, f.token, weight))
