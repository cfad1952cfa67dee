"""Blocks stored under more than one tenant, as the capture views count them (capture/tenants.py): a
block hash on one replica and KV group stored or hit under two salts, `named` where two of those are
tenants the stream names (a store's own event names its salt: a cross-tenant finding), else
`inferred` (a salt only inherited from the chain a store continues); a store without a salt names no
tenant. Found as the stores arrive: the views look over a whole capture, so live, a hash is
remembered for the latest `remembered` to `remembered / 2` hashes first stored (two generations of
dicts: when the new one fills, the old one is dropped), and a second tenant's store is seen unless
that many other hashes were first stored in between."""

from __future__ import annotations

from dataclasses import dataclass, field

# A remembered hash: its first salt, its first named tenant (None: none yet), and what was counted of it.
NOTHING, SALTS, NAMED = 0, 1, 2


@dataclass
class FirstTenants:
    remembered: int = 400_000
    new: dict[int, list] = field(default_factory=dict)  # key (hash and where) -> [salt, tenant, counted]
    old: dict[int, list] = field(default_factory=dict)
    places: dict[tuple[str, int | None], int] = field(default_factory=dict)  # (replica, group) -> a small code
    forgotten: int = 0  # hashes dropped with an old generation

    def see(self, replica: str, group: int | None, block_hash: int, salt: str | None, tenant: str | None) -> int:
        """A store (or hit) under `salt`, `tenant` if its event names it: SALTS if this makes the block's
        salts two for the first time, plus NAMED if it makes its named tenants two (a bit each)."""
        if salt is None:
            return NOTHING
        place = self.places.setdefault((replica, group), len(self.places))
        key = block_hash | (place << 64)
        had = self.new.get(key)
        if had is None:
            had = self.old.get(key)
            if had is None:
                self._remember(key, [salt, tenant, NOTHING])
                return NOTHING
        found = NOTHING
        if not had[2] & SALTS and salt != had[0]:
            found |= SALTS
        if tenant is not None:
            if had[1] is None:
                had[1] = tenant
            elif not had[2] & NAMED and tenant != had[1]:
                found |= NAMED
        had[2] |= found
        return found

    def _remember(self, key: int, value: list) -> None:
        self.new[key] = value
        if len(self.new) >= self.remembered // 2:
            self.forgotten += len(self.old)
            self.old, self.new = self.new, {}
