"""Facts about every KV slot, recorded at the moment K/V is written and never erased.

The leak oracle judges a read from these facts alone (not from the masks or page tables it is
checking): a slot is *own* for a query iff it was written in its block's current lifetime, at a
position the query may see, by the same token prefix. Arrays of int64 so the engine can view them
as tensors without copying (`torch.frombuffer`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass


class Interner:
    """Stable small ints for names (request ids, tenant salts); 0 is reserved for "none"."""

    def __init__(self) -> None:
        self.names: list[str | None] = [None]
        self._ids: dict[str | None, int] = {None: 0}

    def id(self, name: str | None) -> int:
        if name not in self._ids:
            self._ids[name] = len(self.names)
            self.names.append(name)
        return self._ids[name]

    def name(self, i: int) -> str | None:
        return self.names[i]


@dataclass(frozen=True, slots=True)
class SlotFacts:
    prefix_id: int
    pos: int
    token: int
    writer: str | None
    tenant: str | None
    lifetime: int


class SlotProvenance:
    """Per slot: prefix id, position, token, writer, tenant and the block lifetime it was written in."""

    def __init__(self, num_slots: int):
        self.prefix = array("q", [0]) * num_slots
        self.pos = array("q", [-1]) * num_slots
        self.token = array("q", [-1]) * num_slots
        self.writer = array("q", [0]) * num_slots
        self.tenant = array("q", [0]) * num_slots
        self.life = array("q", [0]) * num_slots  # 0: never written (lifetimes start at 1)
        self.requests, self.tenants = Interner(), Interner()

    def record(self, slot: int, prefix_id: int, pos: int, token: int, writer: str, tenant: str | None,
               life: int) -> None:
        self.prefix[slot], self.pos[slot], self.token[slot], self.life[slot] = prefix_id, pos, token, life
        self.writer[slot], self.tenant[slot] = self.requests.id(writer), self.tenants.id(tenant)

    def copy(self, src: int, dst: int, n: int, life: int) -> None:
        """A copy-on-write moved `n` slots: the content (and who produced it) moves with it."""
        for k in range(n):
            self.prefix[dst + k], self.pos[dst + k] = self.prefix[src + k], self.pos[src + k]
            self.token[dst + k] = self.token[src + k]
            self.writer[dst + k], self.tenant[dst + k] = self.writer[src + k], self.tenant[src + k]
            self.life[dst + k] = life

    def facts(self, slot: int) -> SlotFacts:
        return SlotFacts(
            self.prefix[slot], self.pos[slot], self.token[slot], self.requests.name(self.writer[slot]),
            self.tenants.name(self.tenant[slot]), self.life[slot],
        )
