"""The timing audit on SmolLM2 behind kvviz serve: global sharing detected at the global level, a
per-user salt and no cache at all not detected there, each with its null control passing; the same
through the Audit page's code path with its drawing on; and all three at the published 250 rounds
(marker `published`, about 35 minutes: `python -m pytest -m published`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvviz.audit_timing import AuditConfig, AuditResult
from kvviz.audit_verdict import samples_to_separate
from kvviz.models import load_model
from kvviz.store import RunStore
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


def page_audit(sharing: str, rounds: int, alpha: float, db: Path) -> tuple[AuditResult, int]:
    """What the page runs: audit_local, drawing the figure between rounds; and how many it drew."""
    from kvviz.analysis.audits import audit_local
    from kvviz.figures.audit import ttft_ecdf

    drawn = []

    def between(r: AuditResult) -> None:
        drawn.append(ttft_ecdf(r.times("hit"), r.times("miss"), null=r.times("null"), floor=r.times("floor")).to_json())

    cfg = AuditConfig("http://127.0.0.1/v1", "local", "global", rounds, 256, interval=0.1, alpha=alpha)
    _, result = audit_local(RunStore.open(db), load_model("smollm2"), sharing, cfg, between=between)
    return result, len(drawn)


@pytest.mark.slow
def test_the_pages_code_path_with_its_drawing_does_not_accuse_a_server_without_a_cache(tmp_path):
    result, drawn = page_audit("off", ROUNDS, ALPHA, tmp_path / "k.duckdb")
    v = result.judge()
    assert v.verdict == "not detected" and v.null_p_value >= ALPHA and drawn == ROUNDS, v


@pytest.mark.published
@pytest.mark.timeout(2400)  # 250 rounds: 11-15 minutes a policy on two cores
@pytest.mark.parametrize(("sharing", "level", "detected"), EXPECTED)
def test_the_pages_code_path_at_the_published_size(sharing, level, detected, tmp_path):
    result, drawn = page_audit(sharing, 250, 1e-8, tmp_path / "k.duckdb")
    v = result.judge()
    print(v)  # for docs/benchmarks.md: pytest -m published -rP
    assert v.detected is detected and v.null_p_value >= 1e-8 and drawn == 250, v
