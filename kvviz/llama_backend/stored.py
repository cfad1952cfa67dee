"""What llama.cpp's cache holds, in the terms of vLLM's KV events: the full blocks of `block_size` tokens
that each sequence's cells hold, named by a hash chained over their tokens (no salt: llama.cpp has none).
A block is stored when some sequence first holds it and removed when no sequence holds it any more, so a
run's `--kv-events` capture says what a KV-aware router would have been told of this cache."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.events import BlockEvent
from ..engine.hashing import block_hash
from ..engine.provenance import SlotProvenance


@dataclass(frozen=True, kw_only=True)
class Holding:
    """One sequence's cells: the tokens they hold and the cells themselves, both by position."""

    tokens: list[int]
    cells: list[int]


class StoredBlocks:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.held: dict[bytes, int] = {}  # hash -> the map block of its first cell, when it was stored

    def changes(self, holdings: list[Holding], provenance: SlotProvenance) -> list[BlockEvent]:
        """Removals of the blocks no sequence holds now, then the blocks stored since, chain by chain."""
        B, now, stored = self.block_size, {}, []
        for h in holdings:
            parent = None
            for i in range(min(len(h.tokens), len(h.cells)) // B):
                tokens, first = tuple(h.tokens[i * B:(i + 1) * B]), h.cells[i * B]
                name = block_hash(parent, tokens)
                if name not in now and name not in self.held:
                    facts = provenance.facts(first)
                    stored.append(BlockEvent("cache", first // B, facts.writer, 1, hash=name, parent_hash=parent,
                                             token_ids=tokens, salt=facts.tenant))
                now.setdefault(name, self.held.get(name, first // B))
                parent = name
        removed = [BlockEvent("evict", block, None, 0, hash=name) for name, block in self.held.items()
                   if name not in now]
        self.held = now
        return removed + stored
