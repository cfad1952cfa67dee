"""Engine behaviour beyond equivalence: numerics of the attend paths, scheduling limits, sampling,
stopping, restoring the model, and the pool staying consistent through real runs."""

from __future__ import annotations

import collections
import functools

import pytest
import torch

from kvviz.engine import Engine, EngineConfig
from kvviz.engine.defences import masked_softmax_attend, sdpa_attend
from kvviz.engine.workload import Workload, WorkloadError
from kvviz.models import load_model

from .engine_workloads import make, workloads


@functools.cache
def tiny():
    return load_model("tiny-llama")


def test_attend_paths_agree_and_empty_rows_are_zero_not_nan():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 5, 2, 8, generator=g),
               torch.randn(2, 5, 2, 8, generator=g))
    mask = torch.rand(2, 3, 5, generator=g) > 0.4
    mask[1, 2] = False  # a query with no visible key
    out, probs = masked_softmax_attend(q, k, v, mask, 0.35)
    fast = sdpa_attend(q, k, v, mask, 0.35)
    assert torch.isfinite(out).all() and torch.isfinite(fast).all()
    assert torch.allclose(out, fast, atol=1e-5)
    assert probs[1, :, 2].abs().sum() == 0 and out[1, 2].abs().sum() == 0
    visible = mask.any(-1)
    assert torch.allclose(probs.sum(-1)[visible[:, None].expand(-1, 4, -1)], torch.tensor(1.0))
    assert (probs.masked_select(~mask[:, None].expand_as(probs)) == 0).all()


def test_gqa_head_mapping_matches_repeat_kv():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 6, 4, generator=g)
    k, v = torch.randn(1, 3, 2, 4, generator=g), torch.randn(1, 3, 2, 4, generator=g)
    mask = torch.ones(1, 2, 3, dtype=torch.bool)
    _, probs = masked_softmax_attend(q, k, v, mask, 0.5)
    for h in range(6):  # query head h reads KV head h // 3
        expect = torch.softmax(q[0, :, h] @ k[0, :, h // 3].T * 0.5, -1)
        assert torch.allclose(probs[0, h], expect, atol=1e-6)


def run(wl_dict, **kw):
    wl = Workload.from_dict(wl_dict)
    records = []
    result = Engine(tiny(), wl.engine).run(wl, on_step=records.append, **kw)
    return result, records


@pytest.mark.parametrize("name", list(workloads(load_model("tiny-llama").tokenizer)))
def test_budget_and_pool_consistency_at_every_step(name):
    wl = make(workloads(tiny().tokenizer)[name], "paged", "fast")
    records = []
    Engine(tiny(), wl.engine).run(wl, on_step=records.append)
    for rec in records:
        assert sum(n for _, n in rec.work.values()) <= wl.engine.max_batch_tokens
        snap = rec.snapshot
        refs = collections.Counter(b for t in snap.page_tables.values() for b in t)
        assert [refs[b] for b in range(len(snap.refcounts))] == list(snap.refcounts)
        assert set(snap.free_queue) == {b for b, c in enumerate(snap.refcounts) if c == 0}


def test_sampling_is_reproducible_and_seeded():
    req = {"id": "A", "prompt": "red orange", "max_new_tokens": 16, "temperature": 1.5, "top_p": 0.9}
    other = {"id": "B", "prompt": "green cyan blue", "max_new_tokens": 8}
    a1 = run({"requests": [req], "seed": 7})[0].requests[0].output_ids
    a2 = run({"requests": [req, other], "seed": 7})[0].requests[0].output_ids
    a3 = run({"requests": [req], "seed": 8})[0].requests[0].output_ids
    greedy = run({"requests": [{**req, "temperature": 0}]})[0].requests[0].output_ids
    assert a1 == a2, "a request's samples must not depend on what else is batched"
    assert a1 != a3 and a1 != greedy


def test_top_p_keeps_the_smallest_nucleus():
    from kvviz.engine.sampler import sample

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    picks = {sample(logits, 1.0, 0.7, g) for _ in range(200)}
    assert picks == {0, 1}


def test_stop_on_eos_unless_ignored():
    engine_cfg = {"block_size": 4, "num_blocks": 32}
    first = run({"requests": [{"id": "A", "prompt": "abc", "max_new_tokens": 5}], "engine": engine_cfg})[0]
    tok = first.requests[0].output_ids[0]
    eng = Engine(tiny(), EngineConfig(**engine_cfg))
    eng.eos_ids = {tok}
    stopped = eng.run(Workload.from_dict({"requests": [{"id": "A", "prompt": "abc", "max_new_tokens": 5}]}))
    assert stopped.requests[0].output_ids == [tok] and stopped.requests[0].finish_reason == "eos"
    kept = eng.run(Workload.from_dict({"requests": [{"id": "A", "prompt": "abc", "max_new_tokens": 5,
                                                      "ignore_eos": True}]}))
    assert kept.requests[0].output_ids == first.requests[0].output_ids
    assert kept.requests[0].finish_reason == "length"


def test_model_attention_is_restored_even_after_an_error():
    m = tiny()
    before = m.model.config._attn_implementation

    def boom(rec):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Engine(m, EngineConfig()).run(Workload.from_dict({"requests": [{"id": "A", "prompt": "a"}]}), on_step=boom)
    assert m.model.config._attn_implementation == before


def test_requests_that_cannot_fit_are_refused_up_front():
    with pytest.raises(WorkloadError, match=r"requests\[0\]: may reach 104 tokens but the pool holds 32"):
        run({"requests": [{"id": "A", "prompt_ids": list(range(100)), "max_new_tokens": 4}],
             "engine": {"block_size": 4, "num_blocks": 8}})
    with pytest.raises(WorkloadError, match=r"requests\[0\].prompt_ids: token 999 is outside"):
        run({"requests": [{"id": "A", "prompt_ids": [1, 999]}]})


def test_idle_steps_until_a_late_arrival():
    result, records = run({"requests": [{"id": "A", "prompt": "ab", "max_new_tokens": 2},
                                        {"id": "B", "prompt": "cd", "max_new_tokens": 2, "arrival_step": 9}]})
    assert result.requests[1].first_token_step == 9
    assert [r.step for r in records] == [0, 1, 9, 10]


def test_request_latencies_follow_the_steps_that_produced_the_tokens():
    result, records = run({"requests": [{"id": "A", "prompt": "ab", "max_new_tokens": 4},
                                        {"id": "B", "prompt": "cd", "max_new_tokens": 1, "arrival_step": 2}]})
    a, b = result.requests
    assert 0 < a.first_token_seconds < a.finish_seconds <= result.stats.seconds
    assert a.first_token_seconds <= b.first_token_seconds == b.finish_seconds  # B came later, one token
    assert a.seconds_per_output_token == pytest.approx((a.finish_seconds - a.first_token_seconds) / 3)
    assert b.seconds_per_output_token == 0.0


BAD_WORKLOADS = [
    ([], "workload: must be a JSON object"),
    ({}, "requests: must be a non-empty list"),
    ({"requests": [{"id": "A", "prompt": "x"}], "extra": 1}, "workload.extra: unknown field"),
    ({"requests": ["A"]}, r"requests\[0\]: must be an object"),
    ({"requests": [{"prompt": "x"}]}, r"requests\[0\].id: must be a non-empty string"),
    ({"requests": [{"id": "A", "prompt": "x"}, {"id": "A", "prompt": "y"}]},
     r"requests\[1\].id: 'A' is already the id of requests\[0\]"),
    ({"requests": [{"id": "A"}]}, r"requests\[0\]: needs a non-empty prompt"),
    ({"requests": [{"id": "A", "prompt": "x", "prompt_ids": [1]}]}, "not both"),
    ({"requests": [{"id": "A", "prompt": 5}]}, r"requests\[0\].prompt: must be a string"),
    ({"requests": [{"id": "A", "prompt_ids": [1, -2]}]}, r"requests\[0\].prompt_ids: must be a list of non-negative"),
    ({"requests": [{"id": "A", "prompt": "x", "max_new_tokens": 0}]}, r"max_new_tokens: must be an integer >= 1"),
    ({"requests": [{"id": "A", "prompt": "x", "max_new_tokens": True}]}, r"max_new_tokens: must be an integer"),
    ({"requests": [{"id": "A", "prompt": "x", "arrival_step": -1}]}, r"arrival_step: must be an integer >= 0"),
    ({"requests": [{"id": "A", "prompt": "x", "cache_salt": 3}]}, r"cache_salt: must be a string or null"),
    ({"requests": [{"id": "A", "prompt": "x", "top_p": 0}]}, r"top_p: must be a number in \(0, 1\]"),
    ({"requests": [{"id": "A", "prompt": "x", "temperature": "hot"}]}, r"temperature: must be a number >= 0"),
    ({"requests": [{"id": "A", "prompt": "x", "colour": "red"}]}, r"requests\[0\].colour: unknown field"),
    ({"requests": [{"id": "B", "parent": "A"}]}, r"requests\[0\].parent: 'A' is not an earlier request"),
    ({"requests": [{"id": "A", "prompt": "x", "arrival_step": 3}, {"id": "B", "parent": "A"}]},
     r"requests\[1\].arrival_step: a fork cannot arrive before its parent 'A' \(request 'B', row 2\)"),
    ({"requests": [{"id": "A", "prompt": "x", "cache_salt": "t1"}, {"id": "B", "parent": "A", "cache_salt": "t2"}]},
     r"requests\[1\].cache_salt: a fork or a resumed session keeps its parent's cache_salt"),
    ({"requests": [{"id": "A", "prompt": "x", "adapter": "a"}, {"id": "B", "parent": "A", "adapter": "b"}]},
     r"requests\[1\].adapter: a fork or a resumed session keeps its parent's adapter"),
    ({"requests": [{"id": "A", "prompt": "x", "adapter": " "}]}, r"requests\[0\].adapter: must be a non-empty string"),
    ({"requests": [{"id": "A", "prompt": "x", "truncate": 3}]}, r"requests\[0\].truncate: cuts the parent's session"),
    ({"requests": [{"id": "A", "prompt": "x"}, {"id": "B", "parent": "A", "truncate": -1}]},
     r"requests\[1\].truncate: must be an integer >= 0"),
    ({"requests": [{"id": "A", "prompt": "x"}, {"id": "B", "parent": "A", "truncate": 0}]},
     r"requests\[1\]: truncate 0 keeps none"),
    ({"requests": [{"id": "A", "prompt": "x"}], "engine": {"offload": 8}}, r"engine.offload: must be an object"),
    ({"requests": [{"id": "A", "prompt": "x"}], "engine": {"offload": {"gpu_blocks": 8}}},
     r"engine.offload.gpu_blocks: unknown setting"),
    ({"requests": [{"id": "A", "prompt": "x"}], "engine": {"offload": {"cpu_blocks": 0}}},
     r"engine.offload.cpu_blocks: must be a positive integer"),
    ({"requests": [{"id": "A", "prompt": "x"}], "engine": []}, "engine: must be an object"),
    ({"requests": [{"id": "A", "prompt": "x"}], "engine": {"block_size": 0}}, "engine.block_size: must be a positive"),
    ({"requests": [{"id": "A", "prompt": "x"}], "engine": {"isolation": "none"}}, "engine.isolation: must be one of"),
    ({"requests": [{"id": "A", "prompt": "x"}], "engine": {"compute": "gpu"}}, "engine.compute: must be one of"),
    ({"requests": [{"id": "A", "prompt": "x"}], "engine": {"prefix_caching": "yes"}}, "engine.prefix_caching"),
    ({"requests": [{"id": "A", "prompt": "x"}], "engine": {"pages": 3}}, "engine.pages: unknown engine setting"),
    ({"requests": [{"id": "A", "prompt": "x"}], "seed": -1}, "seed: must be a non-negative integer"),
    ({"requests": [{"id": "A", "prompt": "x"}, {"id": "B", "prompt": "y"}, {"id": "A", "prompt": "z"}]},
     r"requests\[2\].id: 'A' is already the id of requests\[0\] \(row 1\)"),
]


@pytest.mark.parametrize("bad,message", BAD_WORKLOADS)
def test_malformed_workloads_name_the_field(bad, message):
    with pytest.raises(WorkloadError, match=message):
        Workload.from_dict(bad)


def test_workload_round_trips_through_to_dict():
    wl = make(workloads(tiny().tokenizer)["forks_copy_on_write"], "masked", "fast")
    assert Workload.from_dict(wl.to_dict()) == wl


def test_requests_admitted_together_compute_a_shared_prefix_once():
    system = list(range(10, 42))  # 8 full blocks of 4
    reqs = [{"id": f"r{i}", "prompt_ids": system + [50 + i] * 3, "max_new_tokens": 2} for i in range(4)]
    result, records = run({"requests": reqs, "engine": {"block_size": 4, "num_blocks": 64, "max_batch_tokens": 512}})
    assert [r.cached_tokens for r in result.requests] == [0, 32, 32, 32]
    assert records[0].admitted == ["r0"]  # the others wait one step for r0's blocks
    assert result.stats.prefill_tokens_computed == 35 + 3 * 3
    off = run({"requests": reqs, "engine": {"block_size": 4, "num_blocks": 64, "max_batch_tokens": 512,
                                            "prefix_caching": False}})[0]
    assert off.stats.prefill_tokens_computed == 4 * 35


@pytest.mark.parametrize("disaggregated", [False, True])
def test_a_reset_of_the_prefix_cache_waits_for_an_idle_loop_and_goes_out_with_the_next_step(disaggregated):
    """vLLM's reset_prefix_cache: refused while a request runs; once idle, every pool (both instances
    of a disaggregated engine) forgets its hashes, and the clear events open the next step's record."""
    from kvviz.engine.workload import RequestSpec

    cfg = EngineConfig(block_size=4, num_blocks=16, max_batch_tokens=64, compute="fast", disaggregated=disaggregated)
    driver, prompt = Engine(tiny(), cfg).open(), list(range(100, 113))  # three full blocks, then one token
    loop = driver.backend

    def serve(rid: str) -> list:
        driver.add(RequestSpec(rid, prompt_ids=prompt, max_new_tokens=2, arrival_step=loop.step), prompt)
        records = [driver.advance()]
        assert driver.busy and not loop.reset_prefix_cache(), "refused while a request runs"
        while driver.busy:
            records.append(driver.advance())
        return records

    with torch.inference_mode():
        serve("A")
        serve("B")
        cached = {h for i in loop.instances for h in i.kv.snapshot().hashes if h is not None}
        assert driver.result("B").cached_tokens == 12 and cached
        assert loop.reset_prefix_cache()
        assert all(not i.kv.pool.cached for i in loop.instances)
        records = serve("C")
    assert driver.result("C").cached_tokens == 0
    events = records[0].events
    n = next(i for i, e in enumerate(events) if e.kind != "clear")
    assert n > 0 and {e.hash for e in events[:n]} == cached
    assert not any(e.kind == "clear" for r in records[1:] for e in r.events)


@pytest.mark.parametrize("schedule", ["fcfs", "lpm"])
def test_longest_prefix_first_admits_a_cached_prompt_ahead_of_the_queue_and_first_come_first_served_does_not(
        schedule):
    """SGLang's lpm: a prompt whose prefix is cached jumps the waiting queue (the order the audit's order
    channel reads); fcfs admits in arrival order whatever the cache holds."""
    system = list(range(10, 42))  # 8 full blocks of 4
    fresh = [[100 + 40 * i + j for j in range(32)] for i in range(4)]
    reqs = [{"id": "primer", "prompt_ids": system + [7], "max_new_tokens": 1},
            *({"id": f"d{i}", "prompt_ids": p + [7], "max_new_tokens": 1, "arrival_step": 2}
              for i, p in enumerate(fresh)),
            {"id": "probe", "prompt_ids": system + [8], "max_new_tokens": 1, "arrival_step": 2}]
    engine = {"block_size": 4, "num_blocks": 128, "max_batch_tokens": 33, "schedule": schedule}
    result, records = run({"requests": reqs, "engine": engine})
    admitted = [sid for rec in records for sid in rec.admitted]
    probe = next(r for r in result.requests if r.id == "probe")
    assert probe.cached_tokens == 32 and admitted[0] == "primer"
    if schedule == "lpm":
        assert admitted[1] == "probe"  # ahead of four fresh prompts that arrived before it
    else:
        assert admitted[1:] == ["d0", "d1", "d2", "d3", "probe"]
    with pytest.raises(WorkloadError, match="schedule: 'lpm' is an order of kvviz's own scheduler"):
        Workload.from_dict({"requests": reqs, "engine": {**engine, "schedule": "lpm", "backend": "transformers"}})
    with pytest.raises(WorkloadError, match="schedule: must be one of fcfs, lpm"):
        Workload.from_dict({"requests": reqs, "engine": {**engine, "schedule": "sjf"}})
