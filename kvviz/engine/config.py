"""Engine settings, validated on construction so a bad value names its field."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..errors import WorkloadError

ISOLATIONS = ("paged", "masked")
COMPUTES = ("inspect", "fast")


class ConfigError(WorkloadError):
    """A setting is out of range; the message starts with the field's name."""


@dataclass(frozen=True)
class EngineConfig:
    """How the shared cache is laid out and how each step attends.

    isolation: `paged` gathers each request's own slots through its page table (isolation by
    addressing); `masked` puts every live slot on one key axis and relies on the mask alone (the
    seed's apparatus). compute: `inspect` materialises float32 probabilities for the oracle;
    `fast` uses torch SDPA and exposes none.
    """

    block_size: int = 16
    num_blocks: int = 256
    max_batch_tokens: int = 256
    isolation: str = "paged"
    compute: str = "inspect"
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_batch_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {v!r}")
        if self.isolation not in ISOLATIONS:
            raise ConfigError(f"isolation: must be one of {', '.join(ISOLATIONS)}, got {self.isolation!r}")
        if self.compute not in COMPUTES:
            raise ConfigError(f"compute: must be one of {', '.join(COMPUTES)}, got {self.compute!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ConfigError(f"prefix_caching: must be true or false, got {self.prefix_caching!r}")

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown engine setting (known: {', '.join(sorted(known))})")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)
