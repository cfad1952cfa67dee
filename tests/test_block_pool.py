"""Unit tests that pin the block pool to vLLM's prefix-caching semantics."""

from __future__ import annotations

import pytest

from kvviz.engine import InvariantError, KVCacheManager, OutOfBlocks
from kvviz.engine.block_pool import Block, FreeQueue
from kvviz.engine.hashing import block_hash, hash_to_u64, prefix_ids

B = 4


def prefill(mgr: KVCacheManager, sid: str, tokens, salt=None):
    mgr.add(sid, tokens, salt)
    alloc = mgr.admit(sid, len(tokens))
    mgr.commit(sid, len(alloc.slots))
    return alloc


def test_hash_chain_links_each_block_to_its_parent():
    mgr = KVCacheManager(8, B)
    prefill(mgr, "A", list(range(9)))
    h0 = block_hash(None, [0, 1, 2, 3])
    h1 = block_hash(h0, [4, 5, 6, 7])
    assert [mgr.pool.blocks[b].hash for b in mgr.seqs["A"].block_table] == [h0, h1, None]
    assert block_hash(block_hash(None, [9, 1, 2, 3]), [4, 5, 6, 7]) != h1  # same tokens, other parent
    assert 0 <= hash_to_u64(h1) < 2**64


def test_partial_blocks_are_never_hashed():
    mgr = KVCacheManager(8, B)
    prefill(mgr, "A", [1, 2, 3, 4, 5, 6])
    table = mgr.seqs["A"].block_table
    assert mgr.pool.blocks[table[0]].hash is not None
    assert mgr.pool.blocks[table[1]].hash is None
    assert len(mgr.pool.cached) == 1


def test_refcount_is_one_then_two_when_a_prefix_is_shared():
    mgr = KVCacheManager(8, B)
    prefill(mgr, "A", [1, 2, 3, 4, 5])
    first = mgr.seqs["A"].block_table[0]
    assert mgr.pool.blocks[first].ref_cnt == 1
    alloc = prefill(mgr, "B", [1, 2, 3, 4, 9, 9])
    assert alloc.start == 4 and mgr.seqs["B"].block_table[0] == first
    assert mgr.pool.blocks[first].ref_cnt == 2
    assert (mgr.prefix_queries, mgr.prefix_hits) == (11, 4)
    mgr.free("A")
    assert mgr.pool.blocks[first].ref_cnt == 1
    mgr.check()


def test_last_prompt_token_is_always_computed():
    mgr = KVCacheManager(8, B)
    prefill(mgr, "A", list(range(8)))
    alloc = prefill(mgr, "B", list(range(8)))  # every block of B is cached, yet one token is computed
    assert alloc.start == 4 and len(alloc.slots) == 4


def test_failed_allocation_changes_nothing():
    mgr = KVCacheManager(3, B)
    prefill(mgr, "A", list(range(6)))
    mgr.add("B", list(range(4)) + [9] * 9)  # hits A's first block, then needs 3 more: only 1 free
    before = mgr.snapshot()
    with pytest.raises(OutOfBlocks) as err:
        mgr.admit("B", 100)
    assert err.value.needed == 3 and err.value.free == 1
    assert mgr.snapshot() == before and mgr.events[-1].request == "A"
    mgr.append_tokens("A", [7] * 7)
    with pytest.raises(OutOfBlocks):
        mgr.allocate("A", 7)
    assert mgr.snapshot() == before
    mgr.check()


def test_free_queue_order_and_lru_eviction():
    mgr = KVCacheManager(6, B)
    prefill(mgr, "A", list(range(10)))  # blocks 0, 1 full (cached), 2 partial
    prefill(mgr, "C", [50] * 5)  # blocks 3 (cached) and 4 (partial)
    assert mgr.snapshot().free_queue == (5,)
    mgr.free("A")  # reverse order: partial 2 to the head, then 1 and 0 to the tail
    assert mgr.snapshot().free_queue == (2, 5, 1, 0)
    mgr.free("C")
    assert mgr.snapshot().free_queue == (4, 2, 5, 1, 0, 3)
    mgr.pop_events()
    prefill(mgr, "D", [70] * 16)  # four fresh blocks: the unhashed ones first, then LRU: 1
    assert mgr.seqs["D"].block_table == [4, 2, 5, 1]
    evicted = [e.block for e in mgr.pop_events() if e.kind == "evict"]
    assert evicted == [1]
    assert sorted(i for copies in mgr.pool.cached.values() for i in copies) == [0, 1, 2, 3, 4, 5]  # 0, 3, D's four
    mgr.check()


def test_blocks_freed_without_a_hash_go_to_the_head_as_one_batch_in_the_order_given():
    """vLLM frees a request's blocks tail first and puts the unhashed ones at the head as one batch, so
    the tail is reused first; pushed to the head one at a time they would come out reversed."""
    mgr = KVCacheManager(5, B, enable_prefix_caching=False)
    prefill(mgr, "A", list(range(10)))  # blocks 0, 1, 2; nothing hashed
    assert mgr.snapshot().free_queue == (3, 4)
    mgr.free("A")  # released 2, 1, 0
    assert mgr.snapshot().free_queue == (2, 1, 0, 3, 4)
    prefill(mgr, "B", [7] * 5)
    assert mgr.seqs["B"].block_table == [2, 1]
    mgr.check()


def test_popping_an_empty_free_queue_is_refused_and_leaves_it_intact():
    q = FreeQueue([])
    with pytest.raises(OutOfBlocks, match="need 1 free KV blocks, only 0 available"):
        q.pop_head()
    assert len(q) == 0 and list(q) == []
    q.append([Block(7)])
    assert q.pop_head().id == 7 and list(q) == []


def test_evicted_block_loses_its_hash_and_stops_hitting():
    mgr = KVCacheManager(2, B)
    prefill(mgr, "A", [1, 2, 3, 4, 5])
    h = mgr.pool.blocks[0].hash
    mgr.free("A")
    prefill(mgr, "B", [8, 8, 8, 8, 8, 8, 8, 8])  # needs both blocks: evicts A's cached block 0
    assert h not in mgr.pool.cached
    mgr.free("B")
    assert prefill(mgr, "A2", [1, 2, 3, 4, 5]).start == 0  # no stale hit
    mgr.check()


def test_two_blocks_computed_at_once_for_one_prefix_are_both_cached_and_outlive_each_other():
    """vLLM keeps every block holding a hash (a request's block table never changes): a hit takes the
    lowest id, and evicting that copy leaves the hash served by the other."""
    mgr = KVCacheManager(5, B)
    mgr.add("A", [1, 2, 3, 4, 5])
    mgr.add("B", [1, 2, 3, 4, 5])
    a, b = mgr.admit("A", 8), mgr.admit("B", 8)  # both miss: neither has committed yet
    mgr.commit("A", len(a.slots))
    mgr.commit("B", len(b.slots))
    assert (mgr.seqs["A"].block_table, mgr.seqs["B"].block_table) == ([0, 1], [2, 3])
    h = mgr.pool.blocks[0].hash
    assert mgr.pool.blocks[2].hash == h and set(mgr.pool.cached[h]) == {0, 2}
    assert [e.block for e in mgr.events if e.kind == "cache"] == [0, 2]
    mgr.free("A")
    mgr.free("B")
    assert mgr.snapshot().free_queue == (3, 1, 4, 0, 2)  # both copies cached: at the tail
    assert mgr.pool.cached_block(h).id == 0
    mgr.pop_events()
    prefill(mgr, "C", [9] * 16)  # four blocks: 3, 1, 4 and the copy in block 0
    assert [(e.block, e.hash) for e in mgr.pop_events() if e.kind == "evict"] == [(0, h)]
    mgr.free("C")
    assert mgr.pool.cached_block(h).id == 2
    assert prefill(mgr, "D", [1, 2, 3, 4, 6]).start == 4 and mgr.seqs["D"].block_table[0] == 2
    mgr.check()


def test_a_reset_of_the_prefix_cache_is_refused_while_a_block_is_held_then_forgets_every_hash():
    mgr = KVCacheManager(6, B)
    prefill(mgr, "A", list(range(9)))  # blocks 0, 1 cached, 2 partial
    prefill(mgr, "C", [50] * 5)  # block 3 cached, 4 partial
    mgr.free("C")
    before, n = mgr.snapshot(), len(mgr.events)
    assert not mgr.reset_prefix_cache()  # A still holds its blocks: nothing changes
    assert mgr.snapshot() == before and len(mgr.events) == n
    mgr.free("A")
    queue, hashes = mgr.snapshot().free_queue, mgr.snapshot().hashes
    mgr.pop_events()
    assert mgr.reset_prefix_cache()
    cleared = mgr.pop_events()
    assert [(e.kind, e.block, e.hash, e.request) for e in cleared] == [("clear", b, hashes[b], None) for b in (0, 1, 3)]
    snap = mgr.snapshot()
    assert snap.hashes == (None,) * 6 and not mgr.pool.cached and snap.free_queue == queue
    assert prefill(mgr, "A2", list(range(9))).start == 0  # computed again
    mgr.check()


def test_a_reset_forgets_the_host_tier_too():
    mgr = KVCacheManager(2, B, host_blocks=2)
    prefill(mgr, "A", [1, 2, 3, 4, 5])
    mgr.free("A")
    prefill(mgr, "B", [8] * 8)  # takes both blocks: A's cached block goes to the host tier
    mgr.free("B")
    mgr.add("A", [1, 2, 3, 4, 5])
    assert mgr.servable("A") == 1  # the host tier would restore it
    mgr.free("A")
    mgr.pop_events()
    assert mgr.reset_prefix_cache()
    assert [(e.kind, e.medium) for e in mgr.pop_events()].count(("clear", "CPU")) == 1
    assert not mgr.host.cached and mgr.host.hashes == [None, None] and len(mgr.host.free) == 2
    assert prefill(mgr, "A2", [1, 2, 3, 4, 5]).start == 0
    mgr.check()


def test_cached_free_block_is_reused_as_a_hit():
    mgr = KVCacheManager(4, B)
    prefill(mgr, "A", [1, 2, 3, 4, 5])
    block = mgr.seqs["A"].block_table[0]
    mgr.free("A")
    assert mgr.snapshot().state(block) == "cached"
    alloc = prefill(mgr, "B", [1, 2, 3, 4, 6])
    assert alloc.start == 4 and mgr.seqs["B"].block_table[0] == block
    assert mgr.snapshot().state(block) == "used"
    mgr.check()


def test_same_salt_hits_and_different_salt_misses():
    mgr = KVCacheManager(16, B)
    prompt = list(range(12))
    prefill(mgr, "A", prompt, salt="tenant-1")
    assert prefill(mgr, "B", prompt, salt="tenant-1").start == 8
    assert prefill(mgr, "C", prompt, salt="tenant-2").start == 0
    assert prefill(mgr, "D", prompt).start == 0
    # the salt enters block 0 only, yet block 1's hash differs through the chain
    a, c = mgr.seqs["A"], mgr.seqs["C"]
    assert mgr.block_hash(a, 1) != mgr.block_hash(c, 1)
    mgr.check()


def test_copy_on_write_copies_exactly_once():
    mgr = KVCacheManager(8, B)
    prefill(mgr, "P", [1, 2, 3, 4, 5, 6])
    child = mgr.fork("P", "C")
    assert child.block_table == mgr.seqs["P"].block_table
    shared_tail = child.block_table[1]
    assert mgr.pool.blocks[shared_tail].ref_cnt == 2
    mgr.pop_events()
    mgr.append_tokens("C", [7])
    alloc = mgr.allocate("C", 1)
    mgr.commit("C", 1)
    assert len(alloc.copies) == 1 and alloc.copies[0][0] == shared_tail
    assert mgr.seqs["P"].block_table[1] == shared_tail != mgr.seqs["C"].block_table[1]
    assert [e.kind for e in mgr.pop_events()].count("cow") == 1
    mgr.append_tokens("P", [8])
    assert mgr.allocate("P", 1).copies == []  # the parent's block is private again
    mgr.commit("P", 1)
    assert mgr.foreign_slots("C") == [] and mgr.foreign_slots("P") == []
    # the copy carries the provenance of the parent's slots
    copied = mgr.slot(mgr.seqs["C"], 4)
    assert mgr.provenance.facts(copied).writer == "P"
    mgr.check()


def test_fork_shares_every_block_and_full_blocks_need_no_copy():
    mgr = KVCacheManager(8, B)
    prefill(mgr, "P", list(range(8)))
    mgr.fork("P", "C")
    mgr.append_tokens("C", [9])
    assert mgr.allocate("C", 1).copies == []  # position 8 starts a new block
    mgr.commit("C", 1)
    assert [mgr.pool.blocks[b].ref_cnt for b in mgr.seqs["P"].block_table] == [2, 2]
    mgr.free("P")
    mgr.free("C")
    assert mgr.pool.num_free == 8
    mgr.check()


def test_preempt_keeps_tokens_and_recomputes_through_the_cache():
    mgr = KVCacheManager(8, B)
    prefill(mgr, "A", list(range(10)))
    mgr.preempt("A")
    assert mgr.seqs["A"].block_table == [] and mgr.seqs["A"].num_computed == 0
    assert any(e.kind == "preempt" for e in mgr.events)
    alloc = mgr.admit("A", 100)
    assert alloc.start == 8  # its own cached blocks come back as hits
    mgr.commit("A", len(alloc.slots))
    assert mgr.foreign_slots("A") == []
    mgr.check()


def test_provenance_records_writer_position_prefix_and_lifetime():
    mgr = KVCacheManager(4, B)
    prefill(mgr, "A", [5, 6, 7], salt="t")
    f = mgr.provenance.facts(mgr.slot(mgr.seqs["A"], 2))
    assert (f.writer, f.tenant, f.pos, f.lifetime) == ("A", "t", 2, 1)
    assert f.prefix_id == prefix_ids([5, 6, 7])[2]
    assert prefix_ids([5, 6, 7])[:2] == prefix_ids([5, 6, 9])[:2] != prefix_ids([6, 6])[:2]


def test_foreign_slots_detects_a_page_table_pointing_at_another_request():
    """Positive case: the isolation check fires when a table is corrupted (block 0 for everyone)."""
    mgr = KVCacheManager(4, B)
    prefill(mgr, "A", [1, 2, 3])
    prefill(mgr, "B", [7, 8, 9])
    mgr.seqs["B"].block_table[0] = mgr.seqs["A"].block_table[0]
    assert mgr.foreign_slots("B") == [0, 1, 2]


def test_foreign_slots_detects_a_stale_block_after_use_after_free():
    mgr = KVCacheManager(1, B)
    prefill(mgr, "A", [1, 2, 3])
    table = list(mgr.seqs["A"].block_table)
    mgr.free("A")
    prefill(mgr, "B", [4])  # reuses the freed block: new lifetime, only slot 0 written
    mgr.add("ghost", [1, 2, 3])
    mgr.seqs["ghost"].block_table, mgr.seqs["ghost"].num_computed = table, 3
    assert mgr.foreign_slots("ghost") == [0, 1, 2]


def test_check_reports_broken_refcounts_and_hash_map():
    mgr = KVCacheManager(4, B)
    prefill(mgr, "A", [1, 2, 3, 4, 5])
    mgr.pool.blocks[1].ref_cnt += 1
    with pytest.raises(InvariantError, match="refcount 2 but 1 page-table references"):
        mgr.check()
    mgr.pool.blocks[1].ref_cnt -= 1
    mgr.pool.cached[b"bogus"] = {0: mgr.pool.blocks[0]}
    with pytest.raises(InvariantError, match="holds another hash"):
        mgr.check()


def test_events_and_snapshot_states():
    mgr = KVCacheManager(4, B)
    prefill(mgr, "A", [1, 2, 3, 4, 5])
    kinds = [e.kind for e in mgr.pop_events()]
    assert kinds == ["allocate", "allocate", "cache"]
    snap = mgr.snapshot()
    assert [snap.state(b) for b in range(4)] == ["used", "used", "free", "free"]
    mgr.free("A")
    assert [(e.kind, e.block, e.refcount) for e in mgr.pop_events()] == [("free", 1, 0), ("free", 0, 0)]
    assert [mgr.snapshot().state(b) for b in range(4)] == ["cached", "free", "free", "free"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        KVCacheManager(0, 4)
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)
    mgr = KVCacheManager(4, B)
    mgr.add("A", [1])
    with pytest.raises(ValueError, match="already"):
        mgr.add("A", [1])
    with pytest.raises(ValueError, match="no tokens"):
        mgr.add("E", [])
    with pytest.raises(ValueError, match="known tokens"):
        mgr.admit("A", 1) and mgr.allocate("A", 5)
