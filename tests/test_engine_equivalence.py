"""Packed, paged runs must reproduce each request run alone through transformers' generate:
token for token, with logits within 1e-4 in float32, under both isolation mechanisms and both
compute paths, in workloads that mix lengths, arrivals, chunked prefill, forks, shared prefixes
(salted and not) and preemption. Each workload also asserts that its feature really happened."""

from __future__ import annotations

import functools
import os

import pytest

from kvviz.engine import Engine
from kvviz.models import load_model

from .engine_workloads import make, reference, workloads

MODES = [("paged", "inspect"), ("paged", "fast"), ("masked", "inspect"), ("masked", "fast")]
TOLERANCE = 1e-4


DEVICE = os.environ.get("KVVIZ_TEST_DEVICE", "cpu")  # scripts/device-check.sh sets cuda


@functools.cache
def model(name):
    return load_model(name, device=DEVICE)


@functools.cache
def ref(name, prompt, n):
    return reference(model(name), list(prompt), n)


def run_and_compare(name: str, workload_name: str, isolation: str, compute: str):
    m = model(name)
    wl = make(workloads(m.tokenizer)[workload_name], isolation, compute)
    records = []
    result = Engine(m, wl.engine).run(wl, on_step=records.append, keep_logits=True)
    worst = 0.0
    for r in result.requests:
        tokens, logits = ref(name, tuple(r.prompt_ids), next(s.max_new_tokens for s in wl.requests if s.id == r.id))
        assert r.output_ids == tokens, f"{r.id}: engine {r.output_ids} != generate {tokens}"
        worst = max([worst] + [float((a - b).abs().max()) for a, b in zip(r.logits, logits, strict=True)])
    assert worst <= TOLERANCE, f"max |logit diff| {worst:.2e} > {TOLERANCE}"
    return result, records


def feature_happened(workload_name: str, result, records) -> None:
    events = [e for rec in records for e in rec.events]
    by_id = {r.id: r for r in result.requests}
    if workload_name.startswith("mixed"):
        prompt_len = {r.id: len(r.prompt_ids) for r in result.requests}
        chunked = [(sid, s, n) for rec in records for sid, (s, n) in rec.work.items() if 1 < s + n < prompt_len[sid]]
        assert chunked, "no prefill was split into chunks"
        assert max(r.first_token_step for r in result.requests) > 6
    elif workload_name.startswith("shared"):
        assert by_id["s2"].cached_tokens == 24  # same salt: the whole system prompt is a hit
        assert by_id["s3"].cached_tokens == 0  # other tenant: no hit
        assert by_id["s4"].cached_tokens == 0  # unsalted is its own namespace
        assert by_id["s5"].cached_tokens == 32  # s4's blocks
    elif workload_name.startswith("forks"):
        assert any(e.kind == "cow" for e in events) and any(e.kind == "share" for e in events)
    elif workload_name.startswith("preemption"):
        assert result.stats.preemptions > 0
        assert any(e.kind == "preempt" for e in events)


@pytest.mark.parametrize("isolation,compute", MODES)
@pytest.mark.parametrize("workload_name", list(workloads(load_model("tiny-llama").tokenizer)))
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_tiny_models_match_generate(name, workload_name, isolation, compute):
    result, records = run_and_compare(name, workload_name, isolation, compute)
    feature_happened(workload_name, result, records)


@pytest.mark.slow
@pytest.mark.parametrize("isolation,compute", MODES)
@pytest.mark.parametrize("workload_name", list(workloads(load_model("tiny-llama").tokenizer)))
def test_smollm2_matches_generate(workload_name, isolation, compute):
    result, records = run_and_compare("smollm2", workload_name, isolation, compute)
    feature_happened(workload_name, result, records)
