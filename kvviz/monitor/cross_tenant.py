"""Blocks stored under more than one tenant, as the capture views define them (a block hash on one
replica and KV group stored or hit under two salts; a store without a salt names no tenant), found
as the stores arrive. The views look over a whole capture; live, the first tenant of a hash is remembered for the
latest `remembered` to `remembered / 2` hashes first stored (two generations of dicts: when the new
one fills, the old one is dropped), so a second tenant's store is seen unless that many other hashes
were stored first in between."""

from __future__ import annotations

from dataclasses import dataclass, field

SHARED = ""  # a hash already counted as shared (vLLM's salts are never empty)


@dataclass
class FirstTenants:
    remembered: int = 400_000
    new: dict[int, str] = field(default_factory=dict)  # key (hash and where) -> its first tenant, or SHARED
    old: dict[int, str] = field(default_factory=dict)
    places: dict[tuple[str, int | None], int] = field(default_factory=dict)  # (replica, group) -> a small code
    forgotten: int = 0  # hashes dropped with an old generation

    def see(self, replica: str, group: int | None, block_hash: int, salt: str | None) -> str | None:
        """A store (or hit) of a block: its tenant if this store makes the block shared across tenants
        for the first time, else None."""
        if salt is None:
            return None
        place = self.places.setdefault((replica, group), len(self.places))
        key, tenant = block_hash | (place << 64), salt
        had = self.new.get(key)
        if had is None:
            had = self.old.get(key)
            if had is None:
                self._remember(key, tenant)
                return None
        if had == SHARED or had == tenant:
            return None
        self.new[key] = SHARED
        return tenant

    def _remember(self, key: int, tenant: str) -> None:
        self.new[key] = tenant
        if len(self.new) >= self.remembered // 2:
            self.forgotten += len(self.old)
            self.old, self.new = self.new, {}
