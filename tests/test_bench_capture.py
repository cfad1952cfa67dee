"""bench --capture-explain: explain alone over a synthetic capture, timed in a fresh process."""

import pytest

from kvviz.bench.capture_import import explain_report, run_explain_bench


@pytest.mark.slow  # two fresh Python processes
def test_the_explain_bench_explains_a_synthetic_capture_in_a_process_of_its_own():
    said = []
    (r,) = run_explain_bench([3000], progress=said.append)
    assert r.events == 3000 and r.lookups > 100  # a segment per request's stored chain
    assert 0 < r.seconds < 60 and r.peak_mb > 50  # the child's own high-water mark, not zero
    assert any("explaining 3,000 events" in s for s in said)
    assert f"| 3,000 | {r.lookups:,} |" in explain_report([r])
