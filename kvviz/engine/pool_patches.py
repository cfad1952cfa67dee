"""The pool side's replaceable methods, typed: what a lifecycle fault (kvviz.catalogue.faults) may swap out on a
run's fresh KV cache manager, its block pool or its host tier.

A fault names the methods it replaces as fields of PoolPatches, so a name that is not a field fails
where the fault is defined; and every field is checked against its owner class when this module is
imported, so renaming an engine method that a fault replaces fails at import, not by a fault that
silently stops firing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from .block_pool import BlockPool
from .host_tier import HostTier
from .kv_cache import KVCacheManager

# owner instance -> the method that replaces its own (built per run, so it may wrap the original)
Patch = Callable[..., Callable] | None

OWNERS = {"kv": KVCacheManager, "pool": BlockPool, "host": HostTier}


@dataclass(frozen=True)
class PoolPatches:
    """Each field: a factory given the owner (see OWNER_OF) that returns its replacement method."""

    copy_on_write: Patch = None  # KVCacheManager
    hash_keys: Patch = None
    resume: Patch = None
    copy_in: Patch = None
    commit: Patch = None
    reads_cache: Patch = None
    count_cached: Patch = None
    release: Patch = None  # BlockPool
    evict: Patch = None
    allocate: Patch = None
    address: Patch = None  # HostTier
    forget: Patch = None
    key: Patch = None
    copy_out: Patch = None
    pop_transfers: Patch = None

    def apply(self, kv: KVCacheManager) -> None:
        """Replace the named methods on this manager, its pool and its host tier (none: skipped)."""
        owners = {"kv": kv, "pool": kv.pool, "host": kv.host}
        for f in fields(self):
            make, owner = getattr(self, f.name), owners[OWNER_OF[f.name]]
            if make is not None and owner is not None:
                setattr(owner, f.name, make(owner))


OWNER_OF = {**dict.fromkeys(("copy_on_write", "hash_keys", "resume", "copy_in", "commit", "reads_cache",
                             "count_cached"), "kv"),
            **dict.fromkeys(("release", "evict", "allocate"), "pool"),
            **dict.fromkeys(("address", "forget", "key", "copy_out", "pop_transfers"), "host")}


def check_owners() -> None:
    """Every field names a method its owner class has (run at import: a rename in the engine fails here)."""
    for f in fields(PoolPatches):
        owner = OWNERS[OWNER_OF[f.name]]
        if not callable(getattr(owner, f.name, None)):
            raise ImportError(f"PoolPatches.{f.name}: {owner.__name__} has no method {f.name}")


check_owners()
