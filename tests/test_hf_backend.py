"""The transformers backend: transformers' continuous batching run as shipped, judged by kvviz's oracles.

Outputs equal plain `generate_batch` (through transformers' own paged attention, not kvviz's
observer), with either kernel; clean workloads are clean; the prefix blocks transformers shares
across tenants (it has no salt) are reported as cross_tenant reads while kvviz's engine with salts
shares none; bugs put into transformers inside a test (its packed mask one key off at a request
boundary, a read index past a request's end, a block table one block off, a prefix match that
accepts a block whose last token differs, a block freed while another request holds it) are caught
with the right requests named, their controls clean, under both kernels; sdpa_paged, whose kernel
returns no weights, is judged from weights kvviz recomputes, and a kernel that does not compute them
(a key dropped, an output perturbed, for one request) is a kernel_mismatch naming that request;
every field the backend cannot honour is one sentence; and a recorded transformers run is a run like
any other in the store.
"""

from __future__ import annotations

import functools
import json
import os
import re

import duckdb
import pytest
import torch
from transformers import AttentionInterface, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import input_outputs
from transformers.generation.continuous_batching.cache_allocators import cache_allocator, full_attention
from transformers.integrations import sdpa_attention
from transformers.integrations.eager_paged import eager_paged_attention_forward

from kvviz.analysis import cross_reads, leaks
from kvviz.engine import Engine, EngineError
from kvviz.engine.workload import Workload
from kvviz.errors import WorkloadError
from kvviz.hf_backend import adapter
from kvviz.models import load_model
from kvviz.models.routing import stock_copy
from kvviz.runners import replay
from kvviz.runners.checked import run_checked
from kvviz.runners.recorded import record_run
from kvviz.store import RunStore

from .cli import kvviz

ENGINE = {"backend": "transformers", "block_size": 4, "num_blocks": 48, "max_batch_tokens": 48}
SYSTEM = "System: you are a helpful assistant. "
KERNELS = ["eager_paged", "sdpa_paged"]


DEVICE = os.environ.get("KVVIZ_TEST_DEVICE", "cpu")  # scripts/device-check.sh sets cuda


@functools.cache
def tiny():
    return load_model("tiny-llama", device=DEVICE)


def workload(requests: list[dict], **engine) -> Workload:
    return Workload.from_dict({"requests": requests, "engine": {**ENGINE, **engine}})


def three_requests(**extra) -> list[dict]:
    """Two prompts with a common prefix of several blocks and one without, chunked by the token budget."""
    return [
        {"id": "A", "prompt": SYSTEM + "The passphrase is red.", "max_new_tokens": 6, **extra},
        {"id": "B", "prompt": SYSTEM + "What is the passphrase?", "max_new_tokens": 5, **extra},
        {"id": "C", "prompt": "Hello there", "max_new_tokens": 4, **extra},
    ]


def stock_generate_batch(m, wl: Workload, monkeypatch) -> dict[str, list[int]]:
    """Plain generate_batch on the same weights and cache settings, through transformers' own paged
    attention function for the workload's kernel (kvviz's observers unregistered for the call)."""
    monkeypatch.setitem(AttentionInterface._global_mapping, "paged|eager", eager_paged_attention_forward)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", sdpa_attention.sdpa_attention_forward)
    ids = [m.tokenizer(r.prompt).input_ids for r in wl.requests]
    e = wl.engine
    cb = ContinuousBatchingConfig(
        page_size=e.block_size,
        num_blocks=e.num_blocks,
        max_batch_tokens=e.max_batch_tokens,
        auto_switch_to_flash=False,
    )
    model = stock_copy(m.model)
    model.set_attn_implementation(adapter.IMPLEMENTATIONS[e.kernel])
    with torch.inference_mode():
        out = model.generate_batch(
            inputs=ids,
            generation_config=GenerationConfig(
                do_sample=False,
                max_new_tokens=max(r.max_new_tokens for r in wl.requests),
                eos_token_id=m.tokenizer.eos_token_id,
            ),
            continuous_batching_config=cb,
            progress_bar=False,
        )
    return {r.id: out[f"req_{i}"].generated_tokens[: r.max_new_tokens] for i, r in enumerate(wl.requests)}


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_greedy_outputs_equal_plain_generate_batch_token_for_token(kernel, monkeypatch):
    m, wl = tiny(), workload(three_requests(), kernel=kernel)
    run = run_checked(m, wl)
    assert {r.id: r.output_ids for r in run.result.requests} == stock_generate_batch(m, wl, monkeypatch)
    assert run.result.stats.steps > 2  # chunked prefill and decode steps, not one batch


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_clean_workload_has_no_foreign_mass_and_matches_each_request_alone(kernel):
    """With either kernel (sdpa_paged's weights recomputed by kvviz): every weight own, no finding (no
    kernel_mismatch either), each request's logits those of the request run alone up to batch variance."""
    run = run_checked(tiny(), workload(three_requests(), kernel=kernel))
    leak = run.oracle.summary()
    assert leak["max_foreign_mass"] == 0 and leak["counts"]["foreign"] == leak["counts"]["stale"] == 0
    assert leak["counts"]["own"] > 0
    assert run.findings == []
    assert [d.classification for d in run.divergences] == ["batch_variance"] * 3
    assert run.summary()["backend"] == "transformers" and run.notes == []


def test_the_live_metrics_count_transformers_data_blocks_not_its_trash_blocks():
    """The Run page's tiles: utilisation is of the blocks requests can hold (the workload's num_blocks),
    as the inspector's memory view counts them; the reserved trash blocks read as held otherwise."""
    from kvviz.analysis.run_metrics import LiveMetrics

    wl, seen = workload(three_requests()), []

    def on_step(rec):
        live = LiveMetrics()
        live.update(rec)
        held = [b for b, r in enumerate(rec.snapshot.refcounts) if r > 0]
        assert all(b < wl.engine.num_blocks for b in held), "no trash block is held"
        seen.append((live.values()["block_utilisation"], len(held) / wl.engine.num_blocks))
    run_checked(tiny(), wl, on_step=on_step)
    assert seen and all(got == pytest.approx(want) for got, want in seen), seen
    assert max(got for got, _ in seen) > 0


@pytest.mark.parametrize("backend", ["transformers", "kvviz"])
def test_transformers_trash_blocks_are_reserved_not_free_and_kvviz_has_none(backend):
    """The block map's states: transformers' trash blocks (last, past the workload's num_blocks) are no
    request's and never free to allocate, so they are `reserved` at every step; every data block is
    free, cached or used. kvviz's own pool, the control, reserves nothing."""
    from kvviz.runners.live import pool_frame

    wl, states = workload(three_requests(), backend=backend), []
    run_checked(tiny(), wl, on_step=lambda rec: states.append(list(pool_frame(rec).state)))
    n = wl.engine.num_blocks
    assert states and all(set(s[:n]) <= {"free", "cached", "used"} for s in states)
    assert any("used" in s[:n] for s in states)
    trash = {tuple(s[n:]) for s in states}
    if backend == "transformers":
        assert len(trash) == 1 and set(next(iter(trash))) == {"reserved"}, trash
    else:
        assert trash == {()}, "kvviz's pool is num_blocks long"


def test_tenants_with_a_common_prefix_share_blocks_in_transformers_not_in_kvviz_with_salts():
    """transformers has no salt: the second tenant reads the first tenant's prefix blocks, which the
    oracle reports as cross_tenant reads (own by content, no foreign mass); kvviz's engine, salted,
    gives the same workload no shared block."""
    reqs = [
        {"id": "A", "prompt": SYSTEM + "The passphrase is red.", "max_new_tokens": 4, "cache_salt": "tenant-a"},
        {
            "id": "B",
            "prompt": SYSTEM + "The passphrase is blue.",
            "max_new_tokens": 4,
            "cache_salt": "tenant-b",
            "arrival_step": 2,
        },
    ]
    hf = run_checked(tiny(), workload(reqs))
    reads = cross_reads.from_findings(hf.findings, {"A": "tenant-a", "B": "tenant-b"})
    prefix_blocks = len(tiny().tokenizer(SYSTEM).input_ids) // ENGINE["block_size"]
    assert {(r.reader, r.writer, r.reader_tenant, r.writer_tenant) for r in reads} == {
        ("B", "A", "tenant-b", "tenant-a")
    }
    assert len({r.block for r in reads}) >= prefix_blocks
    assert hf.oracle.summary()["max_foreign_mass"] == 0
    assert "tenant-a read by tenant-b" in hf.summary()["cross_tenant"]
    assert len(hf.notes) == 1 and "requests[].cache_salt" in hf.notes[0]
    by_id = {r.id: r for r in hf.result.requests}
    assert by_id["B"].cached_tokens >= prefix_blocks * ENGINE["block_size"]  # served from A's blocks

    ours = run_checked(tiny(), workload(reqs, backend="kvviz"))
    assert [f for f in ours.findings if f.kind == "cross_tenant"] == []
    assert {r.id: r.cached_tokens for r in ours.result.requests} == {"A": 0, "B": 0}


@pytest.mark.slow
def test_a_pool_too_small_for_all_at_once_preempts_recomputes_and_stays_clean(monkeypatch):
    """transformers takes a request's blocks back to make room (its soft reset) and computes it again
    later in other blocks: the preemption is recorded, the recomputed slots are the request's own in
    their new lifetimes, and the tokens are still generate_batch's."""
    reqs = [{"id": f"R{i}", "prompt": f"request {i} says hello to everyone", "max_new_tokens": 6} for i in range(3)]
    wl = workload(reqs, num_blocks=14, max_batch_tokens=32)
    records = []
    run = run_checked(tiny(), wl, on_step=records.append)
    assert run.result.stats.preemptions == sum(len(r.preempted) for r in records) >= 1
    assert any(e.kind == "preempt" for r in records for e in r.events)
    assert run.findings == [] and run.oracle.summary()["counts"]["stale"] == 0
    assert {r.id: r.output_ids for r in run.result.requests} == stock_generate_batch(tiny(), wl, monkeypatch)


def _mask_one_key_early(original):
    """transformers' packed mask with one bug: each request's first query also sees the key just
    before its own segment (the previous request's last key): the block diagonal one key off."""

    def build(attention_mask, cumulative_seqlens_q, cumulative_seqlens_k, sliding_window=1):
        original(attention_mask, cumulative_seqlens_q, cumulative_seqlens_k, sliding_window)
        for i in range(1, len(cumulative_seqlens_q) - 1):
            attention_mask[..., cumulative_seqlens_q[i], cumulative_seqlens_k[i] - 1] = 0

    return build


def test_a_mask_one_key_off_at_a_request_boundary_in_transformers_is_caught(monkeypatch):
    """Batches pack A, B, C in that order (A alone first: its prompt fills the token budget): with the
    mask one key off, B reads A's last key and C reads B's, A (first in every batch) reads nobody's.
    Both oracles say so; without the bug both say nothing."""
    wl = workload(three_requests())
    clean = run_checked(tiny(), wl)
    assert clean.findings == [] and {d.classification for d in clean.divergences} == {"batch_variance"}
    monkeypatch.setattr(input_outputs, "build_attention_mask", _mask_one_key_early(input_outputs.build_attention_mask))
    bad = run_checked(tiny(), wl)
    assert {(f.kind, f.request, f.source_request) for f in bad.findings} == {
        ("foreign", "B", "A"),
        ("foreign", "C", "B"),
    }
    assert {d.request: d.classification for d in bad.divergences} == {"A": "batch_variance", "B": "leak", "C": "leak"}


def test_a_read_index_one_slot_past_a_request_s_end_reads_stale_slots_and_is_caught(monkeypatch):
    """transformers' read indices with one bug: a request's newest key is read from the slot after it in
    the same block, which no one has written in this block's lifetime: stale (not foreign) for every
    request that reads it, in the oracle; the control is clean."""
    from transformers.generation.continuous_batching.cache_allocators import full_attention

    cls = full_attention.FullAttentionCacheAllocator
    original = cls.get_read_indices

    def one_past(self, request_id, past_length, query_length):
        indices = original(self, request_id, past_length, query_length)
        if (past_length + query_length) % self.tokens_per_page:  # the next slot is in the same block
            indices[-1] += 1
        return indices

    wl = workload(three_requests())
    assert run_checked(tiny(), wl, reference=False).findings == []
    monkeypatch.setattr(cls, "get_read_indices", one_past)
    bad = run_checked(tiny(), wl, reference=False)
    kinds = {f.kind for f in bad.findings}
    assert kinds == {"stale"} and {f.request for f in bad.findings} == {"A", "B", "C"}
    assert bad.oracle.summary()["counts"]["foreign"] == 0 and bad.oracle.summary()["counts"]["stale"] > 0


def _by_kind(run) -> set[tuple[str, str, str | None]]:
    return {(f.kind, f.request, f.source_request) for f in run.findings}


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_block_table_one_block_off_in_transformers_is_caught(kernel, monkeypatch):
    """transformers' block table with one bug, as its read path uses it: B's first entry points at the
    physical block after the one B was given, which is A's last block (transformers hands each request
    a run of blocks, highest first). B reads A's keys there (foreign, from A) and A's slots not written
    yet (stale); A and C are untouched. Both oracles say so, with either kernel; the control is clean."""
    reqs = [
        {"id": "A", "prompt": "The passphrase is red.", "max_new_tokens": 6},
        {"id": "B", "prompt": "What is the passphrase?", "max_new_tokens": 5},
        {"id": "C", "prompt": "Hello there", "max_new_tokens": 4},
    ]
    wl = workload(reqs, kernel=kernel)
    clean = run_checked(tiny(), wl)
    assert clean.findings == [] and {d.classification for d in clean.divergences} == {"batch_variance"}

    cls = full_attention.FullAttentionCacheAllocator
    original = cls.get_read_indices

    def one_block_off(self, request_id, past_length, query_length):
        indices = original(self, request_id, past_length, query_length)
        if request_id != "B":
            return indices
        page, stride = self.tokens_per_page, self.block_physical_stride
        return [i + stride if k < page else i for k, i in enumerate(indices)]

    monkeypatch.setattr(cls, "get_read_indices", one_block_off)
    bad = run_checked(tiny(), wl)
    assert _by_kind(bad) == {("foreign", "B", "A"), ("stale", "B", None)}
    assert {d.request: d.classification for d in bad.divergences} == {
        "A": "batch_variance",
        "B": "leak",
        "C": "batch_variance",
    }


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_prefix_match_that_accepts_a_block_whose_last_token_differs_is_caught(kernel, monkeypatch):
    """transformers' block hash with one bug: it leaves a block's last token out, so the prefix match
    accepts a cached block that differs from the prompt in its last token, and every block after it.
    B's prompt differs from A's in the last token of its second block: the control serves B only A's
    first block; with the bug B is served A's whole prompt and reads A's keys as its own (foreign, from
    A), with either kernel."""
    ids = tiny().tokenizer(SYSTEM + "The passphrase is red.").input_ids
    other = [*ids[:7], ids[7] + 1, *ids[8:]]  # block 1 (tokens 4..7) differs in its last token
    reqs = [
        {"id": "A", "prompt_ids": ids, "max_new_tokens": 4},
        {"id": "B", "prompt_ids": other, "max_new_tokens": 4, "arrival_step": 3},
    ]
    wl = workload(reqs, kernel=kernel)
    clean = run_checked(tiny(), wl)
    assert clean.findings == [] and {d.classification for d in clean.divergences} == {"batch_variance"}
    assert {r.id: r.cached_tokens for r in clean.result.requests} == {"A": 0, "B": 4}

    original = cache_allocator.compute_block_hash
    monkeypatch.setattr(cache_allocator, "compute_block_hash", lambda parent, tokens: original(parent, tokens[:-1]))
    bad = run_checked(tiny(), wl)
    assert _by_kind(bad) == {("foreign", "B", "A")}
    assert {r.id: r.cached_tokens for r in bad.result.requests}["B"] > 8
    assert {d.request: d.classification for d in bad.divergences} == {"A": "batch_variance", "B": "leak"}


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_block_freed_while_another_request_holds_it_is_caught(kernel, monkeypatch):
    """transformers' block ledger with one bug: a release frees the block outright, whoever else holds
    it. B shares A's system-prompt blocks; A finishes first and frees them under B; C, arriving later,
    is given them and writes its own keys there, which B then reads (foreign, from C). A and C are
    untouched; with either kernel; the control is clean."""
    reqs = [
        {"id": "A", "prompt": SYSTEM + "Say red.", "max_new_tokens": 2},
        {"id": "B", "prompt": SYSTEM + "Say blue please.", "max_new_tokens": 12, "arrival_step": 1},
        {
            "id": "C",
            "prompt": "Completely different words here, and more of them.",
            "max_new_tokens": 4,
            "arrival_step": 5,
        },
    ]
    wl = workload(reqs, kernel=kernel)
    clean = run_checked(tiny(), wl)
    assert clean.findings == [] and {d.classification for d in clean.divergences} == {"batch_variance"}
    assert {r.id: r.cached_tokens for r in clean.result.requests}["B"] > 0  # it shares A's blocks

    def release(self, block_id, no_cache=False):
        self.shared_ref_counts.pop(block_id, None)
        self.cached_blocks.pop(block_id, None)
        h = self.block_to_hash.pop(block_id, None)
        if h is not None:
            self.hash_to_block.pop(h, None)
        return True

    monkeypatch.setattr(cache_allocator.BlockLedger, "release", release)
    bad = run_checked(tiny(), wl)
    assert _by_kind(bad) == {("foreign", "B", "C")}
    assert {d.request: d.classification for d in bad.divergences} == {
        "A": "batch_variance",
        "B": "leak",
        "C": "batch_variance",
    }


# B alone reaches this position: its prompt is 60 tokens, A's and C's end before it
B_ONLY = 20


def _kernel_requests() -> list[dict]:
    return [
        {"id": "A", "prompt": "Hello there", "max_new_tokens": 4},
        {"id": "B", "prompt": SYSTEM + "What is the passphrase?", "max_new_tokens": 5},
        {"id": "C", "prompt": "Hello sky", "max_new_tokens": 4},
    ]


def _b_rows(kwargs: dict) -> torch.Tensor | None:
    """B's queries in a packed batch of transformers' continuous batching (None in any other call, such
    as the reference oracle's run of a request alone)."""
    return kwargs["position_ids"][0] >= B_ONLY if "cu_seq_lens_q" in kwargs else None


def _drop_first_key(original):
    """transformers' SDPA attention with one bug in continuous batching: B's queries lose the first key
    their mask lets them see, inside the kernel; the mask it was given is right."""

    def sdpa(module, query, key, value, attention_mask, **kwargs):
        rows = _b_rows(kwargs)
        if rows is not None:
            attention_mask = attention_mask.clone()
            first = (attention_mask[0, 0] == 0).float().argmax(-1)
            attention_mask[0, 0, rows, first[rows]] = torch.finfo(attention_mask.dtype).min
        return original(module, query, key, value, attention_mask, **kwargs)

    return sdpa


def _perturb_one_head(original):
    """transformers' SDPA attention with one bug in continuous batching: at layer 1, head 2 of B's
    queries comes out off by 1e-4 of the largest value."""

    def sdpa(module, query, key, value, attention_mask, **kwargs):
        out, weights = original(module, query, key, value, attention_mask, **kwargs)
        rows = _b_rows(kwargs)
        if rows is not None and module.layer_idx == 1:
            out = out.clone()
            out[0, rows, 2] += 1e-4 * value.abs().max()
        return out, weights

    return sdpa


@pytest.mark.slow
@pytest.mark.parametrize("bug", [_drop_first_key, _perturb_one_head])
def test_a_kernel_that_does_not_compute_its_weights_for_one_request_is_a_kernel_mismatch(bug, tmp_path, monkeypatch):
    """sdpa_paged returns no weights: kvviz recomputes them from the kernel's inputs, and a kernel that
    computes something else for B (a key dropped inside it, one head's output perturbed) is a
    kernel_mismatch naming B (the layer and head, when one is struck), A and C clean; the weights kvviz
    judged stay own, and the control has no finding. Recorded, the findings view lists it."""
    wl = workload(_kernel_requests(), kernel="sdpa_paged")
    assert run_checked(tiny(), wl, reference=False).findings == []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", bug(sdpa_attention.sdpa_attention_forward))
    store = RunStore.open(tmp_path / "k.duckdb")
    bad = record_run(store, tiny(), wl)
    assert {(f.kind, f.request) for f in bad.findings} == {("kernel_mismatch", "B")}
    assert all(f.mass > 1 for f in bad.findings)  # past the tolerance, in tolerances
    b = {d.request: d.classification for d in bad.divergences}["B"]
    if bug is _perturb_one_head:  # too small to move B's logits past batch variance: only this check sees it
        assert {(f.layer, f.head) for f in bad.findings} == {(1, 2)} and b == "batch_variance"
    else:  # B's output moved with no foreign weight: the reference oracle agrees
        assert b == "divergence"
    assert bad.oracle.summary()["counts"]["foreign"] == bad.oracle.summary()["counts"]["stale"] == 0
    assert {d.request: d.classification for d in bad.divergences if d.request != "B"} == {
        "A": "batch_variance",
        "C": "batch_variance",
    }
    with store.read() as con:
        shown = leaks.findings(con, bad.result.run_id)
    assert set(shown.kind) == {"kernel_mismatch"} and set(shown.request_id) == {"B"}
    assert len(shown) == len(bad.findings)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            {"requests": [{"id": "A", "prompt": "hi"}, {"id": "B", "parent": "A", "prompt": " more"}]},
            "requests[1].parent",
        ),
        ({"requests": [{"id": "A", "prompt": "hi", "adapter": "x"}]}, "requests[0].adapter"),
        (
            {"requests": [{"id": "A", "prompt": "hi"}, {"id": "B", "prompt": "ho", "temperature": 0.7}]},
            "requests[1].temperature",
        ),
        ({"engine": {"isolation": "masked"}}, "engine.isolation"),
        ({"engine": {"offload": {"cpu_blocks": 4}}}, "engine.offload"),
        ({"engine": {"disaggregated": True}}, "engine.disaggregated"),
        ({"engine": {"block_size": 2}}, "engine.block_size"),
    ],
)
def test_a_field_the_backend_cannot_honour_is_one_sentence_naming_it(change, field):
    reqs = change.get("requests", [{"id": "A", "prompt": "hi"}])
    wl = workload(reqs, **change.get("engine", {}))
    with pytest.raises(WorkloadError, match="^" + re.escape(field) + ": ") as e:
        run_checked(tiny(), wl)
    assert "\n" not in str(e.value)


def test_an_unknown_kernel_or_a_transformers_kernel_for_kvviz_s_engine_is_one_sentence():
    with pytest.raises(WorkloadError, match=r"^engine.kernel: must be one of eager_paged, sdpa_paged, flash_attn "
                                            r".*'flash'$"):
        workload([{"id": "A", "prompt": "hi"}], kernel="flash")
    with pytest.raises(WorkloadError, match=r"^engine.kernel: 'sdpa_paged' is a kernel of transformers' continuous"):
        workload([{"id": "A", "prompt": "hi"}], kernel="sdpa_paged", backend="kvviz")


def test_a_fault_an_unknown_version_and_kvviz_s_engine_refuse_in_one_sentence(monkeypatch):
    wl = workload([{"id": "A", "prompt": "hi", "max_new_tokens": 2}])
    with pytest.raises(WorkloadError, match=r"^fault 'boundary': kvviz's faults are injected into kvviz's own"):
        run_checked(tiny(), wl, "boundary")
    with pytest.raises(EngineError, match=r"^engine.backend: 'transformers' is another engine, run by kvviz.runners"):
        Engine(tiny(), wl.engine).run(wl)
    monkeypatch.setattr(adapter.transformers, "__version__", "5.25.0")
    with pytest.raises(
        adapter.BackendError,
        match=r"^transformers 5.25.0 is installed; kvviz's transformers "
        r"backend reads .* of transformers 5.24.x only",
    ):
        run_checked(tiny(), wl)


@pytest.mark.slow
def test_a_recorded_transformers_run_is_stored_like_any_other(tmp_path):
    store = RunStore.open(tmp_path / "k.duckdb")
    reqs = [
        {"id": "A", "prompt": SYSTEM + "red", "max_new_tokens": 6, "cache_salt": "tenant-a"},
        {"id": "B", "prompt": SYSTEM + "blue", "max_new_tokens": 3, "cache_salt": "tenant-b", "arrival_step": 2},
    ]
    run = record_run(store, tiny(), workload(reqs))
    rid = run.result.run_id
    with store.read() as con:
        assert con.execute("SELECT backend, status, engine->>'backend' FROM runs").fetchall() == [
            ("transformers", "complete", "transformers")
        ]
        steps = con.execute("SELECT count(*) FROM steps WHERE run_id = ?", [rid]).fetchone()[0]
        assert steps == run.result.stats.steps
        # B's page table starts with the blocks A wrote (prefix sharing), refcount 2 while both hold them
        shared = con.execute(
            "SELECT count(*) FROM page_tables p JOIN blocks b ON b.run_id = p.run_id AND b.step = p.step AND "
            "b.block = p.physical_block WHERE p.request_id = 'B' AND b.refcount = 2 AND b.hash IS NOT NULL"
        ).fetchone()[0]
        assert shared > 0
        assert con.execute("SELECT count(*) FROM attention WHERE run_id = ?", [rid]).fetchone()[0] > 0
        assert con.execute("SELECT count(*) FROM block_events WHERE kind = 'hit' AND request_id = 'B'").fetchone()[0]
        assert con.execute("SELECT hit_tokens > 0 FROM cache_lookups WHERE request_id = 'B'").fetchone()[0]
        reads = cross_reads.from_store(con, rid)
    assert {(r.reader, r.writer) for r in reads} == {("B", "A")}
    assert replay.verify(store, rid, device=DEVICE) == []  # re-executed through transformers: the same run


def test_a_version_11_store_gains_the_backend_column_with_kvviz_for_its_runs(tmp_path):
    db = tmp_path / "v11.duckdb"
    store = RunStore.open(db)
    record_run(store, tiny(), workload([{"id": "A", "prompt": "hi", "max_new_tokens": 2}], backend="kvviz"))
    con = duckdb.connect(str(db))
    con.execute("ALTER TABLE runs DROP COLUMN backend")
    con.execute("UPDATE meta SET value = '11' WHERE key = 'schema_version'")
    con.close()
    with RunStore.open(db).read() as con:
        assert con.execute("SELECT backend FROM runs").fetchall() == [("kvviz",)]


def test_run_backend_transformers_from_the_command_line(tmp_path):
    wl = tmp_path / "wl.json"
    wl.write_text(
        '{"requests": [{"id": "A", "prompt": "hello", "max_new_tokens": 3, "cache_salt": "t"}], '
        '"engine": {"block_size": 4, "num_blocks": 16}}'
    )

    def run(*extra):
        return kvviz(
            "run",
            "--workload",
            wl,
            "--model",
            "tiny-llama",
            "--backend",
            "transformers",
            "--db",
            tmp_path / "k.duckdb",
            "--quiet",
            *extra,
        )

    out = run("--json")
    assert out.returncode == 0, out.stderr
    assert "kvviz: note: requests[].cache_salt: transformers has no cache salt" in out.stderr
    assert '"backend": "transformers"' in out.stdout.splitlines()[-1]
    sdpa = run("--kernel", "sdpa_paged")
    assert sdpa.returncode == 0, sdpa.stderr
    assert "backend transformers (sdpa_paged)" in sdpa.stdout.splitlines()[0]
    bad = run("--fault", "boundary")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    listed = kvviz("runs", "--db", tmp_path / "k.duckdb", "--format", "json")
    assert [r["engine"] for r in json.loads(listed.stdout)] == ["transformers", "transformers"]


@pytest.mark.slow
def test_smollm2_greedy_outputs_equal_generate_batch_and_stay_clean(monkeypatch):
    m = load_model("smollm2", device="cpu")
    wl = Workload.from_dict(
        {
            "requests": [
                {"id": "A", "prompt": SYSTEM + "Name a colour.", "max_new_tokens": 8},
                {"id": "B", "prompt": SYSTEM + "Name a fruit.", "max_new_tokens": 8},
            ],
            "engine": {**ENGINE, "block_size": 16, "num_blocks": 32, "max_batch_tokens": 64},
        }
    )
    run = run_checked(m, wl)
    assert {r.id: r.output_ids for r in run.result.requests} == stock_generate_batch(m, wl, monkeypatch)
    assert run.oracle.summary()["max_foreign_mass"] == 0 and run.findings == []


@pytest.mark.slow
def test_a_catalogue_scenario_runs_on_transformers_from_the_command_line_as_the_scenarios_page_runs_it(tmp_path):
    """`run --scenario S --backend transformers` runs S's requests through transformers as shipped: the
    scenario's fault and masked isolation (kvviz's engine's) are left out, each with a note; a fault given
    with --fault is still refused."""

    def run(name, *extra):
        db = tmp_path / "k.duckdb"
        return kvviz(
            "run",
            "--scenario",
            name,
            "--model",
            "tiny-llama",
            "--backend",
            "transformers",
            "--db",
            db,
            "--quiet",
            "--json",
            *extra,
        )

    masked = run("passphrase")
    assert masked.returncode == 0, masked.stderr
    assert "its isolation 'masked' is kvviz's engine's" in masked.stderr
    s = json.loads(masked.stdout.splitlines()[-1])
    assert (s["engine"]["isolation"], s["fault"], s["findings"]) == ("paged", None, [])
    unsalted = run("unsalted_prefix")
    assert unsalted.returncode == 0, unsalted.stderr
    assert "its fault 'unsalted_prefix' strikes kvviz's engine only and is left out" in unsalted.stderr
    s = json.loads(unsalted.stdout.splitlines()[-1])
    assert s["fault"] is None and {f["kind"] for f in s["findings"]} == {"cross_tenant"}
    refused = run("boundary", "--fault", "boundary")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "fault 'boundary': kvviz's faults are injected into kvviz's own engine" in refused.stderr


def test_transformers_keeps_no_prefix_of_a_request_that_ends_in_its_prefill_step():
    """What docs/engines.md says of transformers 5.24 (and why a timing audit with one-token requests sees
    no sharing): the blocks a request completes in the forward that also samples its last token are never
    hashed. A prompt prefilled in one forward and sent again after a request that generated one token finds
    nothing cached; after one that generated two it finds its full blocks; kvviz's engine keeps both."""
    p = SYSTEM + "What is the passphrase?"
    full = {q: (len(tiny().tokenizer(q).input_ids) - 1) // 4 * 4 for q in (p, p + "!")}
    reqs = [
        {"id": "A1", "prompt": p, "max_new_tokens": 1, "ignore_eos": True},
        {"id": "B1", "prompt": p, "max_new_tokens": 1, "ignore_eos": True, "arrival_step": 2},
        {"id": "A2", "prompt": p + "!", "max_new_tokens": 2, "ignore_eos": True, "arrival_step": 4},
        {"id": "B2", "prompt": p + "!", "max_new_tokens": 2, "ignore_eos": True, "arrival_step": 8},
    ]
    for backend, b1 in (("transformers", 0), ("kvviz", full[p])):
        run = run_checked(tiny(), workload(reqs, backend=backend, max_batch_tokens=256), reference=False)
        cached = {r.id: r.cached_tokens for r in run.result.requests}
        assert (cached["B1"], cached["B2"]) == (b1, full[p + "!"]) and full[p] > 0, backend
        assert run.findings == []
