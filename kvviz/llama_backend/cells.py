"""kvviz's account of llama.cpp's KV cells: where each token's K/V went, which sequences hold each cell,
and the provenance of every cell's content, checked against llama.cpp's own state after every step.

llama.cpp's unified cache is one buffer of cells; a cell holds a position and a *set* of sequence ids.
`llama_memory_seq_cp` shares cells by adding a sequence id to them (no copy), `seq_rm` takes ids away,
and a cell with no id left is free (its K/V stays in the buffer until a write reuses it). kvviz learns
where writes go from the graph (the cache write's indices), applies the seq_cp / seq_rm calls it made
with llama.cpp's documented semantics, and compares the result with the cells llama.cpp's state API
reports (position and sequence ids of every occupied cell, in cell order): a difference stops the run.

Where llama.cpp puts cells it is not told (a restored sequence's) follows from its search: each stream
has a head, which a decode leaves after its last cell and a `seq_rm` moves back to the first cell it
frees; a search starts there (or at 0 when at least twice the cells sought lie free before it) and takes
the empty cells it meets, wrapping. kvviz keeps the heads as llama.cpp does (`place`); the state check
after the step confirms the placement, and a test holds it to every decode's observed cells.

Cells are kvviz's slots. For the block map and the oracle's lifetimes they are grouped into blocks of
`block_size` cells. A cell freed while others of its block stay held must read as stale, not as its old
content, so a block's lifetime moves on when any of its cells is freed and the cells still held are
stamped with the new lifetime: a freed cell alone keeps the old one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine.events import BlockEvent
from ..engine.kv_cache import PoolSnapshot
from ..engine.provenance import SlotFacts, SlotProvenance
from .adapter import BackendError
from .facts import Cell


@dataclass(frozen=True)
class CellSnapshot(PoolSnapshot):
    """The cache as a pool snapshot; live slots are the occupied cells (cells are not position-aligned
    to blocks as a paged pool's are)."""

    occupied: int = 0

    def live_slots(self) -> int:
        return self.occupied


class CellTable:
    """Every cell's position, sequence set and provenance (streams numbered on: cell = stream * size + i)."""

    def __init__(self, n_cells: int, block_size: int, streams: int = 1):
        self.n_cells, self.block_size, self.streams = n_cells, block_size, streams
        self.pos = [-1] * n_cells
        self.seqs: list[set[int]] = [set() for _ in range(n_cells)]
        self.by_seq: dict[int, set[int]] = {}  # sequence -> the cells it holds
        self.provenance = SlotProvenance(n_cells)
        # each block's lifetime, in an array the oracle reads live (a stream decoded later in a step moves it)
        self.life = np.zeros((n_cells + block_size - 1) // block_size, dtype=np.int64)
        self.events: list[BlockEvent] = []  # since the last take_events
        self.head = [0] * streams  # llama.cpp's v_heads: where each stream's search for free cells starts

    # -- what happened to the cells ------------------------------------------------------------
    def write(self, cell: int, pos: int, seqs: tuple[int, ...], *, index: int, prefix_id: int, token: int,
              writer: str, tenant: str | None) -> None:
        """A token's K/V written into `cell` by a decode (llama.cpp's write index for it): `pos` is the position
        llama.cpp was given, `index` the token's place in its request's history (the provenance's position:
        they differ only when an application numbers positions wrong)."""
        b = cell // self.block_size
        if self.seqs[cell]:
            raise BackendError(f"llama.cpp wrote into cell {cell}, which sequences {sorted(self.seqs[cell])} "
                               "still hold")
        if not self._held(b):
            self.life[b] += 1
            self.events.append(BlockEvent("allocate", b, writer, 1))
        self.pos[cell], self.seqs[cell] = pos, set(seqs)
        for s in seqs:
            self.by_seq.setdefault(s, set()).add(cell)
        self.provenance.record(cell, prefix_id, index, token, writer, tenant, int(self.life[b]))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int, request: str | None = None) -> None:
        """`llama_memory_seq_cp` in one stream: dst joins every cell of src at a position in [p0, p1) (for
        `request`, the one dst serves)."""
        if src == dst:
            return
        if self.streams > 1:
            raise BackendError(f"seq_cp({src}, {dst}) between streams copies a whole buffer: kvviz shares cells in "
                               "one unified cache only")
        hi = p1 if p1 >= 0 else 1 << 62
        shared: dict[int, int] = {}
        for c in sorted(self.by_seq.get(src, ())):
            if max(p0, 0) <= self.pos[c] < hi and dst not in self.seqs[c]:
                self.seqs[c].add(dst)
                self.by_seq.setdefault(dst, set()).add(c)
                b = c // self.block_size
                shared[b] = max(shared.get(b, 0), len(self.seqs[c]))
        for b, n in shared.items():
            self.events.append(BlockEvent("share", b, request, n))

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1, request: str | None = None) -> None:
        """`llama_memory_seq_rm`: seq leaves its cells at positions in [p0, p1) (-1: open ends; `request`: the
        one seq served last); the stream's head moves back to the first cell freed."""
        hi = p1 if p1 >= 0 else 1 << 62
        freed: set[int] = set()
        left: dict[int, int] = {}
        held = self.by_seq.get(seq, set())
        for c in sorted(held):
            if max(p0, 0) <= self.pos[c] < hi:
                self.seqs[c].discard(seq)
                held.discard(c)
                b = c // self.block_size
                left[b] = max(left.get(b, 0), len(self.seqs[c]))
                if not self.seqs[c]:
                    freed.add(c)
        for b, n in left.items():
            self.events.append(BlockEvent("free", b, request, n))
        for b in sorted({c // self.block_size for c in freed}):
            self._stale(b)
        if freed:
            s, size = divmod(min(freed), self.n_cells // self.streams)
            self.head[s] = min(self.head[s], size)

    # -- where llama.cpp puts cells ------------------------------------------------------------
    def place(self, n: int, stream: int = 0) -> list[int]:
        """The n cells llama.cpp's search (find_slot, non-contiguous) takes in `stream` now: empty ones from
        the head, wrapping, from 0 when twice n lie free before the head."""
        size = self.n_cells // self.streams
        base, used = stream * size, sum(1 for c in range(stream * size, (stream + 1) * size) if self.seqs[c])
        head = self.head[stream] if self.head[stream] <= used + 2 * n else 0
        out = [base + (head + i) % size for i in range(size) if not self.seqs[base + (head + i) % size]][:n]
        if len(out) < n:
            raise BackendError(f"llama.cpp has no {n} free cells in stream {stream} (it holds {size})")
        return out

    def placed(self, cells: list[int]) -> None:
        """Cells of one evaluation were written: the stream's head moves past the last."""
        s, i = divmod(cells[-1], self.n_cells // self.streams)
        self.head[s] = i + 1

    def saved(self, seq: int) -> list[tuple[int, SlotFacts]]:
        """What `llama_state_seq_get_data(seq)` keeps, in its order (cell order): each cell's position and
        the facts of its content, to give the cells a restore makes."""
        return [(self.pos[c], self.provenance.facts(c)) for c in sorted(self.by_seq.get(seq, ()))]

    def restore(self, seq: int, saved: list[tuple[int, SlotFacts]], request: str | None) -> list[int]:
        """`llama_state_seq_set_data(seq)`: seq's cells removed, then the saved cells placed as llama.cpp's
        search places them, holding seq and their saved content (`request`: whom the restore serves)."""
        self.seq_rm(seq, request=request)
        stream = 0 if self.streams == 1 else seq
        cells = self.place(len(saved), stream)
        for cell, (pos, f) in zip(cells, saved, strict=True):
            self.write(cell, pos, (seq,), index=f.pos, prefix_id=f.prefix_id, token=f.token, writer=f.writer,
                       tenant=f.tenant)
        if cells:
            self.placed(cells)
        return cells

    def _stale(self, b: int) -> None:
        """Cells of block b were freed: a new lifetime, in which the cells still held are written."""
        self.life[b] += 1
        lo = b * self.block_size
        for c in range(lo, min(lo + self.block_size, self.n_cells)):
            if self.seqs[c]:
                self.provenance.life[c] = int(self.life[b])

    def _held(self, b: int) -> bool:
        lo = b * self.block_size
        return any(self.seqs[c] for c in range(lo, min(lo + self.block_size, self.n_cells)))

    def take_events(self) -> list[BlockEvent]:
        out, self.events = self.events, []
        return out

    # -- checks and views ----------------------------------------------------------------------
    def check(self, reported: list[list[Cell]], step: int) -> None:
        """The cells llama.cpp's state reports, stream by stream in cell order, must be kvviz's."""
        size = self.n_cells // self.streams
        for s, cells in enumerate(reported):
            ours = [Cell(pos=self.pos[c], seqs=frozenset(self.seqs[c]))
                    for c in range(s * size, (s + 1) * size) if self.seqs[c]]
            if ours != cells:
                at = next((i for i, (a, b) in enumerate(zip(ours, cells, strict=False)) if a != b),
                          min(len(ours), len(cells)))
                theirs = cells[at] if at < len(cells) else "nothing"
                mine = ours[at] if at < len(ours) else "nothing"
                raise BackendError(f"step {step}: llama.cpp's state reports {len(cells)} occupied cells in stream {s} "
                                   f"where kvviz counted {len(ours)}; the {at + 1}th is {theirs}, kvviz's {mine}")

    def freed_by_rm(self, seq: int, p0: int) -> int:
        """Cells `seq_rm(seq, p0, -1)` would free: those no other sequence holds, at positions from p0."""
        return sum(1 for c in self.by_seq.get(seq, ()) if self.pos[c] >= p0 and len(self.seqs[c]) == 1)

    def occupied(self) -> int:
        return sum(1 for s in self.seqs if s)

    def cells_of(self, seq: int) -> list[int]:
        """The cells sequence seq holds, by position."""
        return sorted(self.by_seq.get(seq, ()), key=lambda c: (self.pos[c], c))

    def snapshot(self, running: dict[str, int], named: dict[int, bytes]) -> CellSnapshot:
        """The cache as a block map: a block's refcount is how many running requests hold cells in it (they
        share a cell only where its sequence set says so); a block that only idle sequences hold
        (llama-server's slot cache, kept for reuse) shows as cached, named as its KV events name the block
        starting in it (`named`), else by its first held cell's content."""
        B, n_blocks = self.block_size, len(self.life)
        live, holders = set(running.values()), [set() for _ in range(n_blocks)]
        hashes, tables = [None] * n_blocks, {}
        for c in range(self.n_cells):
            if self.seqs[c]:
                b = c // B
                holders[b] |= self.seqs[c] & live
                if hashes[b] is None:
                    hashes[b] = named.get(b) or self.provenance.prefix[c].to_bytes(8, "big")
        refcounts = [len(h) for h in holders]
        for rid, seq in running.items():
            tables[rid] = tuple(dict.fromkeys(c // B for c in self.cells_of(seq)))
        for b in range(n_blocks):
            if refcounts[b]:
                hashes[b] = None
        free = tuple(b for b in range(n_blocks) if not refcounts[b] and hashes[b] is None)
        return CellSnapshot(B, tuple(refcounts), tuple(hashes), tuple(self.life.tolist()), free, tables,
                            {rid: len(self.cells_of(seq)) for rid, seq in running.items()},
                            occupied=self.occupied())
