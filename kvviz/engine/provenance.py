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

    def __init__(self, num_slots: int, names: SlotProvenance | None = None):
        self.prefix = array("q", [0]) * num_slots
        self.pos = array("q", [-1]) * num_slots
        self.token = array("q", [-1]) * num_slots
        self.writer = array("q", [0]) * num_slots
        self.tenant = array("q", [0]) * num_slots
        self.life = array("q", [0]) * num_slots  # 0: never written (lifetimes start at 1)
        # a second tier shares the names of the first, so ids mean the same when slots move between them
        self.requests, self.tenants = (names.requests, names.tenants) if names else (Interner(), Interner())

    def record(self, slot: int, prefix_id: int, pos: int, token: int, writer: str, tenant: str | None,
               life: int) -> None:
        self.prefix[slot], self.pos[slot], self.token[slot], self.life[slot] = prefix_id, pos, token, life
        self.writer[slot], self.tenant[slot] = self.requests.id(writer), self.tenants.id(tenant)

    def copy(self, src: int, dst: int, n: int, life: int, source: SlotProvenance | None = None) -> None:
        """`n` slots were copied from `src` (in `source`, by default this tier) to `dst` (copy-on-write,
        offload, restore): the content, and who produced it, moves with it; `life` is the lifetime of
        the destination block, in which these slots are now written."""
        s = source or self
        for name in ("prefix", "pos", "token", "writer", "tenant"):
            getattr(self, name)[dst:dst + n] = getattr(s, name)[src:src + n]
        self.life[dst:dst + n] = array("q", [life]) * n

    def facts(self, slot: int) -> SlotFacts:
        return SlotFacts(
            self.prefix[slot], self.pos[slot], self.token[slot], self.requests.name(self.writer[slot]),
            self.tenants.name(self.tenant[slot]), self.life[slot],
        )
