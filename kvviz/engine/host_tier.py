"""The host tier of KV offloading: evicted cached blocks are copied to host memory instead of dropped,
and a later prefix hit copies them back into free device blocks (vLLM's CPU offloading, LMCache).

Bookkeeping only, like the block pool: the tier decides which host block takes which content and
queues the copies (`transfers`) for the engine, which applies them before the step's forward, in
order. Provenance moves with the data: a slot copied out and back keeps its writer, position and
prefix id, written in the lifetime of the device block that receives it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from .block_pool import Block
from .events import BlockEvent
from .hashing import BlockHash
from .provenance import SlotProvenance


@dataclass(frozen=True, slots=True)
class Transfer:
    """One block's K/V to copy: `offload` device -> host, `restore` host -> device."""

    kind: str
    device_block: int
    host_block: int


HostKey = Hashable  # what the host tier files a block under: the device's block hash (see `key`)


@dataclass(frozen=True, slots=True)
class Stored:
    """A full block as the host tier is asked about it: its device hash and the content id of its last
    token (the prefix id: the tokens and the weights, no namespace)."""

    hash: BlockHash
    content: int


class HostTier:
    """`num_blocks` host blocks holding evicted device content under its key, least recently used first."""

    def __init__(self, num_blocks: int, block_size: int, device: SlotProvenance, emit: Callable[[BlockEvent], None]):
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self.provenance = SlotProvenance(num_blocks * block_size, names=device)
        self.cached: OrderedDict[HostKey, int] = OrderedDict()  # key -> host block, LRU first
        self.keys: list[HostKey | None] = [None] * num_blocks
        self.hashes: list[BlockHash | None] = [None] * num_blocks  # the device hash each holds (events, snapshots)
        self.details: list[dict | None] = [None] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.pinned: set[HostKey] = set()  # being restored this admission: never the victim
        self.transfers: list[Transfer] = []
        self._emit = emit

    def key(self, block: Stored) -> HostKey:
        """The host tier's key of a block: the device's hash, so the tenant salt and adapter it carries
        hold on this tier too (a tier that keys by tokens alone shares blocks across tenants)."""
        return block.hash

    def offload(self, b: Block, request: str | None) -> None:
        """The device pool evicts cached block `b`: keep its content here (the pool's `spill`)."""
        B = self.block_size
        k = self.key(Stored(b.hash, self.device.prefix[b.id * B + B - 1]))
        if k in self.cached:  # restored earlier and still here: the host copy is the same content
            self.cached.move_to_end(k)
            return
        dst = self._take(request)
        if dst is None:
            return  # every host block is being restored: this content is dropped
        self.copy_out(b.id, dst)
        self.cached[k], self.keys[dst], self.hashes[dst], self.details[dst] = dst, k, b.hash, b.detail
        self._emit(BlockEvent("offload", b.id, request, 0, dst, hash=b.hash, **self._detail(dst), medium="GPU"))

    def copy_out(self, device_block: int, host_block: int) -> None:
        """The offload's copy, queued for the engine to apply before the next forward writes the device
        block again; its slot facts move now, as they are."""
        B = self.block_size
        self.provenance.copy(device_block * B, host_block * B, B, 1, source=self.device)
        self.transfers.append(Transfer("offload", device_block, host_block))

    def _take(self, request: str | None) -> int | None:
        if self.free:
            return self.free.pop()
        victim = next((h for h in self.cached if h not in self.pinned), None)
        if victim is None:
            return None
        b = self.cached[victim]
        self.forget(b, request)
        return b

    def forget(self, b: int, request: str | None) -> None:
        """Host block `b` is taken for other content: its key must go with it."""
        old, k = self.hashes[b], self.keys[b]
        if self.cached.get(k) == b:
            del self.cached[k]
        self.keys[b] = self.hashes[b] = self.details[b] = None
        self._emit(BlockEvent("host_evict", b, request, 0, hash=old, medium="CPU"))

    def clear(self) -> None:
        """The prefix cache is reset: every host block drops its hash (a clear event each) and is free."""
        for b, h in enumerate(self.hashes):
            if h is not None:
                self._emit(BlockEvent("clear", b, None, 0, hash=h, medium="CPU"))
        self.cached.clear()
        self.keys, self.hashes = [None] * self.num_blocks, [None] * self.num_blocks
        self.details = [None] * self.num_blocks
        self.free = list(range(self.num_blocks - 1, -1, -1))

    def run(self, blocks: Iterable[Stored]) -> list[HostKey]:
        """The keys of the leading `blocks` the host holds (a prefix continues only while it hits)."""
        out = []
        for block in blocks:
            k = self.key(block)
            if k not in self.cached:
                break
            out.append(k)
        return out

    def address(self, k: HostKey) -> int:
        """The host block a restore of the content keyed `k` copies from: the one holding it."""
        return self.cached[k]

    def restore(self, k: HostKey, b: Block, request: str) -> None:
        """Copy the content keyed `k` into device block `b`, just allocated for it."""
        src = self.address(k)
        self.cached.move_to_end(k)
        B = self.block_size
        self.device.copy(src * B, b.id * B, B, b.lifetime, source=self.provenance)
        self.transfers.append(Transfer("restore", b.id, src))
        self._emit(BlockEvent("restore", b.id, request, b.ref_cnt, src, hash=self.hashes[src], **self._detail(src)))

    def _detail(self, b: int) -> dict:
        return self.details[b] or {}

    def pop_transfers(self) -> list[Transfer]:
        out, self.transfers = self.transfers, []
        return out
