"""Cross-tenant reads in words: the sentence from reads, and the same reads whether taken from the
oracle as a run goes or from the store afterwards."""

from __future__ import annotations

import functools

import pytest

from kvviz.analysis import cross_reads
from kvviz.analysis.cross_reads import BlockRead
from kvviz.models import load_model
from kvviz.runners import live
from kvviz.store import RunStore


@functools.cache
def tiny():
    return load_model("tiny-llama")


def test_the_sentence_counts_blocks_per_pair_of_tenants_and_names_blocks_and_steps():
    reads = [BlockRead("B", "t-b", "A", "t-a", b, 2, 5) for b in (0, 1, 2, 7)]
    reads += [BlockRead("C", "t-c", "A", "t-a", 1, 9, 9), BlockRead("C", "t-c", "D", "t-a", 4, 11, 12)]
    assert cross_reads.sentence(reads) == (
        "cross-tenant reads: 4 blocks of tenant t-a read by tenant t-b (B read blocks 0-2, 7, written by A, at steps "
        "2-5); 2 blocks of tenant t-a read by tenant t-c (C read blocks 1, 4, written by A, D, at steps 9, 11-12)")
    assert cross_reads.sentence([BlockRead("B", "(no salt)", None, "t-a", 3, 4, 4)]) == \
        "cross-tenant reads: 1 block of tenant t-a read by tenant (no salt) (B read block 3 at step 4)"
    assert cross_reads.sentence([]) is None


def test_a_tenant_named_tenant_something_is_not_said_twice():
    reads = [BlockRead("B", "tenant-b", "A", "tenant-a", 0, 2, 2), BlockRead("C", "Tenant C", "A", "tenant-a", 1, 3, 3)]
    assert cross_reads.sentence(reads) == (
        "cross-tenant reads: 1 block of tenant-a read by Tenant C (C read block 1, written by A, at step 3); "
        "1 block of tenant-a read by tenant-b (B read block 0, written by A, at step 2)")
    assert [cross_reads.tenant(t) for t in ("acme", "tenant-a", "(no salt)")] == \
        ["tenant acme", "tenant-a", "tenant (no salt)"]


@pytest.mark.parametrize("intervals, said", [([(0, 0), (1, 2), (5, 5)], "0-2, 5"), ([(3, 9), (4, 5)], "3-9"),
                                             ([(7, 7)], "7"), ([(9, 12), (1, 1), (13, 13)], "1, 9-13")])
def test_spans_merge_what_touches_or_overlaps(intervals, said):
    assert cross_reads.spans(intervals) == said


def test_the_live_reads_and_the_stored_reads_are_the_same(tmp_path):
    """The Run page's sentence (from the oracle, step by step) is the one the inspector reads back."""
    m = tiny()
    said: list[str | None] = []
    db = tmp_path / "k.duckdb"
    out = live.run(RunStore.open(db), m, live.scenario_workload("unsalted_prefix", m), "unsalted_prefix",
                   on_step=lambda s: said.append(s.cross_tenant))
    with RunStore.open(db).read() as con:
        stored = cross_reads.from_store(con, out.run_id)
        blocks = {b for (b,) in con.execute("SELECT block FROM block_events WHERE run_id = ? AND kind = 'hit' AND "
                                            "request_id = 'B'", [out.run_id]).fetchall()}
        b_first, b_last = con.execute("SELECT min(step), max(step) FROM step_work WHERE run_id = ? AND "
                                      "request_id = 'B'", [out.run_id]).fetchone()
    assert {r.block for r in stored} == blocks and len(stored) == len(blocks) == out.findings
    assert {(r.reader, r.reader_tenant, r.writer, r.writer_tenant, r.first, r.last) for r in stored} == \
        {("B", "tenant-b", "A", "tenant-a", b_first, b_last)}
    assert said[0] is None and said[-1] == cross_reads.sentence(stored)  # nothing before B's first step
    assert said[-1].startswith(f"cross-tenant reads: {len(blocks)} blocks of tenant-a read by tenant-b")
    control = live.run(RunStore.open(db), m, live.scenario_workload("unsalted_prefix", m), None)
    with RunStore.open(db).write() as con:
        assert cross_reads.from_store(con, control.run_id) == []
        con.execute("DELETE FROM requests WHERE run_id = ? AND request_id = 'A'", [out.run_id])  # as a served run
        assert {r.writer_tenant for r in cross_reads.from_store(con, out.run_id)} == {cross_reads.UNKNOWN}  # has it
