"""A synthetic fleet's KV events at the scale of production (benchmarks and scale tests): requests
that share system prompts per tenant, decode one block at a time, get evicted under pressure, with
vLLM 0.33's batch layout. Deterministic for a seed."""

from __future__ import annotations

import random
from collections.abc import Iterator

import msgpack

from .capture_file import Message

BLOCK = 16


def fleet_messages(events: int, replicas: int = 2, tenants: int = 8, capacity: int = 4096,
                   seed: int = 0) -> Iterator[Message]:
    """Messages until about `events` block events (rows) have been produced, round-robin over replicas."""
    rng = random.Random(seed)
    live: list[list[int]] = [[] for _ in range(replicas)]
    seq = [0] * replicas
    prefixes = []  # (hashes, tokens): a hash always names the same tokens, as a server's does
    for n in (rng.randint(2, 8) for _ in range(tenants * 4)):
        prefixes.append(([rng.getrandbits(63) for _ in range(n)], [rng.randrange(49152) for _ in range(BLOCK * n)]))
    made, ts = 0, 1.7e9
    while made < events:
        r = seq.index(min(seq))
        tenant = rng.randrange(tenants)
        prefix, prefix_tokens = prefixes[tenant * 4 + rng.randrange(4)]
        own = [rng.getrandbits(64) for _ in range(rng.choice((1, 1, 1, 2, 4, 8)))]
        tokens = [rng.randrange(49152) for _ in range(BLOCK * len(own))]
        whole = rng.random() < 0.3  # the prefix stored (again) with the request's own blocks
        hashes = prefix + own if whole else own
        events_out: list[dict] = [{
            "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None if whole else prefix[-1],
            "token_ids": prefix_tokens + tokens if whole else tokens, "block_size": BLOCK,
            "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [[f"tenant-{tenant}"]] + [None] * (len(hashes) - 1)}]
        live[r].extend(hashes)
        made += len(hashes)
        if len(live[r]) > capacity:
            gone, live[r] = live[r][:len(live[r]) - capacity], live[r][len(live[r]) - capacity:]
            events_out += [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in gone]
            made += len(gone)
        ts += 0.005
        yield Message(f"replica-{r}", 0, seq[r], "kv-events", msgpack.packb([ts, events_out, 0]), ts)
        seq[r] += 1


def step_batches(count: int, seed: int = 0) -> list[bytes]:
    """Per-step batches as a busy server publishes them at thousands a second: mostly one new block
    of a decoding request (16 tokens), sometimes a short prefill chain, sometimes an eviction."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = 1 if rng.random() < 0.8 else rng.randint(2, 6)
        hashes = [rng.getrandbits(64) for _ in range(n)]
        events: list[dict] = [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": rng.getrandbits(64),
                               "token_ids": [rng.randrange(49152) for _ in range(BLOCK * n)], "block_size": BLOCK,
                               "lora_id": None, "medium": "GPU", "lora_name": None}]
        if rng.random() < 0.3:
            events.append({"type": "BlockRemoved", "block_hashes": [rng.getrandbits(64)], "medium": "GPU"})
        out.append(msgpack.packb([1.7e9 + len(out) * 1e-4, events, 0]))
    return out
