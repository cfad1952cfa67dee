"""A synthetic fleet's KV events at the scale of production (benchmarks, scale tests and the example
capture): requests that share system prompts per tenant, decode one block at a time, get evicted
under pressure, with vLLM 0.33's batch layout. Deterministic for a seed.

It says only what a server could: a request's prefix is looked up along its hash chain, so it hits up
to its first block not cached on that replica and stores the rest of the chain after it (a parent is
always stored before its child); the salt is named on a chain's first block only; a block is cached
once per replica and removed once, least recently used first; and some stores re-report the chain's
cached blocks with the new ones (vLLM's kv_cache_report_mode="full"), which are hits, not new blocks.

One replica may offload (`offload`): a block evicted from its GPU is kept on a CPU tier (medium CPU)
that keys it alone and without the salt, and a chain that misses on the GPU is served from there
first (a hit on the CPU tier, named for the request's tenant) and stored on the GPU again. That tier
is the bug docs/faults.md calls "salt kept in one tier, dropped in another": its blocks are the
capture's cross_tier_salt findings. No server was measured to make it; it shows what the finding
looks like."""

from __future__ import annotations

import random
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from itertools import takewhile
from pathlib import Path

import msgpack

from .capture_file import CaptureWriter, Message
from .dataset import DatasetWriter
from .events import decode_batch

BLOCK = 16


def fleet_messages(events: int, replicas: int = 2, tenants: int = 8, capacity: int = 4096, seed: int = 0,
                   turns: float = 0.0, unsalted: float = 0.0, offload: int | None = None) -> Iterator[Message]:
    """Messages until about `events` block events (rows) have been produced, round-robin over replicas.
    `turns`: the share of requests that continue an earlier conversation (its whole chain), on whichever
    replica takes them, some after their blocks were evicted; `unsalted`: the share that use one prompt
    hashed alike for every tenant (a server that leaves the salt out of that prompt's hashes), so one
    hash is cached under several salts. With both 0 (the benchmarks' fleet) neither draws a number.
    `offload`: the replica (its index) with an unsalted CPU tier of `capacity` blocks (it draws none)."""
    rng = random.Random(seed)
    cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]  # least recently used first
    seq = [0] * replicas
    prefixes = []  # (hashes, tokens): a hash always names the same tokens, as a server's does
    for n in (rng.randint(2, 8) for _ in range(tenants * 4)):
        prefixes.append(([rng.getrandbits(63) for _ in range(n)], [rng.randrange(49152) for _ in range(BLOCK * n)]))
    apart = random.Random(~seed)  # the unsalted prompt, drawn apart so the benchmarks' fleet stays the same
    common = ([apart.getrandbits(63) for _ in range(4)], [apart.randrange(49152) for _ in range(BLOCK * 4)])
    talks: list[tuple[int, list[int], list[int]]] = []  # (tenant, chain, tokens) of conversations to go on with
    host = _HostTier(capacity)  # the offloading replica's CPU tier
    made, ts = 0, 1.7e9
    while made < events:
        r = seq.index(min(seq))
        cache = cached[r]
        tenant = rng.randrange(tenants)
        if talks and rng.random() < turns:
            tenant, prefix, prefix_tokens = talks.pop(rng.randrange(len(talks)))
        elif unsalted and rng.random() < unsalted:
            prefix, prefix_tokens = common
        else:
            prefix, prefix_tokens = prefixes[tenant * 4 + rng.randrange(4)]
        own = [rng.getrandbits(64) for _ in range(rng.choice((1, 1, 1, 2, 4, 8)))]
        tokens = [rng.randrange(49152) for _ in range(BLOCK * len(own))]
        hit = next((i for i, h in enumerate(prefix) if h not in cache), len(prefix))  # the chain's cached blocks
        start = 0 if rng.random() < 0.3 else hit  # reported again with the new ones, or not
        hashes = prefix[start:] + own
        events_out: list[dict] = host.restore(prefix[hit:], prefix_tokens[hit * BLOCK:], tenant) if r == offload else []
        events_out += [{
            "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": prefix[start - 1] if start else None,
            "token_ids": prefix_tokens[start * BLOCK:] + tokens, "block_size": BLOCK,
            "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": ([[f"tenant-{tenant}"]] if start == 0 else [None]) + [None] * (len(hashes) - 1)}]
        for h in prefix + own:
            if h in cache:
                cache.move_to_end(h)  # used again
            elif h in hashes:
                cache[h] = None
        if turns and len(prefix) + len(own) <= 64:  # a conversation goes on, until it is 64 blocks long
            talk = (tenant, prefix + own, prefix_tokens + tokens)
            if len(talks) < capacity:
                talks.append(talk)
            else:
                talks[rng.randrange(capacity)] = talk
        gone = [cache.popitem(last=False)[0] for _ in range(len(cache) - capacity)]
        events_out += [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in gone]
        if r == offload:
            host.learn(hashes, prefix_tokens[start * BLOCK:] + tokens)
            events_out += host.offload(gone)
        made += sum(len(e["block_hashes"]) for e in events_out)
        ts += 0.005
        yield Message(f"replica-{r}", 0, seq[r], "kv-events", msgpack.packb([ts, events_out, 0]), ts)
        seq[r] += 1


class _HostTier:
    """An offloading replica's CPU tier that keys each block alone, without its salt: what it keeps
    (least recently used first) and the events it publishes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.kept: OrderedDict[int, None] = OrderedDict()
        self.tokens: dict[int, list[int]] = {}  # of the blocks on the GPU, to offload them with their tokens

    def learn(self, hashes: list[int], tokens: list[int]) -> None:
        for i, h in enumerate(hashes):
            self.tokens[h] = tokens[i * BLOCK:(i + 1) * BLOCK]

    def restore(self, chain: list[int], tokens: list[int], tenant: int) -> list[dict]:
        """The chain's blocks the GPU missed that this tier keeps, from the first on: a hit here."""
        served = list(takewhile(self.kept.__contains__, chain))
        for h in served:
            self.kept.move_to_end(h)
        return [_event(served, tokens[:BLOCK * len(served)], "CPU", f"tenant-{tenant}")] if served else []

    def offload(self, evicted: list[int]) -> list[dict]:
        """Blocks evicted from the GPU, stored here each on its own and unsalted; the oldest leave."""
        out = []
        for h in evicted:
            tokens = self.tokens.pop(h)
            if h in self.kept:
                self.kept.move_to_end(h)
                continue
            self.kept[h] = None
            out.append(_event([h], tokens, "CPU", None))
        while len(self.kept) > self.capacity:
            out.append({"type": "BlockRemoved", "block_hashes": [self.kept.popitem(last=False)[0]], "medium": "CPU"})
        return out


def _event(hashes: list[int], tokens: list[int], medium: str, salt: str | None) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": medium, "lora_name": None,
            "extra_keys": [[salt] if salt else None] + [None] * (len(hashes) - 1)}


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


def write_example(path: str | Path, events: int = 200_000, replicas: int = 3, seed: int = 0) -> int:
    """A synthetic fleet's capture (not from any server) as a JSONL file or, for a path without .jsonl,
    a capture dataset folder: what `capture-vllm --out` writes, for trying kvviz without a fleet. Its
    conversations come back, one prompt is cached without its tenant's salt, and the last replica of
    two or more offloads to a CPU tier that drops the salt, so every capture view (evicted misses,
    reuse, tiers, cross-tenant and cross-tier blocks) has something to show. Returns the number of
    messages."""
    names = {f"replica-{i}": "synthetic" for i in range(replicas)}
    jsonl = str(path).lower().endswith(".jsonl")
    sink = CaptureWriter(path, names) if jsonl else DatasetWriter(path, names, given_as="")
    try:
        for m in fleet_messages(events, replicas=replicas, seed=seed, turns=0.3, unsalted=0.05,
                                offload=replicas - 1 if replicas > 1 else None):
            sink.add(m, None if jsonl else decode_batch(m.payload, f"{m.replica} {m.seq}"))
    finally:
        sink.close()
    return sink.count


EXAMPLE_NAME = "example-fleet.jsonl"
EXAMPLE_VERSION = 3  # a new number whenever what write_example writes changes: older example files are not reused


def example_file(folder: str | Path, events: int = 200_000) -> Path:
    """The example fleet's capture under `folder`, written once for this EXAMPLE_VERSION (into a file of its
    own first, renamed into place: several sessions of the app may ask for it at once)."""
    path = Path(folder) / f"v{EXAMPLE_VERSION}" / EXAMPLE_NAME
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.parent / f"_{uuid.uuid4().hex}.{EXAMPLE_NAME}"
        write_example(partial, events)
        partial.replace(path)
    return path
