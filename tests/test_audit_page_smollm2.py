"""The timing audit on SmolLM2 through the Audit page's code path (audit_local, drawing its chart
between rounds): a server without a cache is not accused at the rounds derived for the suite, and
all three sharing policies at the published 250 rounds (marker `published`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvviz.audit_timing.probe import AuditConfig, AuditResult
from kvviz.models import load_model
from kvviz.store import RunStore
from tests.test_audit_smollm2 import ALPHA, EXPECTED, ROUNDS


def page_audit(sharing: str, rounds: int, alpha: float, db: Path) -> tuple[AuditResult, int]:
    """What the page runs: audit_local, drawing the figure between rounds; and how many it drew."""
    from kvviz.audit_timing.recorded import audit_local
    from kvviz.figures.audit_timing import ttft_ecdf

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
