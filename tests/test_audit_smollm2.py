"""The paired timing audit on SmolLM2 behind kvviz serve, through the CLI: global sharing is shared
across users, a per-user salt isolated, each with its null control passing; no cache at all is no
caching seen through the Audit page's code path (tests/test_audit_page_smollm2.py, a file of its own
so that the two workers share these minutes). All three at the published 250 rounds (marker
`published`: `python -m pytest -m published`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvviz.audit_timing.verdict import VERDICTS, samples_to_separate
from kvviz.models import load_model
from tests.cli import kvviz
from tests.test_serve import Server

SMOL = dict(block_size=16, num_blocks=256, max_batch_tokens=2048)
# Where speed matters, the fewest rounds derived from the distance measured: global sharing on
# SmolLM2 gave KS D 0.88 over 60 rounds of 256-token prompts (docs/benchmarks.md) and 0.90 over 10 of
# 128 (README); taking 0.75 for a busy machine, samples_to_separate(0.75, 1e-4) is 14 rounds; two more
# for margin. 128 words: half the suite's time of 256, and a miss still several times the floor. Every test here
# asks the same of each policy: a server that shares nothing across users is never "shared across
# users", one with caching off never "isolated".
ALPHA = 1e-4
ROUNDS = samples_to_separate(0.75, ALPHA) + 2
WORDS = 128
EXPECTED = [("global", "shared across users"), ("per-user", "isolated"), ("off", "no caching seen")]


def smollm2_audit(sharing: str, rounds: int, alpha: float, db: Path) -> tuple[int, dict]:
    with Server(load_model("smollm2"), sharing, config=SMOL) as s:
        p = kvviz("audit-timing", "--base-url", s.url + "/v1", "--model", "tiny", "--samples", rounds,
                  "--prompt-tokens", WORDS, "--alpha", alpha, "--json", "--quiet", "--db", db)
    assert p.returncode in VERDICTS.values(), p.stdout + p.stderr
    return p.returncode, json.loads(p.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(("sharing", "verdict"), EXPECTED[:2])
def test_the_paired_audit_on_smollm2_tells_shared_from_isolated(sharing, verdict, tmp_path):
    code, v = smollm2_audit(sharing, ROUNDS, ALPHA, tmp_path / "k.duckdb")
    assert v["verdict"] == verdict and code == VERDICTS[verdict] and v["null"]["p_value"] >= ALPHA, v
    assert v["same"]["p_value"] < ALPHA, v  # the positive control: caching shows within a user either way
    assert v["prompt_tokens"] == WORDS  # the server's own count: every prompt as long as asked
    assert v["telemetry"]["reading"] == verdict and v["contradiction"] is None, v  # the server's counts agree


@pytest.mark.published
@pytest.mark.timeout(2400)  # 250 rounds: 15-20 minutes a policy on two cores
@pytest.mark.parametrize(("sharing", "verdict"), EXPECTED)
def test_the_paired_audit_on_smollm2_at_the_published_size(sharing, verdict, tmp_path):
    code, v = smollm2_audit(sharing, 250, 1e-8, tmp_path / "k.duckdb")
    print(v)  # for docs/benchmarks.md: pytest -m published -rP
    assert v["verdict"] == verdict and code == VERDICTS[verdict] and v["null"]["p_value"] >= 1e-8, v
