"""Engine settings, validated on construction so a bad value names its field."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..errors import WorkloadError
from .eviction import EVICTIONS
from .scheduler import SCHEDULES

ISOLATIONS = ("paged", "masked", "streams")
STREAMS_OWNER = "llama.cpp"  # one KV stream per sequence: llama.cpp with kv_unified off
COMPUTES = ("inspect", "fast")
BACKENDS = ("kvviz", "transformers", "llama.cpp")
# the other engines' attention kernels: the first returns its weights (the plain, eager computation), the
# others return none and are checked against kvviz's recomputation of them
BACKEND_KERNELS = {"transformers": ("eager_paged", "sdpa_paged"), "llama.cpp": ("eager_paged", "flash_attn")}
KERNELS = tuple(dict.fromkeys(k for ks in BACKEND_KERNELS.values() for k in ks))
KERNEL_OWNERS = {"sdpa_paged": "transformers' continuous batching", "flash_attn": "llama.cpp"}


class ConfigError(WorkloadError):
    """A setting is out of range; the message starts with the field's name."""


@dataclass(frozen=True)
class OffloadConfig:
    """A host tier under the device pool: `cpu_blocks` blocks that evicted cached blocks move to."""

    cpu_blocks: int

    def __post_init__(self) -> None:
        v = self.cpu_blocks
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"offload.cpu_blocks: must be a positive integer, got {v!r}")

    @classmethod
    def from_value(cls, v: object) -> OffloadConfig | None:
        if v is None or isinstance(v, OffloadConfig):
            return v
        if not isinstance(v, dict):
            raise ConfigError(f"offload: must be an object such as {{\"cpu_blocks\": 64}} or null, got {v!r}")
        unknown = sorted(set(v) - {"cpu_blocks"})
        if unknown or "cpu_blocks" not in v:
            raise ConfigError(f"offload.{unknown[0] if unknown else 'cpu_blocks'}: "
                              f"{'unknown setting' if unknown else 'required'} (known: cpu_blocks)")
        return cls(v["cpu_blocks"])


@dataclass(frozen=True)
class EngineConfig:
    """How the shared cache is laid out and how each step attends.

    isolation: `paged` gathers each request's own slots through its page table (isolation by
    addressing); `masked` puts every live slot on one key axis and relies on the mask alone (the
    seed's apparatus); `streams` is llama.cpp's other cache layout (kv_unified off): each sequence has a
    buffer of its own, so requests are kept apart by where their cells are. compute: `inspect`
    materialises float32 probabilities for the oracle; `fast` uses torch SDPA and exposes none.
    offload: a host tier that keeps evicted cached blocks for later prefix hits (None: evicted blocks
    are dropped). disaggregated: a prefill instance with a pool of its own (num_blocks more) computes
    each prompt and transfers its K/V to this, the decode instance. backend: `kvviz` runs kvviz's own
    engine; `transformers` runs Hugging Face transformers' continuous batching (kvviz.hf_backend),
    `llama.cpp` runs llama.cpp through its C API (kvviz.llama_backend); kvviz only observes either.
    runs: `eager_paged` (both) computes and returns its weights; transformers' `sdpa_paged` (torch SDPA)
    and llama.cpp's `flash_attn` return none and are checked against kvviz's recomputation; kvviz's
    engine has its own (compute). eviction: which free cached block kvviz's pool reuses first: `lru`
    (vLLM's free queue), `lfu`, `seed` (the seed article's advice: leaves only, long prefixes last) or
    `newcomer` (LRU in which never-seen blocks enter cold).
    schedule: the order kvviz's engine admits waiting requests in: `fcfs` (arrival) or `lpm` (longest
    cached prefix first, as SGLang).
    """

    block_size: int = 16
    num_blocks: int = 256
    max_batch_tokens: int = 256
    isolation: str = "paged"
    compute: str = "inspect"
    prefix_caching: bool = True
    offload: OffloadConfig | None = None
    disaggregated: bool = False
    backend: str = "kvviz"
    kernel: str = "eager_paged"
    eviction: str = "lru"  # which free cached block the pool reuses first (kvviz's engine: eviction.py)
    schedule: str = "fcfs"  # the order waiting requests are admitted in (kvviz's engine: scheduler.py)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_batch_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {v!r}")
        if self.isolation not in ISOLATIONS:
            raise ConfigError(f"isolation: must be one of {', '.join(ISOLATIONS)}, got {self.isolation!r}")
        if self.isolation == "streams" and self.backend != STREAMS_OWNER:
            raise ConfigError(f"isolation: 'streams' (one KV stream per sequence) is {STREAMS_OWNER}'s cache with "
                              f"kv_unified off; run it with backend {STREAMS_OWNER!r}")
        if self.compute not in COMPUTES:
            raise ConfigError(f"compute: must be one of {', '.join(COMPUTES)}, got {self.compute!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.kernel not in KERNELS:
            raise ConfigError(f"kernel: must be one of {', '.join(KERNELS)} (the other engines' attention "
                              f"kernels), got {self.kernel!r}")
        if self.kernel != KERNELS[0] and self.kernel not in BACKEND_KERNELS.get(self.backend, ()):
            owner = [b for b, ks in BACKEND_KERNELS.items() if self.kernel in ks][0]
            raise ConfigError(f"kernel: {self.kernel!r} is a kernel of {KERNEL_OWNERS[self.kernel]}, run with "
                              f"backend {owner!r}; kvviz's engine attends by its compute setting")
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"eviction: must be one of {', '.join(EVICTIONS)}, got {self.eviction!r}")
        if self.eviction != "lru" and self.backend != "kvviz":
            raise ConfigError(f"eviction: {self.eviction!r} is an order of kvviz's own block pool; {self.backend} "
                              "evicts as it does")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule: must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule != "fcfs" and self.backend != "kvviz":
            raise ConfigError(f"schedule: {self.schedule!r} is an order of kvviz's own scheduler; {self.backend} "
                              "schedules as it does")
        for name in ("prefix_caching", "disaggregated"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        object.__setattr__(self, "offload", OffloadConfig.from_value(self.offload))

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown engine setting (known: {', '.join(sorted(known))})")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)
