"""Requests scheduled onto llama.cpp's sequences the way llama-server schedules its slots.

A slot is a sequence id. A running request owns one; when it ends the slot goes idle and keeps its
cells (llama-server's per-slot prompt cache), so a later request can reuse them. A request arriving
takes the idle slot whose cells share the longest prefix with its prompt (the least recently used when
none shares any), keeps that prefix and `seq_rm`s the rest of the slot; when another sequence, running
or idle, holds a longer common prefix, the slot is emptied and `seq_cp` gives it that prefix instead
(the unified cache shares the cells, copying nothing). A fork or a resumed session is a prompt that
starts with its parent's history, so its parent's cells are found the same way. At least the last
prompt token is always computed: its logits give the first token.

Each step's batch, as llama-server's loop builds it: one token for every request generating, then
prompt tokens of the requests still reading theirs, in arrival order, up to `n_batch`. A request is
admitted only while the cache can hold what every running request may still write (their remaining
prompt and generation); idle slots' cells are given back, least recently used first, to make room.

Cells given back that way are not lost: as llama-server's host-memory prompt cache keeps them, the
sequence's state is saved first (`llama_state_seq_get_data`), and a later request whose prompt shares
more with a saved prompt than with any sequence's cells has it restored into its slot
(`llama_state_seq_set_data`), keeping the shared prefix.

Which llama.cpp calls are made goes through `CacheOps`, so that a misuse of the API (misuse.py) is a
different call, visible to nothing but what llama.cpp then computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .misuse import Misuse


@dataclass(frozen=True, kw_only=True)
class Saved:
    """A sequence's state as llama.cpp wrote it, and kvviz's facts of each of its cells in that order."""

    state: bytes
    cells: list


@dataclass(kw_only=True)
class HostEntry:
    """A prompt in llama-server's host-memory cache: its tokens and the saved state of their cells."""

    tokens: list[int]
    saved: Saved


class CacheOps(Protocol):
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...

    def save(self, seq: int) -> Saved: ...

    def restore(self, seq: int, saved: Saved, keep: int) -> None:
        """The saved state into sequence seq, then its cells from position `keep` on removed."""

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None: ...

    def free_cells(self) -> int: ...

    def freed_by_rm(self, seq: int, p0: int) -> int:
        """Cells `seq_rm(seq, p0, -1)` would free: those only seq holds, at positions from p0."""


@dataclass(kw_only=True, eq=False)
class Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)  # what its cells hold, by position (its prompt cache)
    request: str | None = None  # the request running on it
    last: str | None = None  # the request that ran on it last (whose cells an idle slot keeps)
    used: int = -1  # the last step a request ran on it


@dataclass(kw_only=True)
class Job:
    """A request on its way through the slots."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    history: list[int] = field(default_factory=list)  # prompt, then each sampled token
    slot: Slot | None = None
    computed: int = 0  # tokens whose K/V are in its cells: positions 0..computed-1
    cached: int = 0  # prompt tokens it found in the cache on admission
    offset: int = 0  # added to every position it decodes (0 unless a misuse restarts positions)

    def __post_init__(self) -> None:
        self.history = list(self.prompt)

    @property
    def reading(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def remaining(self) -> int:
        """Cells it may still write: the rest of its prompt and every token it may generate."""
        return len(self.prompt) + self.max_new_tokens - self.computed


@dataclass(kw_only=True)
class Chunk:
    """A request's part of one batch."""

    job: Job
    start: int  # first position computed
    tokens: list[int]
    positions: list[int]  # as given to llama.cpp (the positions, unless a misuse says otherwise)
    sample: bool  # its last token's logits give its next token


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Slots:
    def __init__(self, n_seq: int, n_batch: int, ops: CacheOps, misuse: Misuse | None = None, reuse: bool = True,
                 share: bool = True):
        """reuse False: no prompt is served from cells (llama-server's cache_prompt off): every admission
        empties its slot and computes the whole prompt. share False: a stream per sequence (kv_unified off),
        where seq_cp between sequences copies a whole buffer: a request reuses only its own slot's cells,
        each slot's stream holds what it may write (checked before the run), and no idle slot gives room."""
        self.slots = [Slot(seq=i) for i in range(n_seq)]
        self.n_batch, self.ops, self.misuse, self.share = n_batch, ops, misuse, share
        self.room = (lambda job: max(len(job.prompt) - 1, 0)) if reuse else (lambda job: 0)
        self.waiting: list[Job] = []
        self.running: list[Job] = []
        self.host: list[HostEntry] = []  # the host-memory prompt cache, oldest first (none without reuse)
        self.reuse = reuse
        self.struck: list[str] = []  # the requests whose calls the misuse changed

    def admit(self, step: int) -> list[Job]:
        """Waiting requests onto slots, first come first served, while a slot and room are free."""
        out = []
        while self.waiting and self._admit(self.waiting[0], step):
            out.append(self.waiting.pop(0))
        return out

    def _admit(self, job: Job, step: int) -> bool:
        free = [s for s in self.slots if s.request is None]
        if not free:
            return False
        room = self.room(job)  # the last prompt token is always computed
        slot = max(free, key=lambda s: (min(common_prefix(s.tokens, job.prompt), room), -s.used))
        if common_prefix(slot.tokens, job.prompt) == 0:
            slot = min(free, key=lambda s: s.used)  # no prefix to reuse: the least recently used
        kept = min(common_prefix(slot.tokens, job.prompt), room)
        donors = [(min(common_prefix(self.held(s), job.prompt), room), s) for s in self.slots
                  if s is not slot and self.share]
        shared, donor = max(donors, key=lambda d: d[0], default=(0, None))
        n = max(kept, shared)
        entry, restored = self._from_host(job, room, n)
        n = max(n, restored)
        freed = self.ops.freed_by_rm(slot.seq, kept if kept >= max(shared, restored) else 0)  # what it gives back
        extra = len(entry.tokens) - restored if entry else 0  # restored whole, then cut to what it keeps
        donating = {donor} if shared > max(kept, restored) else set()  # a donor holding nothing it needs goes too
        if self.share and not self._room_for(job.remaining - n - freed + extra, keep={slot} | donating):
            return False
        held, job.offset, slot.request = len(slot.tokens), 0, job.id  # the calls below are made for it
        if entry is not None:
            self.ops.seq_rm(slot.seq)
            self.ops.restore(slot.seq, entry.saved, restored)
        elif shared > kept:
            self.ops.seq_rm(slot.seq)
            if self.misuse == Misuse.CP_ONE_LONG and shared < min(room, len(self.held(donor))):
                n = shared + 1  # one cell too many, counted as the request's own prefix
                self.struck.append(job.id)
            self.ops.seq_cp(donor.seq, slot.seq, 0, n)
        elif self.misuse == Misuse.REUSE_WITHOUT_RM:  # and positions go on from the cells it still holds
            job.offset = held - kept
            if held > kept:
                self.struck.append(job.id)
        else:
            self.ops.seq_rm(slot.seq, kept, -1)
        if self.misuse == Misuse.POSITIONS_FROM_ZERO and n:
            job.offset = -n
            self.struck.append(job.id)
        job.slot, job.cached, job.computed = slot, n, n
        slot.tokens, slot.request, slot.used = job.prompt[:n], job.id, step
        self.running.append(job)
        return True

    def _from_host(self, job: Job, room: int, device: int) -> tuple[HostEntry | None, int]:
        """The saved prompt to restore for this request, and the prefix it keeps: the one sharing most with
        its prompt, when that beats every sequence's cells. The misuse RESTORE_WRONG restores the prompt
        saved last of the others instead, trusting it as the request's own as far as it goes."""
        if not self.host:
            return None, 0
        best = max(self.host, key=lambda e: common_prefix(e.tokens, job.prompt))
        n = min(common_prefix(best.tokens, job.prompt), room)
        if n <= device:
            return None, 0
        others = [e for e in self.host if e is not best]
        if self.misuse == Misuse.RESTORE_WRONG and others:
            self.struck.append(job.id)
            return others[-1], min(len(others[-1].tokens), room)
        return best, n

    def held(self, slot: Slot) -> list[int]:
        """The tokens a slot's cells hold: a running request's computed ones, an idle slot's cache."""
        job = next((j for j in self.running if j.slot is slot), None)
        return job.history[:job.computed] if job is not None else slot.tokens

    def _room_for(self, cells: int, keep: set) -> bool:
        """Whether the cache can take `cells` more beside what running requests may still write, giving
        back idle slots' cells (least recently used first, never those in `keep`) to make room."""
        def enough() -> bool:
            return self.ops.free_cells() >= cells + sum(j.remaining for j in self.running)

        idle = sorted((s for s in self.slots if s.request is None and s.tokens and s not in keep), key=lambda s: s.used)
        while not enough() and idle:
            s = idle.pop(0)
            if self.reuse:  # kept in host memory, as llama-server's prompt cache keeps it
                self.host.append(HostEntry(tokens=list(s.tokens), saved=self.ops.save(s.seq)))
            self.ops.seq_rm(s.seq)
            s.tokens = []
        return enough()

    def batch(self) -> list[Chunk]:
        """This step's work: a token for each generating request, then prompt chunks up to n_batch."""
        out = [self._chunk(j, 1) for j in self.running if not j.reading]
        budget = self.n_batch - len(out)
        for j in self.running:
            if j.reading and budget > 0:
                n = min(budget, len(j.prompt) - j.computed)
                out.append(self._chunk(j, n))
                budget -= n
        return out

    def _chunk(self, job: Job, n: int) -> Chunk:
        start = job.computed
        return Chunk(job=job, start=start, tokens=job.history[start:start + n],
                     positions=[job.offset + p for p in range(start, start + n)],
                     sample=start + n == len(job.history))

    def computed(self, chunks: list[Chunk], step: int) -> None:
        """The batch went through: each request's cells hold its chunk now."""
        for c in chunks:
            c.job.computed += len(c.tokens)
            c.job.slot.tokens = c.job.history[:c.job.computed]
            c.job.slot.used = step

    def finish(self, job: Job) -> None:
        """The request ended: its slot goes idle, its cells kept for the next request that shares them."""
        self.running.remove(job)
        job.slot.request, job.slot.last = None, job.id

    def cancel(self, request_id: str) -> bool:
        for j in self.waiting:
            if j.id == request_id:
                self.waiting.remove(j)
                return True
        for j in self.running:
            if j.id == request_id:
                self.finish(j)
                return True
        return False



class OneSequence(Slots):
    """The misuse Misuse.ONE_SEQUENCE: every request in sequence 0, positions numbered on from what it
    holds (as llama_batch_get_one's callers do), nothing ever removed."""

    def __init__(self, n_seq: int, n_batch: int, ops: CacheOps, misuse: Misuse | None = None, reuse: bool = True,
                 share: bool = True):
        super().__init__(n_seq, n_batch, ops, misuse, reuse, share)
        self.next_pos = 0

    def _admit(self, job: Job, step: int) -> bool:
        if not self._room_for(job.remaining, keep=set()):
            return False
        if self.next_pos or self.running:  # the sequence holds another request's cells, or will this step
            self.struck.append(job.id)
        job.slot = self.slots[0]
        self.running.append(job)
        return True

    def _chunk(self, job: Job, n: int) -> Chunk:
        chunk = super()._chunk(job, n)
        chunk.positions = list(range(self.next_pos, self.next_pos + n))
        self.next_pos += n
        return chunk

    def finish(self, job: Job) -> None:
        self.running.remove(job)

