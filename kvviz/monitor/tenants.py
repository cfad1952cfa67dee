"""Per-tenant figures with a bounded label set: Prometheus keeps a series per label value, so a
fleet with thousands of salts would swamp it. The busiest tenants get a label of their own, the
rest share `other`.

Counters must never go down, so a tenant keeps its label once given one, and counts only what
happened after it got it; what it did before stays in `other`. Labels are given at each refresh to
the busiest tenants while fewer than `labelled` have one. Tenants past `tracked` are not tallied one
by one at all (they go straight to `other`): the table itself stays bounded."""

from __future__ import annotations

from dataclasses import dataclass, field

OTHER = "other"
FIELDS = ("stored_blocks", "hit_blocks", "hit_tokens", "miss_tokens")


@dataclass
class TenantBook:
    labelled: int = 20
    tracked: int = 100_000
    tallies: dict[str, list[int]] = field(default_factory=dict)  # tenant -> FIELDS
    baselines: dict[str, list[int]] = field(default_factory=dict)  # labelled tenant -> its tally when labelled
    untracked: list[int] = field(default_factory=lambda: [0] * len(FIELDS))  # tenants past `tracked`
    untracked_stores: int = 0  # stores of tenants past `tracked`, counted once each time

    def add(self, tenant: str, values: tuple[int, ...]) -> bool:
        """Add a tenant's counts; False when the table is full and the tenant went to `other` untallied."""
        tally = self.tallies.get(tenant)
        if tally is None:
            if len(self.tallies) >= self.tracked:
                self.untracked = [a + b for a, b in zip(self.untracked, values, strict=True)]
                self.untracked_stores += values[0] + values[1]
                return False
            tally = self.tallies[tenant] = [0] * len(FIELDS)
        for i, v in enumerate(values):
            tally[i] += v
        return True

    def refresh(self) -> None:
        """Label the busiest unlabelled tenants while labels remain."""
        free = self.labelled - len(self.baselines)
        if free <= 0:
            return
        waiting = [t for t in self.tallies if t not in self.baselines]
        for t in sorted(waiting, key=lambda t: -(self.tallies[t][0] + self.tallies[t][1]))[:free]:
            self.baselines[t] = list(self.tallies[t])

    def series(self) -> dict[str, tuple[int, ...]]:
        """Label -> FIELDS: each labelled tenant since it was labelled, and `other` for everything else."""
        out: dict[str, tuple[int, ...]] = {}
        total = list(self.untracked)
        for tally in self.tallies.values():
            total = [a + b for a, b in zip(total, tally, strict=True)]
        other = total
        for t, base in self.baselines.items():
            mine = tuple(a - b for a, b in zip(self.tallies[t], base, strict=True))
            out[t] = mine
            other = [a - b for a, b in zip(other, mine, strict=True)]
        out[OTHER] = tuple(other)
        return out
