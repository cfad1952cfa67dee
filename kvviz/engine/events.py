"""What happened to a block, as a flat record a recorder can store without knowing the pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EventKind = Literal["allocate", "hit", "share", "free", "preempt", "cow", "cache", "evict", "offload", "restore",
                    "host_evict", "transfer", "clear"]


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """One change to one physical block.

    allocate: popped from the free queue for new content (refcount 1, new lifetime);
    hit: reused from the prefix cache on admission; share: referenced by a forked child;
    free / preempt: a request dropped its reference (refcount is the count left);
    cow: `block` is the private copy of shared block `source`; cache: a full block got its hash;
    evict: a cached free block lost its hash because it was taken for new content; clear: the prefix
    cache was reset (vLLM's AllBlocksCleared) and `block`, on `medium`, lost its hash.
    With a host tier (offloading): offload: evicted `block`'s content was copied to host block
    `source`; restore: host block `source` was copied into `block` for a prefix hit; host_evict:
    host block `block` (medium CPU) lost its hash to make room. Disaggregated prefill: transfer:
    `block` of the decode instance receives the K/V of the prefill instance's block `source`.
    """

    kind: EventKind
    block: int
    request: str | None
    refcount: int
    source: int | None = None
    # cache: the hash given, its parent's (None for a first block), the block's tokens, salt and adapter;
    # evict, clear: the hash taken away. What a KV-event publisher needs without reading the pool.
    hash: bytes | None = None
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    salt: str | None = None
    adapter: str | None = None
    medium: str = "GPU"  # the tier `block` is on
