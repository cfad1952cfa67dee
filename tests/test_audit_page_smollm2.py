"""The paired timing audit on SmolLM2 through the Audit page's code path (audit_local, drawing its
chart between rounds): a server without a cache is no caching seen, never isolated, at the rounds
that can give a verdict; all three sharing policies at the published 250 rounds (marker `published`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvviz.audit_timing.probe import TIMED, AuditConfig, AuditResult
from kvviz.audit_timing.verdict import fewest_samples
from kvviz.models import load_model
from kvviz.store import RunStore
from tests.test_audit_smollm2 import ALPHA, EXPECTED, WORDS


def page_audit(sharing: str, rounds: int, alpha: float, db: Path) -> tuple[AuditResult, int]:
    """What the page runs: audit_local, drawing the figure between rounds; and how many it drew."""
    from kvviz.audit_timing.recorded import audit_local
    from kvviz.figures.audit_timing import ttft_ecdf

    drawn = []

    def between(r: AuditResult) -> None:
        drawn.append(ttft_ecdf({k: r.times(k) for k in (*TIMED, "floor")}).to_json())

    cfg = AuditConfig(base_url="http://127.0.0.1/v1", model="local", samples=rounds, prompt_tokens=WORDS,
                      interval=0.1, alpha=alpha)
    _, result = audit_local(RunStore.open(db), load_model("smollm2"), sharing, cfg, between=between)
    return result, len(drawn)


@pytest.mark.slow
def test_the_pages_code_path_with_its_drawing_says_no_caching_seen_of_a_server_without_a_cache(tmp_path):
    # Nothing is to be separated here but a full prompt from the floor, so the fewest rounds that can
    # give a verdict (every request is a miss: the slowest audit of the three).
    rounds = fewest_samples(ALPHA)
    result, drawn = page_audit("off", rounds, ALPHA, tmp_path / "k.duckdb")
    v, t = result.judge(), result.telemetry()
    assert v.verdict == "no caching seen" and v.null.p_value >= ALPHA and drawn == rounds, v
    assert "cannot tell a server that isolates users from one whose cache it cannot see" in v.reason
    assert t.reading == "no caching seen" and t.same_of == t.cross_of == rounds  # kvviz serve reports usage


@pytest.mark.published
@pytest.mark.timeout(2400)  # 250 rounds: 15-20 minutes a policy on two cores
@pytest.mark.parametrize(("sharing", "verdict"), EXPECTED)
def test_the_pages_code_path_at_the_published_size(sharing, verdict, tmp_path):
    result, drawn = page_audit(sharing, 250, 1e-8, tmp_path / "k.duckdb")
    v = result.judge()
    print(v)  # for docs/benchmarks.md: pytest -m published -rP
    assert v.verdict == verdict and v.null.p_value >= 1e-8 and drawn == 250, v
