"""What a vLLM 0.33 server would publish for a kvviz run: each engine step's cache and evict events
as one KV-event batch, `[ts, events, rank]` in msgpack, sent to a sink (a capture file, a ZMQ
publisher). The blocks a request caches in a row are one BlockStored, chained by parent hash, the
salt among the first block's extra keys, the adapter its lora_name; an eviction is a BlockRemoved of
its hash. With a host tier, an offload is a BlockStored on medium CPU and a host eviction a
BlockRemoved there (a restore is the BlockStored on the device that follows). A reset of the prefix
cache is one AllBlocksCleared (the clear events of its blocks, which come in a row). Hashes are the
low 64 bits, unsigned, as vLLM publishes them by default, so a capture of a run names the same
blocks as the run's own `blocks.hash`."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgpack

from ..engine import StepRecord
from ..engine.events import BlockEvent
from ..engine.hashing import hash_to_u64

Sink = Callable[[int, bytes, bytes], None]  # (sequence number, topic, payload)


class KVEventEmitter:
    """An engine step consumer (on_step); numbers its batches from 0, as a publisher does."""

    def __init__(self, block_size: int, sink: Sink, topic: str = "", medium: str = "GPU",
                 clock: Callable[[], float] = time.time):
        self.block_size, self.sink, self.topic = block_size, sink, topic.encode()
        self.medium, self.clock, self.seq = medium, clock, 0

    def on_step(self, rec: StepRecord) -> None:
        events = self.batch(rec.events)
        if events:
            self.sink(self.seq, self.topic, msgpack.packb([self.clock(), events, None]))
            self.seq += 1

    def batch(self, events: list[BlockEvent]) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if e.kind == "clear":
                if not out or out[-1]["type"] != "AllBlocksCleared":  # one reset's blocks come in a row
                    out.append({"type": "AllBlocksCleared"})
            elif e.kind in ("evict", "host_evict") and e.hash is not None:
                out.append({"type": "BlockRemoved", "block_hashes": [hash_to_u64(e.hash)],
                            "medium": self._medium(e.kind)})
            elif e.kind in ("cache", "offload"):  # an offload stores the block on the host tier
                medium = self._medium(e.kind)
                last = out[-1] if out else None
                if (last is not None and last["type"] == "BlockStored" and last["_request"] == e.request
                        and last["_tail"] == e.parent_hash and last["medium"] == medium):  # the same run's next block
                    last["block_hashes"].append(hash_to_u64(e.hash))
                    last["token_ids"].extend(e.token_ids)
                    if "extra_keys" in last:  # one entry per block
                        last["extra_keys"].append(None)
                    last["_tail"] = e.hash
                    continue
                stored = {"type": "BlockStored", "block_hashes": [hash_to_u64(e.hash)],
                          "parent_block_hash": None if e.parent_hash is None else hash_to_u64(e.parent_hash),
                          "token_ids": list(e.token_ids), "block_size": self.block_size, "lora_id": None,
                          "medium": medium, "lora_name": e.adapter, "_request": e.request, "_tail": e.hash}
                if e.salt is not None and e.parent_hash is None:  # the salt enters the first block only
                    stored["extra_keys"] = [[e.salt]]
                out.append(stored)
        for ev in out:
            ev.pop("_request", None)
            ev.pop("_tail", None)
        return out

    def _medium(self, kind: str) -> str:
        """Where the event's block is: the host tier (offload, host_evict) or the publisher's medium."""
        return "CPU" if kind in ("offload", "host_evict") else self.medium
