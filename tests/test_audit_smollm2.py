"""The timing audit on SmolLM2 behind kvviz serve, through the CLI: global sharing detected at the
global level, a per-user salt and no cache at all not detected there, each with its null control
passing; and all three at the published 250 rounds (marker `published`: `python -m pytest -m
published`). The Audit page's code path: tests/test_audit_page_smollm2.py (a file of its own, so the
two workers share these minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvviz.audit_timing.verdict import samples_to_separate
from kvviz.models import load_model
from tests.cli import kvviz
from tests.test_serve import Server

SMOL = dict(block_size=16, num_blocks=256, max_batch_tokens=2048)
# Where speed matters, the fewest rounds derived from the distance measured: global sharing on
# SmolLM2 with 256-token prompts gave KS D 0.88 over 60 rounds (docs/benchmarks.md); taking 0.75 for
# a busy machine, samples_to_separate(0.75, 1e-4) is 14 rounds; two more for margin.
ALPHA = 1e-4
ROUNDS = samples_to_separate(0.75, ALPHA) + 2
EXPECTED = [("global", "global", True), ("per-user", "global", False), ("off", "global", False)]


def smollm2_audit(sharing: str, level: str, rounds: int, alpha: float, db: Path) -> tuple[int, dict]:
    with Server(load_model("smollm2"), sharing, config=SMOL) as s:
        p = kvviz("audit-timing", "--base-url", s.url + "/v1", "--model", "tiny", "--level", level, "--samples",
                  rounds, "--prompt-tokens", "256", "--alpha", alpha, "--json", "--quiet", "--db", db)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    return p.returncode, json.loads(p.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(("sharing", "level", "detected"), EXPECTED)
def test_the_audit_on_smollm2_detects_sharing_exactly_where_it_is(sharing, level, detected, tmp_path):
    code, v = smollm2_audit(sharing, level, ROUNDS, ALPHA, tmp_path / "k.duckdb")
    assert v["detected"] is detected and code == int(detected) and v["null_p_value"] >= ALPHA, v
    assert v["prompt_tokens"] == 256  # the server's own count: every prompt as long as asked


@pytest.mark.published
@pytest.mark.timeout(2400)  # 250 rounds: 11-15 minutes a policy on two cores
@pytest.mark.parametrize(("sharing", "level", "detected"), EXPECTED)
def test_the_audit_on_smollm2_at_the_published_size(sharing, level, detected, tmp_path):
    code, v = smollm2_audit(sharing, level, 250, 1e-8, tmp_path / "k.duckdb")
    print(v)  # for docs/benchmarks.md: pytest -m published -rP
    assert v["detected"] is detected and code == int(detected) and v["null_p_value"] >= 1e-8, v
