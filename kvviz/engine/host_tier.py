"""The host tier of KV offloading: evicted cached blocks are copied to host memory instead of dropped,
and a later prefix hit copies them back into free device blocks (vLLM's CPU offloading, LMCache).

Bookkeeping only, like the block pool: the tier decides which host block takes which content and
queues the copies (`transfers`) for the engine, which applies them before the step's forward, in
order. Provenance moves with the data: a slot copied out and back keeps its writer, position and
prefix id, written in the lifetime of the device block that receives it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
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


class HostTier:
    """`num_blocks` host blocks holding evicted device content under its hash, least recently used first."""

    def __init__(self, num_blocks: int, block_size: int, device: SlotProvenance, emit: Callable[[BlockEvent], None]):
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self.provenance = SlotProvenance(num_blocks * block_size, names=device)
        self.cached: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> host block, LRU first
        self.hashes: list[BlockHash | None] = [None] * num_blocks
        self.details: list[dict | None] = [None] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.pinned: set[BlockHash] = set()  # being restored this admission: never the victim
        self.transfers: list[Transfer] = []
        self._emit = emit

    def offload(self, b: Block, request: str | None) -> None:
        """The device pool evicts cached block `b`: keep its content here (the pool's `spill`)."""
        if b.hash in self.cached:  # restored earlier and still here: the host copy is the same content
            self.cached.move_to_end(b.hash)
            return
        dst = self._take(request)
        if dst is None:
            return  # every host block is being restored: this content is dropped
        B = self.block_size
        self.provenance.copy(b.id * B, dst * B, B, 1, source=self.device)
        self.cached[b.hash], self.hashes[dst], self.details[dst] = dst, b.hash, b.detail
        self.transfers.append(Transfer("offload", b.id, dst))
        self._emit(BlockEvent("offload", b.id, request, 0, dst, hash=b.hash, **self._detail(dst), medium="GPU"))

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
        """Host block `b` is taken for other content: its hash must go with it."""
        old = self.hashes[b]
        if self.cached.get(old) == b:
            del self.cached[old]
        self.hashes[b] = self.details[b] = None
        self._emit(BlockEvent("host_evict", b, request, 0, hash=old, medium="CPU"))

    def clear(self) -> None:
        """The prefix cache is reset: every host block drops its hash (a clear event each) and is free."""
        for b, h in enumerate(self.hashes):
            if h is not None:
                self._emit(BlockEvent("clear", b, None, 0, hash=h, medium="CPU"))
        self.cached.clear()
        self.hashes, self.details = [None] * self.num_blocks, [None] * self.num_blocks
        self.free = list(range(self.num_blocks - 1, -1, -1))

    def locate(self, h: BlockHash) -> int | None:
        """The host block holding the content hashed `h`, if any."""
        return self.cached.get(h)

    def run(self, hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """The leading hashes of `hashes` the host holds (a prefix continues only while it hits)."""
        out = []
        for h in hashes:
            if self.locate(h) is None:
                break
            out.append(h)
        return out

    def address(self, h: BlockHash) -> int:
        """The host block a restore of `h` copies from: the one holding it."""
        return self.cached[h]

    def restore(self, h: BlockHash, b: Block, request: str) -> None:
        """Copy the content hashed `h` into device block `b`, just allocated for it."""
        src = self.address(h)
        self.cached.move_to_end(h)
        B = self.block_size
        self.device.copy(src * B, b.id * B, B, b.lifetime, source=self.provenance)
        self.transfers.append(Transfer("restore", b.id, src))
        self._emit(BlockEvent("restore", b.id, request, b.ref_cnt, src, hash=h, **self._detail(src)))

    def _detail(self, b: int) -> dict:
        return self.details[b] or {}

    def pop_transfers(self) -> list[Transfer]:
        out, self.transfers = self.transfers, []
        return out
