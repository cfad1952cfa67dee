"""The timing audit: the KS verdict on known timings, the protocol's hits and misses as the server
reports them under each sharing policy, its records and refusals; on SmolLM2, the audit's verdict in
both directions (global sharing detected, a per-user salt not detected across users yet detected
within one, no caching detected at neither)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvviz.audit_timing import AuditConfig, AuditResult, Sample, ks_test, record, run_audit
from kvviz.errors import AuditError
from kvviz.models import load_model
from kvviz.store import RunStore
from tests.test_serve import Server

ROOT = Path(__file__).resolve().parent.parent


def test_the_ks_test_is_one_sided():
    rng = random.Random(0)
    slow = [100 + rng.random() for _ in range(30)]
    fast = [10 + rng.random() for _ in range(30)]
    d, p = ks_test(fast, slow)
    assert d == 1 and p < 1e-8  # hits all faster: detected
    d, p = ks_test(slow, fast)
    assert p > 0.5  # hits all slower is not what the alternative says
    same = [rng.random() for _ in range(30)]
    assert ks_test(same, [x + 0.001 for x in same])[1] > 0.01


def test_the_verdict_has_the_documented_keys():
    samples = [Sample("hit", 0, 5.0, 10), Sample("miss", 0, 9.0, 0), Sample("hit", 1, 6.0, 10),
               Sample("miss", 1, 8.0, 0)]
    r = AuditResult(AuditConfig("http://x/v1", "m", samples=2, alpha=0.5), samples)
    r.ks_statistic, r.p_value = ks_test(r.times("hit"), r.times("miss"))
    v = r.verdict()
    assert list(v) == ["level", "samples", "ks_statistic", "p_value", "median_hit_ms", "median_miss_ms",
                       "hit_faster_than_all_misses", "detected"]
    assert v["samples"] == 2 and v["median_hit_ms"] == 5.5 and v["hit_faster_than_all_misses"] is True
    assert v["p_value"] == pytest.approx(1 / 6) and v["detected"] is True  # complete separation: p = 1/C(4, 2)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


@pytest.mark.parametrize(("sharing", "level", "hits_cached"), [
    ("global", "global", True), ("per-user", "global", False), ("per-user", "per-user", True),
    ("off", "per-user", False)])
def test_the_protocols_hits_are_hits_only_where_the_cache_is_shared(tiny, sharing, level, hits_cached):
    s = Server(tiny, sharing)
    try:
        r = run_audit(AuditConfig(s.url + "/v1", "tiny", level, samples=3, prompt_tokens=40, alpha=0.5), seed=1)
    finally:
        s.close()
    hits = [x.cached_tokens for x in r.samples if x.kind == "hit"]
    misses = [x.cached_tokens for x in r.samples if x.kind == "miss"]
    assert len(hits) == len(misses) == 3 and misses == [0, 0, 0]  # a fresh nonce first: nothing shared
    assert all(h > 0 for h in hits) if hits_cached else hits == [0, 0, 0]
    assert [x.kind for x in r.samples[:4]] == ["miss", "hit", "hit", "miss"]  # interleaved, alternating


def test_an_audit_is_recorded_with_its_timings(tiny, tmp_path):
    s = Server(tiny)
    try:
        r = run_audit(AuditConfig(s.url + "/v1", "tiny", samples=3, prompt_tokens=40, alpha=0.5), seed=2)
    finally:
        s.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    audit_id = record(store, r)
    with store.read() as con:
        level, samples, p, detected = con.execute("SELECT level, samples, p_value, detected FROM timing_audits "
                                                  "WHERE audit_id = ?", [audit_id]).fetchone()
        timings = con.execute("SELECT kind, ttft_ms FROM timing_samples WHERE audit_id = ? ORDER BY kind, sample",
                              [audit_id]).fetchall()
    assert (level, samples, p, detected) == ("global", 3, r.p_value, r.detected)
    assert sorted(t for k, t in timings if k == "hit") == sorted(r.times("hit")) and len(timings) == 6


def kvviz(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvviz", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def test_bad_settings_and_unreachable_servers_are_refused(tiny, tmp_path):
    db = str(tmp_path / "k.duckdb")
    p = kvviz("audit-timing", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--samples", "20", "--db", db)
    assert p.returncode == 2 and "cannot reach http://127.0.0.1:9/v1" in p.stderr
    p = kvviz("audit-timing", "--base-url", "http://x/v1", "--model", "m", "--level", "tenant", "--db", db)
    assert p.returncode == 2 and "level must be one of global, per-user" in p.stderr
    p = kvviz("audit-timing", "--base-url", "http://x/v1", "--model", "m", "--samples", "8", "--db", db)
    assert p.returncode == 2 and "8 samples a side cannot reach alpha 1e-08" in p.stderr
    assert "use at least 15 samples" in p.stderr  # an audit that could never say "detected" is refused
    p = kvviz("audit-timing", "--base-url", "localhost:8000", "--model", "m", "--db", db)
    assert p.returncode == 2 and "the base URL must be an http(s) URL" in p.stderr
    s = Server(tiny)
    try:
        with pytest.raises(AuditError, match="HTTP 404"):
            run_audit(AuditConfig(s.url + "/v1", "not-served", samples=2, prompt_tokens=20, alpha=0.5))
    finally:
        s.close()


SMOL = dict(block_size=16, num_blocks=256, max_batch_tokens=2048)


def audit(url: str, level: str, db: Path) -> tuple[int, dict]:
    p = kvviz("audit-timing", "--base-url", url + "/v1", "--model", "tiny", "--level", level, "--samples", "16",
              "--prompt-tokens", "256", "--json", "--quiet", "--db", str(db))
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, json.loads(p.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("sharing", ["global", "per-user", "off"])
def test_the_audit_detects_sharing_exactly_where_it_is(sharing, tmp_path):
    """16 samples a side: all hits faster than all misses gives p = 1/C(32,16) = 1.7e-9 < alpha 1e-8."""
    expected = {"global": {"global": True}, "per-user": {"global": False, "per-user": True},
                "off": {"global": False, "per-user": False}}[sharing]
    s = Server(load_model("smollm2"), sharing, config=SMOL)
    try:
        verdicts = {level: audit(s.url, level, tmp_path / "k.duckdb") for level in expected}
    finally:
        s.close()
    for level, (code, v) in verdicts.items():
        assert v["detected"] is expected[level] and code == (1 if expected[level] else 0), (level, v)
        if expected[level]:
            assert v["median_hit_ms"] < v["median_miss_ms"] / 2


def test_the_audit_page_runs_an_audit_and_shows_it_beside_the_past(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("KVVIZ_DB", str(tmp_path / "k.duckdb"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
    at.run()
    at.switch_page("kvviz/ui/pages/audit.py").run()
    at.selectbox(key="audit_model").set_value("tiny-llama").run()
    at.number_input(key="audit_samples").set_value(3).run()
    at.number_input(key="audit_words").set_value(40).run()
    at.number_input(key="audit_alpha").set_value(0.5).run()
    at.button(key="audit_go").click().run()
    assert not at.exception  # the verdict is red when sharing across users is detected: timing decides which
    said = [s.value for s in [*at.success, *at.info, *at.error]]
    assert len(said) == 1 and ("Not detected" in said[0] or "Detected" in said[0])
    with RunStore.open(tmp_path / "k.duckdb").read() as con:
        (audit_id,) = con.execute("SELECT audit_id FROM timing_audits").fetchone()
        assert con.execute("SELECT count(*) FROM timing_samples").fetchone()[0] == 6
    assert at.multiselect(key="audit_show").value == [audit_id]
    assert f"audit_past_{audit_id}" in {el.key for el in at.get("plotly_chart")}
    at.radio(key="audit_target").set_value("a server at a URL").run()
    at.text_input(key="audit_url").input("http://127.0.0.1:9/v1").run()
    at.text_input(key="audit_remote_model").input("m").run()
    at.button(key="audit_go").click().run()
    assert "cannot reach http://127.0.0.1:9/v1" in at.error[0].value  # said in one sentence, no traceback


def test_the_figure_marks_the_ks_distance():
    from kvviz.figures.audit import ttft_ecdf

    hit, miss = [5.0, 6.0, 30.0, 7.0], [20.0, 25.0, 8.0, 40.0]
    fig = ttft_ecdf(hit, miss)
    assert [t.name for t in fig.data] == ["hit (4)", "miss (4)", "KS distance D = 0.75"]
    assert ks_test(hit, miss)[0] == 0.75
    segment = fig.data[2]
    assert segment.x[0] == segment.x[1] == 7.0 and (segment.y[1] - segment.y[0]) == 0.75
