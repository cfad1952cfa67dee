"""The oracles: controls exactly clean, every fault seen by the oracle that should see it, the
passphrase experiment, and the reference comparison."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from kvviz.catalogue.faults import FAULTS, UnknownFault
from kvviz.catalogue.scenarios import SCENARIOS
from kvviz.engine import Engine
from kvviz.engine.workload import Workload
from kvviz.models import load_model
from kvviz.oracle import ProvenanceOracle
from kvviz.oracle.probe import LastPromptTokenProbe
from kvviz.runners.checked import FaultMismatch, run_checked


@functools.cache
def model(name):
    return load_model(name, device="cpu")


WORDS = "red orange yellow green cyan blue violet the sky is and a prime number of legs".split()


def random_workload(rng: random.Random) -> Workload:
    """Random lengths, arrivals, forks, shared prefixes, tenants, pool sizes (with preemption)."""
    system = " ".join(rng.choices(WORDS, k=rng.randint(2, 10)))
    reqs = []
    for i in range(rng.randint(2, 6)):
        r = {"id": f"r{i}", "max_new_tokens": rng.randint(1, 8), "arrival_step": rng.randint(0, 6)}
        if reqs and rng.random() < 0.25:
            parent = rng.choice(reqs)
            r.update(parent=parent["id"], arrival_step=max(r["arrival_step"], parent["arrival_step"]))
            if rng.random() < 0.5:
                r["prompt"] = " " + rng.choice(WORDS)
        else:
            own = " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))
            r["prompt"] = f"{system} {own}" if rng.random() < 0.6 else own
            r["cache_salt"] = rng.choice([None, "t1", "t2"])
        reqs.append(r)
    tight = rng.random() < 0.3
    engine = {"block_size": rng.choice([1, 4, 8]), "num_blocks": 256, "max_batch_tokens": rng.choice([8, 32, 256]),
              "isolation": rng.choice(["paged", "masked"]), "prefix_caching": rng.random() < 0.8}
    wl = Workload.from_dict({"requests": reqs, "engine": engine, "seed": rng.randint(0, 9)})
    if tight:  # a pool barely larger than the longest request: preemption and eviction
        longest = 200  # bytes of the byte tokenizer, bounded by the word list above
        wl = Workload.from_dict({**wl.to_dict(), "engine": {**engine, "num_blocks": longest // engine["block_size"]}})
    return wl


@pytest.mark.parametrize("seed", range(50))
def test_random_controls_are_exactly_clean(seed):
    rng = random.Random(seed)
    wl = random_workload(rng)
    run = run_checked(model(["tiny-llama", "tiny-gpt2"][seed % 2]), wl)
    s = run.summary()
    assert run.findings == [], run.findings[:3]
    assert s["leak"]["max_foreign_mass"] == 0 and s["leak"]["counts"]["foreign"] == 0
    assert s["leak"]["counts"]["stale"] == 0 and s["leak"]["counts"]["own"] > 0
    assert s["divergence"]["diverged_requests"] == 0, run.divergences
    assert all(d.classification in ("identical", "batch_variance") for d in run.divergences)


FAULTED = [s for s in SCENARIOS.values() if s.fault]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("sc", FAULTED, ids=lambda s: s.name)
def test_every_fault_is_detected_and_its_control_is_clean(sc, name):
    m = model(name)
    wl = Workload.from_dict(sc.build(m.tokenizer))
    faulty = run_checked(m, wl, sc.fault)
    kinds = {f.kind for f in faulty.findings}
    assert kinds & set(sc.expected), f"{sc.fault} raised {kinds}, expected one of {sc.expected}"
    control = run_checked(m, wl)
    assert control.findings == [] and control.summary()["divergence"]["diverged_requests"] == 0


def unsalted_runs():
    """The unsalted fault on tiny-llama with each step's record, and its control (salts honoured)."""
    m = model("tiny-llama")
    wl = Workload.from_dict(SCENARIOS["unsalted_prefix"].build(m.tokenizer))
    steps = []
    return run_checked(m, wl, "unsalted_prefix", on_step=steps.append), steps, run_checked(m, wl)


def test_unsalted_prefix_is_one_cross_tenant_finding_per_block_read_not_foreign_attention():
    """B hits A's prompt blocks under another salt: one finding per block B read, naming the block,
    B's steps (first read to last), every layer (null), no head and no mass; nothing foreign. The
    control shares no block across tenants and has no finding."""
    run, steps, control = unsalted_runs()
    assert {f.kind for f in run.findings} == {"cross_tenant"}
    assert run.summary()["leak"]["max_foreign_mass"] == 0
    hit = [e.block for r in steps for e in r.events if e.kind == "hit" and e.request == "B"]
    b_steps = [r.step for r in steps if "B" in r.work]
    assert len(hit) > 1 and b_steps == list(range(b_steps[0], b_steps[-1] + 1))
    assert sorted(f.block for f in run.findings) == sorted(hit)  # each block B was served, once
    first = next(r.work["B"][0] for r in steps if r.step == b_steps[0])  # B's first position: after the hit
    for f in run.findings:
        assert (f.request, f.source_request) == ("B", "A")
        assert (f.layer, f.head, f.mass) == (None, None, None)
        assert (f.step, f.last_step, f.position) == (b_steps[0], b_steps[-1], first)
    assert all(d.classification in ("identical", "batch_variance") for d in run.divergences)
    said = run.summary()["cross_tenant"]
    assert said.startswith(f"cross-tenant reads: {len(hit)} blocks of tenant-a read by tenant-b (B "
                           f"read blocks ")
    assert control.findings == [] and control.summary()["cross_tenant"] is None
    assert not any(e.kind == "hit" for r in steps for e in r.events if e.request == "A")


def test_a_cross_tenant_read_is_taken_once_it_has_ended():
    """A server records findings as it goes: take_findings leaves a read that goes on (its last step
    may grow) and gives it the step after its reader stopped reading; together they are the run's."""
    m = model("tiny-llama")
    wl = SCENARIOS["unsalted_prefix"].build(m.tokenizer)
    wl["requests"].append({"id": "C", "prompt": wl["requests"][1]["prompt"], "max_new_tokens": 9, "arrival_step": 3,
                           "cache_salt": "tenant-c"})  # reads A's blocks too, and goes on after B has finished
    wl = Workload.from_dict(wl)
    oracle = ProvenanceOracle()
    taken: dict[int, list] = {}
    steps = []

    def on_step(r) -> None:
        steps.append(r)
        taken[r.step] = oracle.take_findings()

    whole = run_checked(m, wl, "unsalted_prefix", reference=False)
    run_checked(m, wl, "unsalted_prefix", oracle=oracle, reference=False, on_step=on_step)
    rest = oracle.take_findings(final=True)
    b_last = max(r.step for r in steps if "B" in r.work)
    assert b_last < steps[-1].step
    assert {f.request for f in taken[b_last + 1]} == {"B"} and all(f.last_step == b_last for f in taken[b_last + 1])
    assert all(not found for s, found in taken.items() if s != b_last + 1)  # C reads up to the last step
    assert {f.request for f in rest} == {"C"} and oracle.findings == [] and oracle.open_reads == {}
    key = lambda f: (f.request, f.block)  # noqa: E731
    assert sorted(map(key, taken[b_last + 1] + rest)) == sorted(map(key, whole.findings))
    assert [f.to_dict() for f in sorted(taken[b_last + 1] + rest, key=key)] == \
        [f.to_dict() for f in sorted(whole.findings, key=key)]


def test_findings_name_the_source_request():
    m = model("tiny-llama")
    run = run_checked(m, Workload.from_dict(SCENARIOS["global"].workload), "global")
    sources = {(f.request, f.source_request) for f in run.findings if f.kind == "foreign"}
    assert ("A", "B") in sources and ("B", "A") in sources
    assert all(d.classification == "leak" for d in run.divergences)


def test_softmax_then_mask_is_a_normalisation_error_without_foreign_mass():
    m = model("tiny-gpt2")
    run = run_checked(m, Workload.from_dict(SCENARIOS["softmax_then_mask"].workload), "softmax_then_mask")
    assert {f.kind for f in run.findings} == {"normalisation"}
    assert run.summary()["leak"]["max_foreign_mass"] == 0
    assert all(d.classification == "divergence" for d in run.divergences)


def test_fault_for_the_other_mechanism_and_unknown_fault_are_refused():
    wl = Workload.from_dict(SCENARIOS["softmax_then_mask"].workload)  # paged
    with pytest.raises(FaultMismatch, match="masked mechanism"):
        run_checked(model("tiny-llama"), wl, "boundary")
    with pytest.raises(UnknownFault, match="the catalogue"):
        run_checked(model("tiny-llama"), wl, "cosmic_ray")


def test_catalogue_has_every_fault_of_the_issue():
    assert set(FAULTS) == {
        "boundary", "global", "positional", "padding_as_isolation", "softmax_then_mask", "additive_mask_sum",
        "low_precision_fill", "zero_block_table", "missing_cow", "early_free", "stale_hash", "unsalted_prefix",
        "wrong_slot_mapping", "offload_wrong_block", "offload_stale_restore", "transfer_wrong_request",
        "transfer_failed_silently", "untagged_namespace", "stale_hash_after_truncate", "partial_hash_promoted",
        "host_tier_unsalted", "hash_before_write", "offload_after_free", "wrong_key_insert", "block_boundary",
        "uncounted_restore"}
    assert {s.fault for s in FAULTED} == set(FAULTS)


def passphrase_weights(m, fault):
    from kvviz.catalogue.faults import defences_with

    wl = Workload.from_dict(SCENARIOS["passphrase"].build(m.tokenizer))
    a_len = len(m.tokenizer(wl.requests[0].prompt).input_ids)
    probe = LastPromptTokenProbe("A", a_len - 1)
    cfg = wl.engine
    result = Engine(m, cfg, defences_with(fault, cfg.block_size)).run(wl, observers=[probe])
    on_b = sum(k.weight for k in probe.weights if k.writer == "B")
    on_a = sum(k.weight for k in probe.weights if k.writer == "A")
    return on_a, on_b, result.requests[0].output_ids


@pytest.mark.parametrize("name", ["tiny-llama", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_passphrase_boundary_reaches_into_the_other_request(name):
    m = model(name)
    own, other, clean_out = passphrase_weights(m, None)
    assert other == 0 and own == pytest.approx(1.0, abs=1e-5)
    own_f, other_f, faulty_out = passphrase_weights(m, "boundary")
    assert other_f > 0.01, f"boundary fault put only {other_f} on B's slots"
    assert faulty_out != clean_out, "the continuation must change"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_random_controls_are_clean_on_smollm2(seed):
    run = run_checked(model("smollm2"), random_workload(random.Random(1000 + seed)))
    assert run.findings == [] and run.summary()["divergence"]["diverged_requests"] == 0


def test_positional_entropy_is_zero_for_a_single_key_and_grows_with_context():
    from kvviz.oracle import ProvenanceOracle

    m = model("tiny-llama")
    oracle = ProvenanceOracle()
    wl = Workload.from_dict({"requests": [{"id": "A", "prompt_ids": [5], "max_new_tokens": 6}]})
    Engine(m, wl.engine).run(wl, observers=[oracle])
    first, last = oracle.steps[0], oracle.steps[-1]
    assert float(first.sum_entropy.abs().max()) < 1e-6  # position 0 sees only itself
    assert float(last.sum_entropy.min()) > 0
    assert float(last.sum_entropy.max()) <= torch.log(torch.tensor(6.0)) + 1e-5  # at most uniform over 6 keys


def test_fault_scope_confines_a_fault_to_steps_requests_and_layers():
    from kvviz.catalogue.faults import Scope

    m = model("tiny-llama")
    three = Workload.from_dict(SCENARIOS["padding_as_isolation"].workload)  # masked, requests A, B, C
    only_c = run_checked(m, three, "padding_as_isolation", scope=Scope(requests=frozenset({"C"})))
    assert {f.request for f in only_c.findings} == {"C"}
    late = run_checked(m, three, "padding_as_isolation", scope=Scope(steps=frozenset({4, 5})))
    assert late.findings and {f.step for f in late.findings} <= {4, 5}
    paged = Workload.from_dict(SCENARIOS["softmax_then_mask"].workload)
    layer1 = run_checked(m, paged, "softmax_then_mask", scope=Scope(layers=frozenset({1})))
    assert layer1.findings and {f.layer for f in layer1.findings} == {1}


def test_non_finite_weights_are_counted_per_row():
    from kvviz.engine import Defences
    from kvviz.engine.defences import grouped_attend, masked_softmax

    def nan_two(logits, mask):  # two NaN weights in the last query's row of every head
        p = masked_softmax(logits, mask).clone()
        p[..., -1, :2] = float("nan")
        return p

    def attend(q, k, v, mask, scale, layer=None):  # only in the last layer, so nothing propagates further
        return grouped_attend(q, k, v, mask, scale, nan_two if layer == 1 else masked_softmax)

    d = Defences(attend=attend)
    m = model("tiny-llama")
    wl = Workload.from_dict({"requests": [{"id": "A", "prompt_ids": [1, 2, 3, 4], "max_new_tokens": 1}]})
    from kvviz.oracle import ProvenanceOracle

    oracle = ProvenanceOracle()
    Engine(m, wl.engine, d).run(wl, observers=[oracle])
    found = [f for f in oracle.findings if f.kind == "non_finite"]
    assert found and found[0].mass == 2 and found[0].position == 3


def test_the_boundary_scenario_says_what_it_runs_and_who_reads_whom():
    """Its text quotes the prompts it runs (not the seed's colour words, which the passphrase scenario
    runs) and names a leak the oracle finds: A reading B (B reads A too, once A's new blocks lie after its)."""
    sc, m = SCENARIOS["boundary"], model("tiny-llama")
    wl = Workload.from_dict(sc.build(m.tokenizer))
    assert all(f"'{r.prompt}'" in sc.explanation for r in wl.requests)
    foreign = [f for f in run_checked(m, wl, sc.fault, reference=False).findings if f.kind == "foreign"]
    assert ("A", "B") in {(f.request, f.source_request) for f in foreign}


def test_the_seed_table_merges_a_request_s_byte_pieces_by_position_when_its_blocks_lie_out_of_order():
    """transformers places a request's later blocks at lower block ids: pieces of one character then lie
    apart in physical order. The table merges them by position and shows a trailing piece instead of
    dropping its weight."""
    from kvviz.oracle.probe import KeyWeight

    tok = model("tiny-llama").tokenizer
    ids = tok("红 橙", add_special_tokens=False).input_ids  # 红 and 橙 are three byte pieces each
    assert [tok.decode(ids[:3]), tok.decode(ids[4:])] == ["红", "橙"]
    block = 2  # positions 0-1 in the last block, 2-3 before it, ...: each character straddles two blocks
    slot = {p: (len(ids) // block - p // block) * block + p % block for p in range(len(ids))}
    probe = LastPromptTokenProbe("A", len(ids) - 1)
    probe.weights = [KeyWeight(slot[p], "A", p, t, 0.1) for p, t in enumerate(ids)]
    probe.weights.append(KeyWeight(40, "B", 0, ids[0], 0.05))
    assert probe.table(tok).splitlines() == ["       A | '红' 0.30  ' ' 0.10  '橙' 0.30", "       B | '\ufffd' 0.05"]


def test_an_own_key_read_twice_is_a_duplicate_and_the_request_beside_it_in_the_step_is_clean():
    """Two groups in one step, the larger judged first (the oracle's buffers are reused for the smaller):
    B's last query weighs its own last key twice (its slot twice on the key axis), A's queries weigh
    only their own keys, with unwritten slots on the axis at weight 0."""
    from kvviz.engine.attention import AttentionGroup
    from kvviz.engine.hashing import prefix_ids
    from kvviz.engine.observer import StepContext
    from kvviz.engine.plan import ScheduledWork
    from kvviz.engine.provenance import SlotProvenance

    prov, tokens = SlotProvenance(16), {"A": [7, 8, 9], "B": [4, 5, 6]}
    ids = {rid: prefix_ids(t) for rid, t in tokens.items()}
    for rid, base in (("A", 0), ("B", 4)):
        for j, tok in enumerate(tokens[rid]):
            prov.record(base + j, ids[rid][j], j, tok, rid, None, 1)
    ctx = StepContext(
        step=0,
        work=[ScheduledWork(rid, 0, tokens[rid], [b]) for rid, b in (("A", 0), ("B", 1))],
        q_row=torch.tensor([0, 0, 0, 1, 1, 1]),
        q_pos=torch.tensor([0, 1, 2] * 2),
        block_size=4,
        provenance=prov,
        block_lifetimes=[1] * 4,
        prefix_ids=[ids["A"], ids["B"]],
        tenants=[None, None],
    )

    def group(start: int, slots: list[int], reads: list[list[int]]) -> tuple[AttentionGroup, torch.Tensor]:
        mask = torch.tensor([[[k in row for k in range(len(slots))] for row in reads]])
        probs = (mask / mask.sum(-1, keepdim=True)).float()[:, None].expand(1, 2, 3, len(slots)).contiguous()
        return AttentionGroup(start, torch.tensor([slots]), mask), probs

    a = group(0, [0, 1, 2, 3, 8, 9], [[0], [0, 1], [0, 1, 2]])  # slots 3, 8, 9 never written
    b = group(3, [4, 5, 6, 6], [[0], [0, 1], [0, 1, 2, 3]])
    oracle = ProvenanceOracle()
    oracle.begin_step(ctx)
    for layer in range(2):
        for g, probs in (a, b):
            oracle.on_attention(layer, g, probs)
    oracle.end_step()
    found = [(f.kind, f.request, f.position, f.mass) for f in oracle.findings]
    assert found == [("duplicate", "B", 2, 1.0)]
    # every visible own key counted once per head and layer: A 1+2+3, B 1+2+4
    assert oracle.counts == {"own": 2 * 2 * (6 + 7), "foreign": 0, "stale": 0}
    assert oracle.summary()["max_foreign_mass"] == 0.0
