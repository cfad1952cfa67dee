"""The bug classes of 2026: a host tier keyed without the salt, hashes published before the write, an
offload copy that runs after the block was given away, K/V inserted under the wrong key, a shared prefix
that ends on a block boundary, and telemetry that lies. Each is caught by the oracles on workloads it
was not written for (they never read which fault runs), and every control stays clean."""

from __future__ import annotations

import functools
import random

import pytest

from kvviz.catalogue.faults import FAULTS
from kvviz.catalogue.scenarios import SCENARIOS
from kvviz.engine import Engine
from kvviz.engine.workload import Workload, WorkloadError
from kvviz.models import load_model
from kvviz.runners.checked import run_checked

NEW_FAULTS = ["host_tier_unsalted", "hash_before_write", "offload_after_free", "wrong_key_insert", "block_boundary",
              "uncounted_restore"]
WORDS = "red orange yellow green cyan blue violet the sky is and a prime number of legs".split()


@functools.cache
def model(name):
    return load_model(name, device="cpu")


def test_every_new_class_has_its_scenario_and_says_what_it_mirrors():
    assert set(NEW_FAULTS) <= set(FAULTS)
    assert set(NEW_FAULTS) <= {s.fault for s in SCENARIOS.values()}
    assert all(FAULTS[f].mirrors and FAULTS[f].expected for f in NEW_FAULTS)


# -- a request the client abandons ---------------------------------------------------------------------
def _abandoned(cancel_step: int | None) -> Workload:
    return Workload.from_dict({"requests": [
        {"id": "A", "prompt": "a long prompt prefilled in chunks", "max_new_tokens": 4, "cancel_step": cancel_step},
        {"id": "B", "prompt": "another one", "max_new_tokens": 3, "arrival_step": 1}],
        "engine": {"block_size": 4, "max_batch_tokens": 6}})


def test_a_cancelled_request_stops_where_it_is_and_frees_its_blocks():
    m = model("tiny-llama")
    events = []
    result = Engine(m, _abandoned(2).engine).run(_abandoned(2), on_step=lambda rec: events.extend(rec.events))
    a, b = result.requests
    assert a.finish_reason == "cancelled" and a.output_ids == [] and a.finish_step == 2
    assert b.finish_reason in ("eos", "length") and len(b.output_ids) == 3
    held = {}
    for e in events:
        if e.request == "A" and e.kind in ("allocate", "free"):
            held[e.block] = e.kind
    assert held and set(held.values()) == {"free"}, "every block A took was given back"
    run = run_checked(m, _abandoned(2))
    assert run.findings == [] and run.summary()["divergence"]["diverged_requests"] == 0


@pytest.mark.parametrize("backend", ["transformers", "llama.cpp"])
def test_every_backend_cancels_where_the_workload_says(backend):
    """The driver cancels for every engine: the request ends there with nothing left held, and the rest runs
    clean, its reply's telemetry checked too."""
    wl = Workload.from_dict({**_abandoned(2).to_dict(), "engine": {**_abandoned(2).engine.to_dict(),
                                                                   "backend": backend}})
    run = run_checked(model("tiny-llama"), wl)
    a, b = run.result.requests
    assert a.finish_reason == "cancelled" and a.output_ids == [] and len(b.output_ids) == 3
    assert run.findings == [] and run.summary()["divergence"]["diverged_requests"] == 0


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5])
def test_cancel_step_must_come_after_the_arrival(bad):
    with pytest.raises(WorkloadError, match=r"requests\[0\]\.cancel_step: must be null or an integer after"):
        _abandoned(bad)


# -- telemetry checked on every run ---------------------------------------------------------------------
def test_the_telemetry_check_fires_on_a_reply_that_misreports_and_not_on_a_true_one():
    """No fault runs: the oracle's record of what a request was served, checked against replies that say
    fewer tokens, more tokens, and the true number."""
    m = model("tiny-llama")
    wl = Workload.from_dict(SCENARIOS["control_shared_system_prompt"].build(m.tokenizer))
    run = run_checked(m, wl)
    assert run.findings == []  # every reply of the run checked, and each true
    served = {r.id: r.cached_tokens for r in run.result.requests}
    hit = next(r for r, n in served.items() if n > 0)
    for said in (0, served[hit] + 4, served[hit]):
        oracle = _unchecked(m, wl)
        f = oracle.check_telemetry(hit, said)
        if said == served[hit]:
            assert f is None and oracle.findings == []
        else:
            assert f is not None and f.kind == "telemetry_mismatch" and oracle.findings == [f]
            assert f.position == served[hit] and f.mass == said and f.source_request not in (None, hit)


def _unchecked(m, wl: Workload):
    """The provenance oracle after a run, before any reply was checked."""
    from kvviz.oracle import ProvenanceOracle

    oracle = ProvenanceOracle()
    Engine(m, wl.engine).run(wl, observers=[oracle])
    return oracle


# -- held out ----------------------------------------------------------------------------------------------
def held_out_workload(rng: random.Random) -> Workload:
    """Random workloads with what the new classes need (two salted tenants and an adapter on one system
    prompt, chunked prefill, an abandoned request, a tight pool over a host tier), none a scenario's own."""
    def text(k: int) -> str:
        return " ".join(rng.choices(WORDS, k=k))

    B = rng.choice([2, 4, 8])
    system = text(rng.randint(4, 8))
    reqs = [{"id": "a", "prompt": f"{system} {text(2)}", "max_new_tokens": rng.randint(2, 5), "cache_salt": "t1"},
            {"id": "x", "prompt": f"{system} {text(2)}", "max_new_tokens": rng.randint(1, 3), "adapter": "style",
             "arrival_step": rng.randint(1, 3), "cancel_step": rng.choice([None, 6])},
            {"id": "y", "prompt": f"{system} {text(3)}", "max_new_tokens": 3, "arrival_step": rng.randint(7, 9)}]
    for i in range(rng.randint(1, 3)):  # pressure: other prompts push the system prompt out to the host
        reqs.append({"id": f"n{i}", "prompt": text(rng.randint(8, 14)), "max_new_tokens": rng.randint(1, 3),
                     "arrival_step": 10 + 3 * i, "cache_salt": rng.choice([None, "t1", "t2"])})
    reqs.append({"id": "v", "prompt": f"{system} {text(1)}", "max_new_tokens": 2, "arrival_step": 20})  # y's tenant
    reqs.append({"id": "b", "prompt": f"{system} {text(2)}", "max_new_tokens": 3,
                 "cache_salt": rng.choice(["t1", "t2"]), "arrival_step": 22})
    story = text(rng.randint(6, 10))  # a prompt of its own, abandoned (or not) during its prefill, then sent again
    reqs.append({"id": "z", "prompt": f"{story} {text(2)}", "max_new_tokens": 2, "arrival_step": 32,
                 "cancel_step": 33 if rng.random() < 0.7 else None})
    reqs.append({"id": "w", "prompt": f"{story} {text(3)}", "max_new_tokens": 2, "arrival_step": 35})
    longest = max(len(r["prompt"]) for r in reqs) + 16
    engine = {"block_size": B, "num_blocks": -(-longest // B) + rng.randint(1, 4),
              "max_batch_tokens": rng.choice([5, 7, 11, 13]), "offload": {"cpu_blocks": rng.choice([4, 8, 64])}}
    return Workload.from_dict({"requests": reqs, "engine": engine, "seed": rng.randint(0, 9)})


class ContentProbe:
    """An observer that reads no attention: at every step, whether any request's page table holds, before
    the positions it computes now, a slot that is not its own K/V (written in the block's current life, at
    that position, from its own prefix). Where it says so, the fault struck, and the oracles must see it."""

    def __init__(self) -> None:
        self.wrong = False

    def begin_step(self, ctx) -> None:
        prov, B = ctx.provenance, ctx.block_size
        for r, w in enumerate(ctx.work):
            for p in range(w.start):
                s = w.block_table[p // B] * B + p % B
                if not (prov.life[s] == ctx.block_lifetimes[s // B] and prov.pos[s] == p
                        and prov.prefix[s] == ctx.prefix_ids[r][p]):
                    self.wrong = True
                    return

    def on_attention(self, layer, group, probs) -> None:
        pass

    def end_step(self) -> None:
        pass


def _struck(fault: str, faulty, control, probe: ContentProbe) -> bool:
    """Whether the fault changed what a request was served: K/V not its own in its page table; or, where
    the content stays right, what the replies say they were served (blocks of another tenant: the same
    words; restored tokens a reply leaves out)."""
    if fault in ("host_tier_unsalted", "uncounted_restore"):
        return [r.cached_tokens for r in faulty.result.requests] != [r.cached_tokens for r in control.result.requests]
    return probe.wrong


@pytest.mark.slow
def test_new_classes_are_caught_on_held_out_workloads_and_controls_stay_clean():
    """The provenance oracle (and the telemetry check) alone must catch each: the faulty runs skip the
    reference comparison; the scenarios' tests run both oracles on both tiny models."""
    m, struck = model("tiny-llama"), dict.fromkeys(NEW_FAULTS, 0)
    for seed in range(5):
        wl = held_out_workload(random.Random(seed))
        control = run_checked(m, wl)
        assert control.findings == [] and control.summary()["divergence"]["diverged_requests"] == 0, seed
        for fault in NEW_FAULTS:
            probe = ContentProbe()
            faulty = run_checked(m, wl, fault, probes=[probe], reference=False)
            if not _struck(fault, faulty, control, probe):
                continue
            struck[fault] += 1
            caught = {f.kind for f in faulty.findings}
            assert caught & set(FAULTS[fault].expected), f"{fault} struck on seed {seed}; the oracles saw {caught}"
    assert all(n >= 2 for n in struck.values()), str(struck)  # every class struck: the test can fail
