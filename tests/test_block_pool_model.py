"""Property-based test of the block pool against a deliberately naive reference model.

The model keeps the free queue as a Python list and names cached blocks by (salt, token prefix)
instead of a hash chain, so it shares no code with the pool; a prefix may be cached in several blocks
at once, and a reset forgets them all once no block is held. After every random step the two must
agree on page tables, refcounts, free-queue order and cache contents, `check()` must pass, and no
live request may hold a slot whose content another prefix wrote.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvviz.engine import KVCacheManager, OutOfBlocks


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ReferenceModel:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        self.B, self.caching = block_size, caching
        self.free = list(range(num_blocks))
        self.ref = [0] * num_blocks
        self.key: dict[int, tuple] = {}
        self.cache: dict[tuple, set[int]] = {}  # every block holding a key; a hit takes the lowest
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.salt: dict[str, str | None] = {}

    def block_key(self, sid: str, i: int) -> tuple:
        return self.salt[sid], tuple(self.tokens[sid][: (i + 1) * self.B])

    def pop(self) -> int:
        b = self.free.pop(0)
        if b in self.key:
            k = self.key.pop(b)
            self.cache[k].discard(b)
            if not self.cache[k]:
                del self.cache[k]
        self.ref[b] = 1
        return b

    def release(self, blocks: list[int]) -> None:
        freed = []
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                freed.append(b)
        self.free[:0] = [b for b in freed if b not in self.key]  # one batch at the head, in the order given
        self.free += [b for b in freed if b in self.key]

    def add(self, sid, tokens, salt):
        self.tokens[sid], self.salt[sid], self.tables[sid], self.computed[sid] = list(tokens), salt, [], 0

    def admit(self, sid: str, budget: int) -> bool:
        hits = []
        for i in range((len(self.tokens[sid]) - 1) // self.B if self.caching else 0):
            copies = self.cache.get(self.block_key(sid, i))
            if not copies:
                break
            b = min(copies)
            hits.append(b)
        cached = len(hits) * self.B
        n = min(budget, len(self.tokens[sid]) - cached)
        needed = ceil_div(cached + n, self.B) - len(hits) + sum(self.ref[b] == 0 for b in hits)
        if needed > len(self.free):
            return False
        for b in hits:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        self.tables[sid], self.computed[sid] = list(hits), cached
        assert self.allocate(sid, n)
        return True

    def allocate(self, sid: str, n: int) -> bool:
        table, start = self.tables[sid], self.computed[sid]
        shared = start % self.B != 0 and self.ref[table[start // self.B]] > 1
        new = max(0, ceil_div(start + n, self.B) - len(table))
        if new + shared > len(self.free):
            return False
        if shared:
            i = start // self.B
            dst = self.pop()
            self.release([table[i]])
            table[i] = dst
        table += [self.pop() for _ in range(new)]
        return True

    def commit(self, sid: str, n: int) -> None:
        start = self.computed[sid]
        self.computed[sid] = start + n
        if not self.caching:
            return
        for i in range(start // self.B, (start + n) // self.B):
            k = self.block_key(sid, i)
            self.cache.setdefault(k, set()).add(self.tables[sid][i])
            self.key[self.tables[sid][i]] = k

    def fork(self, parent: str, child: str) -> None:
        self.add(child, self.tokens[parent], self.salt[parent])
        self.tables[child], self.computed[child] = list(self.tables[parent]), self.computed[parent]
        for b in self.tables[child]:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1

    def drop(self, sid: str, forget: bool) -> None:
        self.release(list(reversed(self.tables[sid])))
        self.tables[sid], self.computed[sid] = [], 0
        if forget:
            for d in (self.tables, self.computed, self.tokens, self.salt):
                del d[sid]


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=24)


class BlockPoolMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 14),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks, block_size, caching):
        self.mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.model = ReferenceModel(num_blocks, block_size, caching)
        self.history: list[list[int]] = [[0, 1, 2, 0, 1, 2, 0, 1]]
        self.next_id = 0

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def unchanged_on_failure(self, action, model_ok: bool) -> bool:
        before = self.mgr.snapshot()
        try:
            action()
        except OutOfBlocks:
            assert not model_ok, "pool refused an allocation the model could make"
            assert self.mgr.snapshot() == before, "a failed allocation changed the pool"
            return False
        assert model_ok, "pool made an allocation the model could not"
        return True

    def live(self, pred=lambda m, s: True) -> list[str]:
        return sorted(s for s in self.model.tokens if pred(self.model, s))

    @rule(data=st.data(), own=tokens_st, salt=st.sampled_from([None, "t1", "t2"]), budget=st.integers(1, 30))
    def add_request(self, data, own, salt, budget):
        prefix = data.draw(st.sampled_from(self.history))[: data.draw(st.integers(0, 12))]
        tokens, sid = prefix + own, self.new_id()
        self.history.append(tokens)
        self.mgr.add(sid, tokens, salt)
        self.model.add(sid, tokens, salt)
        if self.unchanged_on_failure(lambda: self.mgr.admit(sid, budget), self.model.admit(sid, budget)):
            self.mgr.commit(sid, min(budget, len(tokens) - self.model.computed[sid]))
            self.model.commit(sid, self.mgr.seqs[sid].num_computed - self.model.computed[sid])

    @precondition(lambda self: self.live(lambda m, s: not m.tables[s]))
    @rule(data=st.data(), budget=st.integers(1, 30))
    def readmit(self, data, budget):
        sid = data.draw(st.sampled_from(self.live(lambda m, s: not m.tables[s])))
        if self.unchanged_on_failure(lambda: self.mgr.admit(sid, budget), self.model.admit(sid, budget)):
            n = min(budget, len(self.model.tokens[sid]) - self.model.computed[sid])
            self.mgr.commit(sid, n)
            self.model.commit(sid, n)

    @precondition(lambda self: self.live(lambda m, s: m.tables[s]))
    @rule(data=st.data(), n=st.integers(1, 6), token=st.integers(0, 2))
    def step(self, data, n, token):
        """A prefill chunk, or a decode token once the prompt is done."""
        sid = data.draw(st.sampled_from(self.live(lambda m, s: m.tables[s])))
        remaining = len(self.model.tokens[sid]) - self.model.computed[sid]
        if remaining == 0:
            self.mgr.append_tokens(sid, [token])
            self.model.tokens[sid].append(token)
            n = 1
        n = min(n, max(remaining, 1))
        if self.unchanged_on_failure(lambda: self.mgr.allocate(sid, n), self.model.allocate(sid, n)):
            self.mgr.commit(sid, n)
            self.model.commit(sid, n)

    @precondition(lambda self: self.live(lambda m, s: m.tables[s]))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=3))
    def fork(self, data, extra):
        parent, child = data.draw(st.sampled_from(self.live(lambda m, s: m.tables[s]))), self.new_id()
        self.mgr.fork(parent, child)
        self.model.fork(parent, child)
        self.mgr.append_tokens(child, extra)
        self.model.tokens[child] += extra

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data, preempt):
        sid = data.draw(st.sampled_from(self.live()))
        (self.mgr.preempt if preempt else self.mgr.free)(sid)
        self.model.drop(sid, forget=not preempt)

    @rule()
    def reset_prefix_cache(self):
        """Refused (nothing changes) while any block is held; otherwise every hash is forgotten."""
        idle, before = not any(self.model.ref), self.mgr.snapshot()
        assert self.mgr.reset_prefix_cache() == idle
        if idle:
            self.model.key.clear()
            self.model.cache.clear()
        else:
            assert self.mgr.snapshot() == before

    @invariant()
    def agrees_with_model_and_isolated(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check()
        snap, m = self.mgr.snapshot(), self.model
        assert snap.page_tables == {s: tuple(t) for s, t in m.tables.items()}
        assert snap.num_computed == m.computed
        assert list(snap.refcounts) == m.ref
        assert list(snap.free_queue) == m.free
        assert {b for b, h in enumerate(snap.hashes) if h is not None} == set(m.key)
        for sid in m.tokens:
            assert self.mgr.foreign_slots(sid) == [], f"{sid} holds slots written by another prefix"


BlockPoolMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestBlockPool = pytest.mark.slow(BlockPoolMachine.TestCase)
