"""Two hashes with two jobs.

`block_hash` names a full block's *cache key* (vLLM's chain: sha256 of the parent block's hash,
the block's token ids and extra keys: the request's namespaces, each tagged with its kind so that a
salt "foo" and an adapter "foo" never collide). `prefix_id` names the *content* a position's K/V was
computed from (a cheap 63-bit chain over token ids, from a seed that names the weights: the base
model's, or an adapter's; no salt: KV does not depend on the tenant). The leak oracle compares
prefix ids; the prefix cache compares block hashes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

BlockHash = bytes

ROOT_HASH: BlockHash = hashlib.sha256(b"kvviz/root-block").digest()
PREFIX_SEED = 0x6B76_7669_7A00_0001  # "kvviz" + 1
_M64 = (1 << 64) - 1


def block_hash(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence = ()) -> BlockHash:
    """Chain hash of one full block: the parent's hash (or the root), its tokens, its extra keys."""
    h = hashlib.sha256(parent or ROOT_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(json.dumps(list(extra_keys), separators=(",", ":")).encode())
    return h.digest()


def content_seed(adapter: str | None) -> int:
    """The prefix-id seed of K/V computed by the base model (None) or under an adapter: an adapter's
    weights change every K/V, so its content is never the base model's or another adapter's."""
    if adapter is None:
        return PREFIX_SEED
    return int.from_bytes(hashlib.sha256(b"kvviz/adapter/" + adapter.encode()).digest()[:8], "big") >> 1


def hash_to_u64(h: BlockHash) -> int:
    """Low 64 bits of a block hash as an unsigned int (the form vLLM's KV events publish)."""
    return int.from_bytes(h[-8:], "big")


def next_prefix_id(parent: int, token_id: int) -> int:
    """Prefix id after appending `token_id` to the prefix named `parent` (splitmix64 finaliser)."""
    z = ((parent * 0x9E3779B97F4A7C15) ^ (token_id + 1)) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 1  # 63 bits: fits a signed int64 tensor


def prefix_ids(token_ids: Sequence[int], parent: int = PREFIX_SEED) -> list[int]:
    """p(0) = h(seed, t0), p(i) = h(p(i-1), ti) for every position."""
    out = []
    for t in token_ids:
        parent = next_prefix_id(parent, t)
        out.append(parent)
    return out
