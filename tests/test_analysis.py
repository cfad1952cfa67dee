"""The analysis layer the UI reads runs through, checked on real runs of the tiny random model: slot
contents replayed from the write log agree with the page tables, the block map and page tables agree
with each other, attention views classify keys by their writer, findings jump to a focus, deleting a
run clears every table, uploads import or are refused whole, and a live run reports every step.

Every leak a test sees has a clean control beside it (the same workload without the fault, or a
scenario with the correct defences) that must stay exactly clean."""

from __future__ import annotations

import functools
import hashlib
import warnings
import zipfile
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pytest

from kvviz.analysis import attention, blocks, captures, leaks, runs, tokens
from kvviz.analysis.runs import delete_run
from kvviz.catalogue.scenarios import scenario
from kvviz.engine.workload import WorkloadError
from kvviz.errors import KvvizError
from kvviz.figures.captures import prefix_tree as tree_figure
from kvviz.models import load_model
from kvviz.runners import live, uploads
from kvviz.store import RunStore, StoreError
from kvviz.store.attention import AttentionSelection
from kvviz.store.trace import export_run

from .test_capture import batch, stored_map, write_capture

# head mean everywhere, every head of layer 1 only: layer 0's heads are not recorded
SELECTION = AttentionSelection(full_layers=frozenset({1}))


@functools.cache
def tiny():
    return load_model("tiny-llama")


def record(db, name: str, fault: str | None = "scenario", **kw) -> str:
    m = tiny()
    fault = scenario(name).fault if fault == "scenario" else fault
    return live.run(RunStore.open(db), m, live.scenario_workload(name, m), fault, scenario_name=name,
                    selection=SELECTION,
                    **kw).run_id


def capture_file(tmp_path):
    """Two tenants storing the same first block (a cross-tenant finding), a branch and an eviction."""
    big = (1 << 63) + 12345  # unsigned 64-bit hashes above 2^63 occur
    return write_capture(tmp_path / "c.jsonl", [
        batch(stored_map([big, big + 1], None, [1, 2, 3, 4], salt="tenant-a")),
        batch(stored_map([big + 2], big + 1, [5, 6])),
        batch(stored_map([big + 3], big + 1, [7, 8])),
        batch(stored_map([big], None, [1, 2], salt="tenant-b")),
        batch({"type": "BlockRemoved", "block_hashes": [big + 2], "medium": "GPU"}),
    ]), big


@dataclass
class Recorded:
    db: object
    ids: dict[str, str]
    live_steps: list = field(default_factory=list)
    capture: str = ""
    big: int = 0


@pytest.fixture(scope="module")
def rec(tmp_path_factory) -> Recorded:
    tmp = tmp_path_factory.mktemp("analysis")
    db = tmp / "kvviz.duckdb"
    steps: list[live.LiveStep] = []
    ids = {
        "boundary": record(db, "boundary"),
        "boundary_control": record(db, "boundary", None),  # the same workload, correct mask
        "control_forks": record(db, "control_forks", on_step=steps.append),
        "missing_cow": record(db, "missing_cow"),
        "stale_hash": record(db, "stale_hash"),
        "control_shared_system_prompt": record(db, "control_shared_system_prompt"),
        "offload_wrong_block": record(db, "offload_wrong_block"),
        "offload_control": record(db, "offload_wrong_block", None),  # restores from the right host block
        "transfer_wrong_request": record(db, "transfer_wrong_request"),
        "transfer_control": record(db, "transfer_wrong_request", None),
    }
    cap, big = capture_file(tmp)
    capture = uploads.import_file(cap, RunStore.open(db))
    return Recorded(db, ids, steps, capture, big)


def info(con, run_id):
    return runs.run_info(con, run_id)


# -- runs ---------------------------------------------------------------------------------------------

def test_list_runs_and_run_info(rec):
    with RunStore.open(rec.db).read() as con:
        listed = runs.list_runs(con)
        assert set(listed.run_id) == set(rec.ids.values()) | {rec.capture}
        assert listed.created_at.is_monotonic_decreasing  # newest first
        assert listed.set_index("run_id").loc[rec.ids["boundary"], "findings"] > 0
        assert listed.set_index("run_id").loc[rec.ids["boundary_control"], "findings"] == 0
        assert listed.set_index("run_id").engine.to_dict() == {**dict.fromkeys(rec.ids.values(), "kvviz"),
                                                               rec.capture: None}
        b = info(con, rec.ids["boundary"])
        assert (b.status, b.scenario, b.fault, b.isolation, b.block_size) == ("complete", "boundary", "boundary",
                                                                              "masked", 4)
        assert b.requests == ["A", "B"] and b.steps == list(range(len(b.steps))) and len(b.steps) > 2
        assert b.has_blocks and b.has_attention and not b.has_kv_events
        c = info(con, rec.capture)
        assert c.has_kv_events and not c.has_blocks and not c.has_attention and c.model == "vllm capture"
        with pytest.raises(StoreError, match="no run"):
            runs.run_info(con, "nope")


@pytest.mark.parametrize("name", ["untagged_namespace", "stale_hash_after_truncate"])
def test_requests_frame_names_the_adapter_and_truncation_the_workload_gave(rec, tmp_path, name):
    """The namespace and session faults turn on them; a run without them has no such columns."""
    rid = record(tmp_path / "k.duckdb", name)
    with RunStore.open(tmp_path / "k.duckdb").read() as con:
        df = runs.requests_frame(con, rid).set_index("request_id")
    given = [r for r in live.scenario_workload(name, tiny())["requests"] if r.get("adapter") or r.get("truncate")]
    assert given
    for r in given:
        column = "adapter" if r.get("adapter") else "truncate"
        assert df.loc[r["id"], column] == r[column]
    with RunStore.open(rec.db).read() as con:
        plain = runs.requests_frame(con, rec.ids["control_forks"])
    assert not {"adapter", "truncate"} & set(plain.columns)
    prompts = {r["id"]: r.get("prompt") for r in scenario("control_forks").workload["requests"]}
    assert list(plain.columns[-2:]) == ["text", "prompt"], "each request's prompt beside what it wrote"
    assert dict(zip(plain.request_id, plain.prompt, strict=True)) == prompts


def test_the_sql_examples_about_one_run_take_the_newest_engine_run_not_a_capture(rec):
    from kvviz.store import run_query
    from kvviz.ui.sql_page import EXAMPLES

    with RunStore.open(rec.db).read() as con:
        newest = con.execute("SELECT run_id FROM runs ORDER BY created_at DESC LIMIT 1").fetchone()[0]
        assert newest == rec.capture  # imported last
        for name in ("Leak rate over time", "Positional entropy by position"):
            assert run_query(con, EXAMPLES[name]).rows, name


def test_keys_read_at_earlier_steps_are_labelled_by_what_was_read_not_by_a_later_holder(tmp_path):
    """Disaggregated, clean: B's prefill reuses the prefill blocks A's prompt was computed in. Over
    every step so far, A's keys are still labelled as A's, though those slots hold B's now."""
    wl = {"requests": [{"id": "A", "prompt": "The first prompt, computed on the prefill side", "max_new_tokens": 6},
                       {"id": "B", "prompt": "Another prompt that lands in the freed blocks", "max_new_tokens": 2,
                        "arrival_step": 3}],
          "engine": {"block_size": 4, "num_blocks": 16, "disaggregated": True}}
    db = tmp_path / "k.duckdb"
    rid = live.run(RunStore.open(db), tiny(), wl, selection=SELECTION).run_id
    with RunStore.open(db).read() as con:
        last = runs.run_info(con, rid).steps[-1]
        held = tokens.slot_contents(con, rid, last, 4).set_index("slot").request_id
        view = attention.attention_view(con, rid, "A", last, 1, attention.HEAD_MEAN, 4, upto=True)
    assert any(held.get(s) == "B" for s in view.key_slots), "B took over slots A read"
    assert set(view.key_owners) == {"A"}
    assert all(label.startswith("A:") for label in view.key_labels)


def test_requests_frame_counts_match_the_sequences(rec):
    with RunStore.open(rec.db).read() as con:
        rid = rec.ids["control_forks"]
        df = runs.requests_frame(con, rid).set_index("request_id")
        seqs = tokens.request_tokens(con, rid)
        assert list(df.index) == ["F", "G", "P"]
        assert pd.isna(df.loc["P"].parent) and df.loc["F"].parent == "P" and df.loc["G"].parent == "P"
        for r, seq in seqs.items():
            assert df.loc[r].prompt_tokens + df.loc[r].output_tokens == len(seq)
        # a fork starts with its parent's sequence
        assert seqs["F"][:18] == seqs["P"][:18] and seqs["G"][:20] == seqs["P"][:20]


def test_token_labels():
    texts = {1: "a\nb", 2: "x", 3: " ", 4: "  ", 5: "", 6: " a"}
    assert tokens.label(texts, 1) == "a\\nb" and tokens.label(texts, 2) == "x"
    assert [tokens.label(texts, t) for t in (3, 4, 5, 6)] == ["␣", "␣␣", "∅", " a"], "whitespace alone shows"
    assert tokens.label(texts, 99) == "#99" and tokens.label(texts, None) == "?"


def test_token_texts_cover_every_token_of_the_run(rec):
    with RunStore.open(rec.db).read() as con:
        rid = rec.ids["boundary"]
        texts = tokens.token_texts(con, rid)
        used = {t for seq in tokens.request_tokens(con, rid).values() for t in seq}
        assert used <= set(texts)


# -- slot contents --------------------------------------------------------------------------------------

def computed(con, run_id, step) -> dict[str, int]:
    """How many positions each request had computed by the end of `step` (from step_work)."""
    return dict(con.execute("SELECT request_id, max(start + tokens) FROM step_work WHERE run_id = ? AND step <= ? "
                            "GROUP BY request_id", [run_id, step]).fetchall())


def page_table_mismatches(con, run_id) -> tuple[int, list]:
    """At every step, every computed position of every request with a page table: does the slot its
    page table points to hold that position and that request's token there?"""
    i = info(con, run_id)
    B, seqs = i.block_size, tokens.request_tokens(con, run_id)
    checked, bad = 0, []
    for s in i.steps:
        done = computed(con, run_id, s)
        contents = tokens.slot_contents(con, run_id, s, B).set_index("slot")
        for r, logical, physical in con.execute("SELECT request_id, logical_block, physical_block FROM page_tables "
                                                "WHERE run_id = ? AND step = ?", [run_id, s]).fetchall():
            for k in range(B):
                pos, slot = logical * B + k, physical * B + k
                if pos >= done.get(r, 0):
                    continue
                checked += 1
                c = contents.loc[slot] if slot in contents.index else None
                if c is None or c.position != pos or c.token != seqs[r][pos]:
                    bad.append((s, r, pos, slot))
    return checked, bad


@pytest.mark.parametrize("name", ["control_forks", "boundary_control", "boundary", "control_shared_system_prompt",
                                  "offload_control", "transfer_control"])
def test_slots_behind_every_page_table_hold_the_requests_own_tokens(rec, name):
    """Restores from the host tier and transfers from a prefill instance write no slot: their slots
    hold the right tokens only if the replay copies them."""
    with RunStore.open(rec.db).read() as con:
        checked, bad = page_table_mismatches(con, rec.ids[name])
        copied = dict(con.execute("SELECT kind, count(*) FROM block_events WHERE run_id = ? AND kind IN "
                                  "('restore', 'transfer') GROUP BY kind", [rec.ids[name]]).fetchall())
    assert checked > 100 and bad == []
    assert copied.get({"offload_control": "restore", "transfer_control": "transfer"}.get(name), 1) > 0


@pytest.mark.parametrize("name", ["stale_hash", "missing_cow", "offload_wrong_block", "transfer_wrong_request"])
def test_a_broken_page_table_shows_in_the_slot_contents(rec, name):
    """The same check fails where the fault puts someone else's keys behind a request's page table."""
    with RunStore.open(rec.db).read() as con:
        _, bad = page_table_mismatches(con, rec.ids[name])
    assert bad


def test_a_copy_on_write_copy_carries_the_parents_prefix(rec):
    rid = rec.ids["control_forks"]
    with RunStore.open(rec.db).read() as con:
        B = info(con, rid).block_size
        seqs = tokens.request_tokens(con, rid)
        cows = con.execute("SELECT step, block, source, request_id FROM block_events WHERE run_id = ? AND kind = 'cow' "
                           "ORDER BY step, seq", [rid]).fetchall()
        assert len(cows) == 2  # P copies its shared partial block when F forks, and again when G forks
        for step, copy, src, req in cows:
            before = tokens.slot_contents(con, rid, step - 1, B).set_index("slot")
            after = tokens.slot_contents(con, rid, step, B).set_index("slot")
            fork_point = computed(con, rid, step - 1)[req]
            for pos in range(fork_point):
                c, s = after.loc[copy * B + pos], before.loc[src * B + pos]
                assert (c.position, c.token) == (pos, seqs[req][pos]) == (s.position, s.token)
                assert c.request_id == s.request_id
            # the copy's prefix was never written there: it can only have come from replaying the cow event
            direct = con.execute("SELECT count(*) FROM slot_writes WHERE run_id = ? AND block = ? AND position < ?",
                                 [rid, copy, fork_point]).fetchone()[0]
            assert direct == 0


# -- blocks -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["control_forks", "boundary", "control_shared_system_prompt", "stale_hash"])
def test_block_map_agrees_with_page_tables(rec, name):
    rid = rec.ids[name]
    with RunStore.open(rec.db).read() as con:
        i = info(con, rid)
        num_blocks = i.engine["num_blocks"]
        for s in i.steps:
            bm = blocks.block_map(con, rid, s).set_index("block")
            pt = blocks.page_tables(con, rid, s)
            assert list(bm.index) == list(range(num_blocks))
            holders = pt.groupby("physical_block").request_id.agg(lambda x: ",".join(sorted(set(x))))
            assert bm.owners.to_dict() == {b: holders.get(b, "") for b in bm.index}
            count = pt.groupby("physical_block").size()
            assert bm.refcount.to_dict() == {b: int(count.get(b, 0)) for b in bm.index}
            assert (bm.loc[bm.refcount > 0, "state"] == "used").all()
            assert (pt.refcount.to_numpy() == bm.refcount.loc[pt.physical_block].to_numpy()).all()
            assert (pt.shared == (pt.refcount > 1)).all()


def test_shared_blocks_appear_with_prefix_caching_and_not_without_sharing(rec):
    with RunStore.open(rec.db).read() as con:
        def shared(name):
            rid = rec.ids[name]
            return sum(int(blocks.page_tables(con, rid, s).shared.sum()) for s in info(con, rid).steps)
        assert shared("control_shared_system_prompt") > 0 and shared("boundary_control") > 0
        assert shared("control_forks") == 0  # each fork's shared partial block is copied within the step


def test_page_tables_mark_exactly_the_copy_on_write_copies(rec):
    with RunStore.open(rec.db).read() as con:
        rid = rec.ids["control_forks"]
        cows = con.execute("SELECT step, request_id, block FROM block_events WHERE run_id = ? AND kind = 'cow'",
                           [rid]).fetchall()
        marked = set()
        for s in info(con, rid).steps:
            pt = blocks.page_tables(con, rid, s)
            for r in pt.itertuples():
                made = any(cs <= s and cr == r.request_id and cb == r.physical_block for cs, cr, cb in cows)
                assert r.cow == made, (s, r)
                if r.cow:
                    marked.add((r.request_id, r.physical_block))
        assert marked == {(r, b) for _, r, b in cows} and len(marked) == 2
        for step, r, b in cows:  # marked from the step of the copy on
            pt = blocks.page_tables(con, rid, step).set_index(["request_id", "physical_block"])
            assert pt.loc[(r, b), "cow"]
        for name in ("boundary", "control_shared_system_prompt"):  # no forks, no copies
            rid = rec.ids[name]
            assert not any(blocks.page_tables(con, rid, s).cow.any() for s in info(con, rid).steps)


def test_leaky_blocks_at_findings_and_never_in_the_control(rec):
    with RunStore.open(rec.db).read() as con:
        rid, ctl = rec.ids["boundary"], rec.ids["boundary_control"]
        B = info(con, rid).block_size
        f = leaks.findings(con, rid)
        assert len(f)
        for row in f.itertuples():
            leaky = blocks.leaky_blocks(con, rid, int(row.step), B)
            assert leaky
            # the leaked keys sit in blocks holding the source request's keys (it may have finished this step)
            slots = tokens.slot_contents(con, rid, int(row.step), B)
            assert leaky & set(slots[slots.request_id == row.source_request].slot // B)
        for s in info(con, ctl).steps:
            assert blocks.leaky_blocks(con, ctl, s, B) == set()
        rid = rec.ids["control_forks"]
        assert all(blocks.leaky_blocks(con, rid, s, 64) == set() for s in info(con, rid).steps)


def test_occupancy_codes_agree_with_the_block_map(rec):
    with RunStore.open(rec.db).read() as con:
        rid = rec.ids["boundary"]
        i = info(con, rid)
        grid, steps, per = blocks.occupancy(con, rid)
        touched = max(int(b) for s in steps for b, state in blocks.block_map(con, rid, s)[["block", "state"]]
                      .itertuples(index=False) if state != "free")
        assert steps == i.steps and grid.shape == (touched + 1, len(steps)) and per == 1  # unused tail cut
        for col, s in enumerate(steps):
            bm = blocks.block_map(con, rid, s)
            want = np.select([(bm.state == "used") & (bm.refcount > 1), bm.state == "used", bm.state == "cached"],
                             [3, 2, 1], 0)
            assert (grid[:, col] == want[:len(grid)]).all() and not want[len(grid):].any()
        assert (grid == 3).any() and (grid == 2).any() and (grid == 1).any()
        sampled, few, _ = blocks.occupancy(con, rid, max_steps=3)
        assert few == [steps[0], steps[len(steps) // 2], steps[-1]] or (len(few) == 3 and few[0] == steps[0]
                                                                        and few[-1] == steps[-1])
        cols = grid[:, [steps.index(s) for s in few]]
        assert (sampled == cols[:len(sampled)]).all() and not cols[len(sampled):].any()
        merged, _, per = blocks.occupancy(con, rid, max_blocks=4)
        assert per == -(-len(grid) // 4) and len(merged) <= 4
        assert (merged[0] == grid[:per].max(axis=0)).all(), "a group shows its busiest block"
        empty, none, _ = blocks.occupancy(con, rec.capture)
        assert empty.shape == (0, 0) and none == []


def test_block_story_of_a_prefix_shared_block(rec):
    with RunStore.open(rec.db).read() as con:
        rid = rec.ids["boundary_control"]
        i = info(con, rid)
        for s in i.steps:
            bm = blocks.block_map(con, rid, s)
            if (bm.refcount > 1).any():
                break
        block = int(bm[bm.refcount > 1].block.iloc[0])
        story = blocks.block_story(con, rid, s, block, i.block_size)
        assert story.state == "used" and story.refcount == 2 and story.hash is not None
        assert sorted(story.references.request_id) == ["A", "B"]
        for req, logical in story.references.itertuples(index=False):
            assert len(story.chains[req]) == logical + 1 and story.chains[req][-1] == story.hash
        assert story.chains["A"] == story.chains["B"]  # the same prefix, hash for hash
        assert len(story.slots) == i.block_size and story.slots.text.str.len().min() > 0
        assert {"allocate", "hit"} <= set(story.events.kind) and (story.events.step <= s).all()
        with pytest.raises(KeyError):
            blocks.block_story(con, rid, s, 10_000, i.block_size)


# -- attention --------------------------------------------------------------------------------------------

def expected_classes(view, request, seqs) -> np.ndarray:
    """Own where the key's writer holds the same prefix through the key's position and the key is not
    in the query's future; foreign otherwise (the boundary runs have no stale keys)."""
    qpos = [int(lab.split()[0]) for lab in view.query_labels]
    kpos = [int(lab.split(":")[1].split()[0]) for lab in view.key_labels]
    out = np.full(view.classes.shape, attention.UNSEEN, np.int8)
    for j, (owner, p) in enumerate(zip(view.key_owners, kpos, strict=True)):
        same = seqs[owner][:p + 1] == seqs[request][:p + 1]
        for i, q in enumerate(qpos):
            out[i, j] = attention.OWN if same and p <= q else attention.FOREIGN
    return np.where(view.classes == attention.UNSEEN, attention.UNSEEN, out)


def views(con, run_id, layer_heads=((0, -1), (1, -1), (1, 2))):
    i = info(con, run_id)
    for r in i.requests:
        for s in i.steps:
            for layer, head in layer_heads:
                v = attention.attention_view(con, run_id, r, s, layer, head, i.block_size)
                if v is not None:
                    yield r, s, layer, head, v


def test_attention_rows_sum_to_one_and_classes_follow_the_writer(rec):
    with RunStore.open(rec.db).read() as con:
        foreign = {}
        for name in ("boundary", "boundary_control"):
            rid = rec.ids[name]
            seqs = tokens.request_tokens(con, rid)
            n = foreign[name] = 0
            for r, s, layer, head, v in views(con, rid):
                n += 1
                assert v.head == head and not v.binned
                assert np.allclose(np.nansum(v.weights, axis=1), 1, atol=1e-4)
                assert (np.isnan(v.weights) == (v.classes == attention.UNSEEN)).all()
                assert set(np.unique(v.classes)) <= {attention.UNSEEN, attention.OWN, attention.FOREIGN}
                assert (v.classes == expected_classes(v, r, seqs)).all(), (name, r, s, layer, head)
                assert all(o != r for o, c in zip(v.key_owners, (v.classes == attention.FOREIGN).any(0), strict=True)
                           if c)
                foreign[name] += int((v.classes == attention.FOREIGN).sum())
            assert n > 20
        assert foreign["boundary"] > 0 and foreign["boundary_control"] == 0


def test_attention_view_at_a_finding_shows_the_sources_keys(rec):
    with RunStore.open(rec.db).read() as con:
        rid = rec.ids["boundary"]
        B = info(con, rid).block_size
        top = leaks.findings(con, rid).iloc[0]
        v = attention.attention_view(con, rid, top.request_id, int(top.step), int(top.layer), attention.HEAD_MEAN, B)
        cols = (v.classes == attention.FOREIGN).any(0)
        assert {o for o, c in zip(v.key_owners, cols, strict=True) if c} == {top.source_request}
        assert v.foreign_mass.max() > 0
        assert v.key_slots == sorted(v.key_slots)
        rows = attention.attention_view(con, rid, top.request_id, int(top.step), int(top.layer), -1, B, upto=True)
        assert rows.weights.shape[0] > v.weights.shape[0]  # every step up to it: the prefill rows too
        assert attention.attention_view(con, rid, "nobody", int(top.step), 0, -1, B) is None


def test_a_head_that_was_not_recorded_falls_back_to_the_head_mean(rec):
    with RunStore.open(rec.db).read() as con:
        rid = rec.ids["boundary_control"]  # clean: only the chosen layer keeps every head
        B = info(con, rid).block_size
        assert attention.recorded_heads(con, rid, 0) == [-1]
        assert attention.recorded_heads(con, rid, 1) == [-1, 0, 1, 2, 3]
        fallback = attention.attention_view(con, rid, "A", 1, 0, 2, B)
        mean = attention.attention_view(con, rid, "A", 1, 0, -1, B)
        assert fallback.head == -1
        np.testing.assert_array_equal(fallback.weights, mean.weights)
        recorded = attention.attention_view(con, rid, "A", 1, 1, 2, B)
        assert recorded.head == 2
        assert not np.allclose(np.nan_to_num(recorded.weights),
                               np.nan_to_num(attention.attention_view(con, rid, "A", 1, 1, -1, B).weights))
        leaky = rec.ids["boundary"]  # where the oracle saw a leak, every head of that layer was kept
        assert attention.recorded_heads(con, leaky, 0) == [-1, 0, 1, 2, 3]


def synthetic_view(Q=37, K=83, leak=(23, 61), weight=0.9) -> attention.AttentionView:
    rng = np.random.default_rng(0)
    w = rng.uniform(0, 0.01, (Q, K)).astype(np.float32)
    w[np.triu_indices(Q, 1, K)] = np.nan  # a future region, unseen
    c = np.where(np.isnan(w), attention.UNSEEN, attention.OWN).astype(np.int8)
    w[leak], c[leak] = weight, attention.FOREIGN
    return attention.AttentionView(w, c, [f"{i} q" for i in range(Q)], [f"X:{j} k" for j in range(K)],
                                   ["X"] * K, list(range(K)), -1, False, [(0, i) for i in range(Q)])


@pytest.mark.parametrize("limits", [(10, 20), (5, 7), (36, 82), (1, 1)])
def test_downsample_keeps_a_single_leaking_cell(limits):
    v = synthetic_view()
    d = attention.downsample(v, *limits)
    assert d.binned
    assert d.weights.shape[0] <= limits[0] and d.weights.shape[1] <= limits[1]
    assert d.weights.shape == d.classes.shape == (len(d.query_labels), len(d.key_labels))
    assert len(d.key_owners) == len(d.key_slots) == d.weights.shape[1]
    assert np.nanmax(d.weights) == pytest.approx(0.9)
    r, c = np.unravel_index(np.nanargmax(d.weights), d.weights.shape)
    assert d.classes[r, c] == attention.FOREIGN and (d.classes == attention.FOREIGN).sum() == 1
    rb, cb = -(-v.weights.shape[0] // limits[0]), -(-v.weights.shape[1] // limits[1])
    assert (r, c) == (23 // rb, 61 // cb)


def test_downsample_is_the_identity_within_limits_and_bins_by_max():
    v = synthetic_view(4, 6, leak=(3, 1))
    assert attention.downsample(v, 4, 6) is v
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    a[0, 0] = np.nan
    np.testing.assert_array_equal(attention._bin_max(a, 2, 2), [[5, 7], [9, 11]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a bin of unseen cells stays NaN, without a RuntimeWarning per view
        assert np.isnan(attention._bin_max(np.full((2, 4), np.nan, np.float32), 2, 2)).all()
        assert attention.downsample(synthetic_view(), 5, 7).binned


def test_downsample_shows_a_leak_over_another_tenants_keys_and_those_over_own():
    X, C, W, F = attention.UNSEEN, attention.CROSS, attention.OWN, attention.FOREIGN  # W: own
    c = np.array([[W, W, C, W, X, X], [W, W, W, C, X, X], [C, W, W, W, W, X], [W, F, W, W, W, W]], np.int8)
    w = np.where(c == X, np.nan, 0.01).astype(np.float32)
    w[3, 1] = 0.9
    v = attention.AttentionView(w, c, [f"{i} q" for i in range(4)], [f"X:{j} k" for j in range(6)], ["X"] * 6,
                                list(range(6)), -1, False, [(0, i) for i in range(4)])
    d = attention.downsample(v, 2, 3)
    assert d.classes.tolist() == [[W, C, X], [F, W, W]]  # foreign over another tenant's, those over own
    assert d.foreign_mass.tolist() == pytest.approx([0.0, 0.9])
    assert v.foreign_mass[0] == 0  # another tenant's weight is no foreign mass


def test_a_real_view_downsampled_keeps_its_leak(rec):
    with RunStore.open(rec.db).read() as con:
        rid = rec.ids["boundary"]
        top = leaks.findings(con, rid).iloc[0]
        B = info(con, rid).block_size
        full = attention.attention_view(con, rid, top.request_id, int(top.step), int(top.layer), -1, B, upto=True)
        small = attention.attention_view(con, rid, top.request_id, int(top.step), int(top.layer), -1, B, upto=True,
                                         max_rows=4, max_cols=6)
        assert small.binned and small.weights.shape[0] <= 4 and small.weights.shape[1] <= 6
        assert (small.classes == attention.FOREIGN).any()
        biggest = np.nanmax(np.where(full.classes == attention.FOREIGN, full.weights, np.nan))
        assert np.nanmax(np.where(small.classes == attention.FOREIGN, small.weights, np.nan)) >= biggest


def test_leak_grid_and_grid_shape(rec):
    with RunStore.open(rec.db).read() as con:
        rid, ctl = rec.ids["boundary"], rec.ids["boundary_control"]
        layers, heads = tiny().config.num_hidden_layers, tiny().config.num_attention_heads
        assert attention.grid_shape(con, rid) == attention.grid_shape(con, ctl) == (layers, heads)
        assert attention.grid_shape(con, rec.capture) == (0, 0)
        f = leaks.findings(con, rid)
        for req, part in f.groupby("request_id"):
            grid = attention.leak_grid(con, rid, request=req)
            assert len(grid) == layers * heads
            assert grid.max_foreign.max() == pytest.approx(part.mass.max(), abs=1e-6)
        for row in f.itertuples():
            cell = attention.leak_grid(con, rid, step=int(row.step), request=row.request_id).set_index(
                ["layer", "head"]).loc[(row.layer, row.head)]
            assert cell.max_foreign >= row.mass - 1e-6 and cell.leak_rows > 0
        whole = attention.leak_grid(con, rid)
        assert whole.max_foreign.max() == pytest.approx(f.mass.max(), abs=1e-6)
        clean = attention.leak_grid(con, ctl)
        assert len(clean) == layers * heads and (clean.max_foreign == 0).all() and (clean.leak_rows == 0).all()


# -- leaks --------------------------------------------------------------------------------------------------

def test_leak_over_time_and_findings_against_the_control(rec):
    with RunStore.open(rec.db).read() as con:
        rid, ctl = rec.ids["boundary"], rec.ids["boundary_control"]
        f = leaks.findings(con, rid)
        assert list(f.mass) == sorted(f.mass, reverse=True) and set(f.kind) == {"foreign"}
        over = leaks.leak_over_time(con, rid)
        assert over.max_foreign_mass.max() == pytest.approx(f.mass.max(), abs=1e-6)
        at = over.set_index(["step", "request_id"])
        for row in f.itertuples():
            assert at.loc[(row.step, row.request_id), "max_foreign_mass"] >= row.mass - 1e-6
            assert at.loc[(row.step, row.request_id), "leak_rate"] > 0
        clean = leaks.leak_over_time(con, ctl)
        assert len(clean) and (clean.max_foreign_mass == 0).all() and (clean.leak_rate == 0).all()
        assert leaks.findings(con, ctl).empty
        d = leaks.divergence(con, rid)
        assert list(d.columns) == ["request_id", "classification", "first_divergent_step", "max_logit_diff", "max_kl"]


def test_focus_of_engine_and_capture_findings(rec):
    with RunStore.open(rec.db).read() as con:
        top = leaks.findings(con, rec.ids["boundary"]).iloc[0].to_dict()
        focus = leaks.focus_of(top)
        assert focus == leaks.Focus(int(top["step"]), top["request_id"], int(top["layer"]), int(top["head"]),
                                    int(top["position"]))
        assert all(isinstance(v, int) for v in (focus.step, focus.layer, focus.head, focus.position))
        cross = leaks.findings(con, rec.capture)
        assert list(cross.kind) == ["cross_tenant"]
        row = cross.iloc[0].to_dict()
        assert pd.isna(row["layer"]) and pd.isna(row["head"]) and pd.isna(row["mass"])
        assert leaks.focus_of(row) == leaks.Focus(3, "tenant-b", None, None, 0)
    assert leaks.focus_of({"step": 2.0, "request_id": "A", "layer": float("nan"), "head": None}) == \
        leaks.Focus(2, "A")


# -- captures -----------------------------------------------------------------------------------------------

def test_prefix_tree_and_cached_blocks_of_an_imported_capture(rec):
    big = rec.big
    with RunStore.open(rec.db).read() as con:
        tree = captures.prefix_tree(con, rec.capture).set_index("block_hash")
        assert sorted(int(h) for h in tree.index) == [big, big + 1, big + 2, big + 3]  # a hash stored twice: one node
        assert pd.isna(tree.loc[big].parent_hash)
        assert int(tree.loc[big + 1].parent_hash) == big  # 64-bit hashes survive exactly
        assert int(tree.loc[big + 2].parent_hash) == int(tree.loc[big + 3].parent_hash) == big + 1
        assert list(tree.loc[big + 2].token_ids) == [5, 6] and int(tree.loc[big + 2].removed_step) == 4
        assert tree.drop(index=big + 2).removed_step.isna().all()
        assert tree.stored_step.to_dict() == {big: 0, big + 1: 0, big + 2: 1, big + 3: 2}
        assert len(captures.prefix_tree(con, rec.capture, max_nodes=2)) == 2
        cache = con.execute("SELECT step, cached_blocks, stored, removed FROM kv_cache_blocks WHERE run_id = ? "
                            "ORDER BY step", [rec.capture]).fetchall()
        assert [tuple(map(int, r)) for r in cache] == [
            (0, 2, 2, 0), (1, 3, 1, 0), (2, 4, 1, 0), (3, 4, 0, 0), (4, 3, 0, 1)], "big stored again is a repeat"
        assert captures.prefix_tree(con, rec.ids["boundary"]).empty


def test_prefix_tree_marks_removed_only_what_left_the_cache(tmp_path):
    """A block evicted and stored again is cached at the end; a cache reset (AllBlocksCleared) removes
    every block stored before it, as the kv_cache_blocks view counts them."""
    cap = write_capture(tmp_path / "r.jsonl", [
        batch(stored_map([5], None, [1, 2])),
        batch({"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}),
        batch(stored_map([5], None, [1, 2]), stored_map([6], 5, [3, 4])),  # 5 again: a cache hit from now on
        batch(stored_map([7], 5, [8, 9])),
        batch({"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}),
        batch({"type": "AllBlocksCleared"}),
        batch(stored_map([8], None, [5, 5])),  # after the reset
    ])
    db = tmp_path / "k.duckdb"
    rid = uploads.import_file(cap, RunStore.open(db))
    with RunStore.open(db).read() as con:
        tree = captures.prefix_tree(con, rid)
        cache = [n for (n,) in con.execute("SELECT cached_blocks FROM kv_cache_blocks WHERE run_id = ? ORDER BY step",
                                           [rid]).fetchall()]
    removed = {int(h): None if pd.isna(r) else int(r) for h, r in zip(tree.block_hash, tree.removed_step, strict=True)}
    stored = {int(h): int(s) for h, s in zip(tree.block_hash, tree.stored_step, strict=True)}
    assert stored == {5: 0, 6: 2, 7: 3, 8: 6}
    assert removed == {5: 5, 6: 5, 7: 4, 8: None}
    assert cache == [1, 0, 2, 3, 2, 0, 1]  # the view agrees: only 8 is cached at the end
    fig = tree_figure(tree)
    hollow = [len(t.x) for t in fig.data[1:] if t.marker.symbol == "circle-open"]
    assert sum(hollow) == 3  # hollow: removed


# -- delete ------------------------------------------------------------------------------------------------

def counts(db, run_id) -> dict[str, int]:
    with RunStore.open(db).read() as con:
        return {t: con.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", [run_id]).fetchone()[0]
                for t in runs.run_tables(con)}


@pytest.mark.slow
def test_delete_run_clears_every_table_and_keeps_other_runs(tmp_path):
    db = tmp_path / "k.duckdb"
    doomed, kept = record(db, "boundary"), record(db, "control_forks")
    cap = uploads.import_file(capture_file(tmp_path)[0], RunStore.open(db))
    with RunStore.open(db).read() as con:
        tables = runs.run_tables(con)
    assert {"runs", "requests", "attention_rows", "attention_parts", "attention_keys", "slot_writes", "blocks",
            "block_events", "page_tables", "leak_metrics", "findings", "kv_event_rows", "capture_sources", "token_text",
            "steps", "step_work"} <= set(tables)
    before_doomed, before_kept, before_cap = counts(db, doomed), counts(db, kept), counts(db, cap)
    assert before_doomed["attention_parts"] == 1 and before_doomed["attention_keys"] > 0
    assert before_doomed["findings"] > 0 and before_cap["capture_sources"] == 1
    parts = RunStore.open(db).attention_dir
    assert (parts / doomed).is_dir() and (parts / kept).is_dir()
    with RunStore.open(db).read() as con:
        kept_rows = con.execute("SELECT count(*) FROM attention WHERE run_id = ?", [kept]).fetchone()[0]
    runs.delete_run(RunStore.open(db), doomed)
    assert all(n == 0 for n in counts(db, doomed).values())
    assert counts(db, kept) == before_kept and counts(db, cap) == before_cap
    assert not (parts / doomed).exists() and (parts / kept).is_dir()  # its attention parts go with it
    with RunStore.open(db).read() as con:
        assert con.execute("SELECT count(*) FROM attention WHERE run_id = ?", [kept]).fetchone()[0] == kept_rows > 0
    (dataset,) = RunStore.open(db).captures_dir.iterdir()
    runs.delete_run(RunStore.open(db), cap)
    assert all(n == 0 for n in counts(db, cap).values()) and not dataset.exists()
    with pytest.raises(StoreError, match="no run"):
        runs.delete_run(RunStore.open(db), doomed)  # already gone
    with pytest.raises(StoreError, match="no run"):
        runs.delete_run(RunStore.open(db), "unknown")
    assert counts(db, kept) == before_kept
    with RunStore.open(db).read() as con:
        assert list(runs.list_runs(con).run_id) == [kept]


# -- uploads -------------------------------------------------------------------------------------------------

def run_ids(db) -> list[str]:
    with RunStore.open(db).read() as con:
        return sorted(r[0] for r in con.execute("SELECT run_id FROM runs").fetchall())


def test_an_exported_trace_imports_and_reads_the_same(rec, tmp_path):
    rid = rec.ids["control_forks"]
    trace = export_run(RunStore.open(rec.db), rid, tmp_path / "run.zip")
    with RunStore.open(rec.db).read() as con:
        want = runs.run_info(con, rid)
        want_pt = blocks.page_tables(con, rid, 3)
    saved = uploads.save_upload("my run.zip", trace.read_bytes(), tmp_path / "uploads")
    db = tmp_path / "other.duckdb"
    assert uploads.import_file(saved, RunStore.open(db)) == rid
    with RunStore.open(db).read() as con:
        got = runs.run_info(con, rid)
        assert (got.steps, got.requests, got.engine, got.has_blocks) == (want.steps, want.requests, want.engine, True)
        pd.testing.assert_frame_equal(blocks.page_tables(con, rid, 3), want_pt)
    with pytest.raises(KvvizError, match="already in"):
        uploads.import_file(saved, RunStore.open(db))
    assert uploads.earlier_import(saved, RunStore.open(db)) == uploads.Earlier(None, rid), "found by the run it carries"
    assert uploads.earlier_import(saved, RunStore.open(rec.db)).run_id == rid
    assert uploads.earlier_import(saved, RunStore.open(tmp_path / "empty.duckdb")).run_id is None
    assert run_ids(db) == [rid]


@pytest.mark.parametrize("name, data", [
    ("junk.bin", b"\x00\x01garbage\xff" * 10),
    ("empty.jsonl", b""),
    ("fake.zip", b"PK\x03\x04junk"),
    ("notes.jsonl", b'{"hello": "world"}\n'),
])
def test_garbage_uploads_are_refused_and_change_nothing(rec, tmp_path, name, data):
    before = run_ids(rec.db)
    path = uploads.save_upload(name, data, tmp_path / "uploads")
    assert path.read_bytes() == data
    with pytest.raises(KvvizError, match="the file is empty" if not data else None):
        uploads.import_file(path, RunStore.open(rec.db))
    assert run_ids(rec.db) == before
    uploads.refused(path)
    assert list((tmp_path / "uploads").iterdir()) == [], "a refused upload is not kept"


def test_a_zip_that_is_not_a_trace_is_refused(rec, tmp_path):
    before = run_ids(rec.db)
    z = tmp_path / "other.zip"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("readme.txt", "not a trace")
    with pytest.raises(KvvizError):
        uploads.import_file(z, RunStore.open(rec.db))
    with pytest.raises(KvvizError, match="no such file"):
        uploads.import_file(tmp_path / "missing.jsonl", RunStore.open(rec.db))
    with pytest.raises(KvvizError, match="not a capture dataset: no Parquet files"):
        uploads.import_file(tmp_path, RunStore.open(rec.db))
    assert run_ids(rec.db) == before


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "..", "", "a b/../c?.zip", "..\\..\\evil.zip",
                                  "x" * 300, "трасса.zip"])
def test_save_upload_keeps_files_inside_the_folder(tmp_path, name):
    folder = tmp_path / "uploads"
    path = uploads.save_upload(name, b"data", folder)
    assert path.parent.parent == folder and path.resolve().parent.parent == folder.resolve()
    assert path.is_file() and path.read_bytes() == b"data"
    assert "/" not in path.name and "\\" not in path.name and len(path.name) < 140 and not path.name.startswith(".")
    assert all(ch.isalnum() and ch.isascii() or ch in "._-" for ch in path.name)
    assert list(folder.iterdir()) == [path.parent] and not (tmp_path / "etc").exists()


def test_two_uploads_of_the_same_name_do_not_overwrite(tmp_path):
    a = uploads.save_upload("t.zip", b"1", tmp_path)
    b = uploads.save_upload("t.zip", b"2", tmp_path)
    assert a != b and a.read_bytes() == b"1" and b.read_bytes() == b"2"
    assert a.name == b.name == "t.zip", "the run is named by the file's own name"


def test_the_same_capture_uploaded_twice_is_imported_once(tmp_path):
    db = RunStore.open(tmp_path / "kvviz.duckdb")
    data = capture_file(tmp_path)[0].read_bytes()
    first = uploads.save_upload("cap.jsonl", data, tmp_path / "uploads")
    before = uploads.earlier_import(first, db)
    assert before.run_id is None and before.sha256 == hashlib.sha256(data).hexdigest()
    assert uploads.earlier_import(first, db).run_id is None, "looking imports nothing"
    rid = uploads.import_file(first, db, sha256=before.sha256)
    again = uploads.save_upload("renamed.jsonl", data, tmp_path / "uploads")
    assert uploads.earlier_import(again, db).run_id == rid, "the same bytes under another name"
    other = uploads.save_upload("cap.jsonl", data + b"\n", tmp_path / "uploads")
    assert uploads.earlier_import(other, db).run_id is None, "other bytes under the same name"
    with db.read() as con:
        assert con.execute("SELECT scenario FROM runs WHERE run_id = ?", [rid]).fetchone()[0] == "capture cap.jsonl"
    delete_run(db, rid)
    assert uploads.earlier_import(again, db).run_id is None, "a run deleted since does not count"


# -- live ----------------------------------------------------------------------------------------------------

def test_live_run_reports_every_step(rec):
    steps, rid = rec.live_steps, rec.ids["control_forks"]
    with RunStore.open(rec.db).read() as con:
        i = info(con, rid)
        generated = con.execute("SELECT generated_tokens FROM runs WHERE run_id = ?", [rid]).fetchone()[0]
        assert [s.step for s in steps] == i.steps
        wl = scenario("control_forks").workload
        assert all(s.total == sum(r["max_new_tokens"] for r in wl["requests"]) for s in steps)
        assert [s.tokens for s in steps] == sorted(s.tokens for s in steps) and steps[-1].tokens == generated
        assert all(s.tokens <= s.total for s in steps)
        for s in steps:
            assert len(s.blocks) == i.engine["num_blocks"] and list(s.blocks.block) == list(range(len(s.blocks)))
            assert s.findings == 0 and s.metrics["max_foreign"] == 0 and s.metrics["leak_rate"] == 0
            stored = blocks.block_map(con, rid, s.step)
            for col in ("state", "refcount", "owners"):
                assert list(s.blocks[col]) == list(stored[col]), (s.step, col)


def test_live_run_of_a_leak_counts_findings_as_it_goes(tmp_path):
    seen: list[live.LiveStep] = []
    compared: list[tuple[int, int, str]] = []  # the reference oracle after the run: a word per request
    db = tmp_path / "k.duckdb"
    out = live.run(RunStore.open(db), tiny(), live.scenario_workload("boundary", tiny()), "boundary",
                   on_step=seen.append, on_reference=lambda *said: compared.append(said))
    assert out.findings > 0 and out.max_foreign > 0 and set(out.texts) == {"A", "B"}
    assert compared == [(0, 2, "A"), (1, 2, "B")]
    assert live.comparing_message(1, 2, "B") == "Comparing each request with itself run alone: B (2 of 2)"
    assert [s.findings for s in seen] == sorted(s.findings for s in seen) and seen[-1].findings == out.findings
    worst = [s.metrics["max_foreign"] for s in seen]
    assert worst == sorted(worst) and worst == seen[-1].history["max_foreign"]
    assert worst[-1] == pytest.approx(out.max_foreign, abs=1e-6) and seen[0].findings == 0


def test_live_run_refuses_a_bad_workload_before_recording(rec):
    before = run_ids(rec.db)
    with pytest.raises(KvvizError) as e:
        live.run(RunStore.open(rec.db), tiny(), {"requests": [{"id": "A", "prompt": "x", "max_new_tokens": -1}]})
    assert isinstance(e.value, WorkloadError)
    with pytest.raises(KvvizError):
        live.run(RunStore.open(rec.db), tiny(), live.scenario_workload("control_forks", tiny()), "no_such_fault")
    assert run_ids(rec.db) == before


@pytest.mark.parametrize("fault", ["unsalted_prefix", None])
def test_keys_another_tenant_wrote_are_labelled_with_its_tenant(tmp_path, fault):
    """B (tenant-b) hits A's (tenant-a) cached prompt when the salt is left out of the hash: the keys
    it reads are exact copies (own, not foreign), so their labels name the tenant that wrote them.
    Salted, B computes its own and nothing is named."""
    m = tiny()
    store = RunStore.open(tmp_path / "k.duckdb")
    rid = live.run(store, m, live.scenario_workload("unsalted_prefix", m), fault).run_id
    with store.read() as con:
        i = info(con, rid)
        v = attention.attention_view(con, rid, "B", i.steps[-1], 0, attention.HEAD_MEAN, i.block_size, upto=True)
    named = {lab.rsplit(" [", 1)[-1] for lab in v.key_labels if lab.endswith("]")}
    owners = set(v.key_owners)
    if fault:
        assert "A" in owners and named == {"tenant-a]"}
        assert all(lab.endswith("[tenant-a]") for lab, o in zip(v.key_labels, v.key_owners, strict=True) if o == "A")
    else:
        assert owners == {"B"} and not named


def test_a_run_without_findings_is_shown_where_the_most_requests_held_blocks(rec):
    """The control's last step may hold no page table at all; its busiest step holds every request's."""
    rid = rec.ids["boundary_control"]
    with RunStore.open(rec.db).read() as con:
        focus = leaks.busiest_focus(con, rid, "A")
        held = dict(con.execute("SELECT step, count(DISTINCT request_id) FROM page_tables WHERE run_id = ? "
                                "GROUP BY step", [rid]).fetchall())
        requests = con.execute("SELECT count(*) FROM requests WHERE run_id = ?", [rid]).fetchone()[0]
    assert focus.request == "A" and held[focus.step] == max(held.values()) == requests
    assert focus.step == min(s for s, n in held.items() if n == requests)
