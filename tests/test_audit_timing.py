"""The timing audit: the KS verdict and the null control on known timings, the symmetric schedule
against stand-in servers whose timing the test sets (a server with leftover work and no cache is not
accused; one that fails part way keeps its timings), the protocol's hits and misses as kvviz serve
reports them under each sharing policy, its records and refusals; on SmolLM2, the verdict in both
directions at the sample size derived for it, and at the published 250 (marker `published`)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from kvviz.audit_timing.probe import ORDERS, AuditConfig, record, run_audit
from kvviz.audit_timing.verdict import (
    contradicted,
    fewest_samples,
    judge,
    ks_test,
    samples_to_separate,
    server_says,
    tone,
)
from kvviz.errors import AuditError
from kvviz.models import load_model
from kvviz.store import RunStore
from tests.cli import kvviz, kvviz_process
from tests.fake_openai import Behaviour, FakeOpenAI
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


def _times(rng: random.Random, n: int, hit: float, miss: float, null: float, floor: float = 1.0) -> dict:
    return {k: [centre + rng.random() for _ in range(n)] for k, centre in
            (("hit", hit), ("miss", miss), ("null", null), ("floor", floor))}


def test_the_verdict_is_detected_only_when_the_null_control_passes():
    rng, tokens = random.Random(0), {"hit": [64] * 20, "miss": [64] * 20, "null": [64] * 20}
    assert judge(_times(rng, 20, 10, 30, 30), tokens, 1e-8).verdict == "detected"
    assert judge(_times(rng, 20, 30, 30, 30), tokens, 1e-8).verdict == "not detected"
    biased = judge(_times(rng, 20, 10, 30, 10), tokens, 1e-8)  # the null (a miss) comes as fast as the hits
    assert biased.verdict == "inconclusive" and biased.exit_status == 3 and not biased.detected
    assert "the null control (a miss against a miss, same schedule) rejects too" in biased.reason
    assert "the measurement is biased" in biased.reason and biased.null_p_value < 1e-8


def test_what_the_server_reports_of_the_hits_is_said_beside_the_verdict():
    rng, tokens = random.Random(3), {}
    quiet = judge(_times(rng, 20, 30, 30, 30), tokens, 1e-8, hits_cached=[64] * 12 + [0] * 8)
    assert quiet.verdict == "not detected" and contradicted(quiet)  # timing saw nothing, the server says hits
    assert server_says(quiet) == ("but the server itself reported serving 12 of 20 hits partly from its cache: timing "
                                  "could not see it (more rounds, or a quieter machine)")
    assert tone(quiet, "global") == "warning"  # amber, not the green of a server found to share nothing
    clean = judge(_times(rng, 20, 30, 30, 30), tokens, 1e-8, hits_cached=[0] * 20)
    assert not contradicted(clean) and server_says(clean) == "the server reported no cached tokens for any of 20 hits"
    silent = judge(_times(rng, 20, 30, 30, 30), tokens, 1e-8)
    assert silent.reported_hits is None and server_says(silent) == "" and not contradicted(silent)
    seen = judge(_times(rng, 20, 10, 30, 30), tokens, 1e-8, hits_cached=[64] * 20)
    assert seen.detected and not contradicted(seen)
    assert server_says(seen) == "the server itself reported serving 20 of 20 hits partly from its cache"
    assert (tone(seen, "global"), tone(seen, "per-user"), tone(clean, "global")) == ("error", "info", "success")


def test_no_verdict_from_too_few_samples_unequal_prompts_or_a_server_too_fast_to_time():
    rng = random.Random(1)
    few = judge(_times(rng, 9, 10, 30, 30), {}, 1e-8, stopped="stopped in round 10 of 250: HTTP 429")
    assert few.verdict == "no verdict" and few.exit_status == 2 and few.samples == 9
    assert few.reason.startswith(f"9 samples a side: at alpha 1e-08 the test needs at least {fewest_samples(1e-8)}")
    assert few.reason.endswith("(stopped in round 10 of 250: HTTP 429)") and few.p_value is not None
    unequal = judge(_times(rng, 20, 10, 30, 30), {"hit": [64] * 20, "miss": [80] * 20, "null": [80] * 20}, 1e-8)
    assert unequal.verdict == "no verdict" and "unequal length (hit 64, miss 80, null 80 tokens)" in unequal.reason
    fast = judge(_times(rng, 20, 1.0, 1.0, 1.0, floor=1.0), {}, 1e-8)
    assert fast.verdict == "no verdict" and "cannot show in time: use longer prompts" in fast.reason
    # a control: the same timings a clear step above the floor do get a verdict
    assert judge(_times(rng, 20, 5.0, 5.0, 5.0, floor=1.0), {}, 1e-8).verdict == "not detected"


def test_the_smallest_sample_that_separates_is_the_fewest_at_which_the_distance_reaches_alpha():
    assert fewest_samples(1e-8) == 15 and samples_to_separate(1.0, 1e-8) == 15
    for d, alpha in ((0.75, 1e-8), (0.5, 1e-3), (0.3, 0.01)):
        n = samples_to_separate(d, alpha)
        for m, reaches in ((n, True), (n - 1, False)):
            fast, slow = list(range(m)), [x + math.ceil(d * m) for x in range(m)]  # D = ceil(d m) / m
            assert (ks_test(fast, slow)[1] < alpha) is reaches, (d, alpha, m)


FAST = dict(samples=10, prompt_tokens=64, alpha=1e-3)  # 10 rounds reach 1e-3 (complete separation: 5.4e-6)


def test_a_server_with_leftover_work_and_no_cache_is_not_accused():
    """The reported false accusation: work left from the previous request landed on misses only. With
    a primer before every timed request, the tail lands on primers, and the null control agrees."""
    with FakeOpenAI(Behaviour("off", per_token=2e-4, tail=0.02)) as server:
        r = run_audit(AuditConfig(server.url, "fake", **FAST), seed=0)
    v = r.judge()
    assert v.verdict == "not detected" and v.p_value > 1e-3 and v.null_p_value > 1e-3, v
    assert v.median_hit_ms > 0.8 * v.median_miss_ms  # no gap at all, not merely an insignificant one


@pytest.mark.parametrize(("cache", "level", "detected"), [
    ("global", "global", True), ("per-key", "global", False), ("per-key", "per-user", True)])
def test_the_symmetric_schedule_detects_a_cache_exactly_where_it_is_shared(cache, level, detected):
    with FakeOpenAI(Behaviour(cache, per_token=2e-4, tail=0.01)) as server:
        r = run_audit(AuditConfig(server.url, "fake", level, **FAST), seed=1)
    v = r.judge()
    assert v.verdict == ("detected" if detected else "not detected") and v.null_p_value > 1e-3, v
    hits = [s.cached_tokens for s in r.samples if s.kind == "hit"]
    assert hits == ([64] * 10 if detected else [0] * 10)
    assert {s.cached_tokens for s in r.samples if s.kind in ("miss", "null")} == {0}


def test_every_timed_request_follows_a_primer_of_its_length_in_rotating_orders():
    with FakeOpenAI(Behaviour("global", per_token=1e-5)) as server:
        r = run_audit(AuditConfig(server.url, "fake", **FAST), seed=2)
        assert server.requests == 7 * 10  # three primers, three timed requests and a floor a round
    timed = [s for s in r.samples if s.kind != "floor"]
    assert all(s.prompt_tokens == s.primer_tokens == 64 for s in timed)
    assert [s.prompt_tokens for s in r.samples if s.kind == "floor"] == [1] * 10
    rounds = [tuple(s.kind for s in r.samples if s.index == i and s.kind != "floor") for i in range(10)]
    assert rounds == [ORDERS[i % 6] for i in range(10)] and len(set(rounds)) == 6


def test_the_cli_says_the_verdict_and_what_the_server_reported(tmp_path):
    with FakeOpenAI(Behaviour("global", per_token=2e-4)) as server:
        p = kvviz("audit-timing", "--base-url", server.url, "--model", "fake", "--samples", 10, "--prompt-tokens", 64,
                  "--alpha", 1e-3, "--quiet", "--db", tmp_path / "k.duckdb")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "DETECTED: hits reach their first token sooner, so this server shares its prompt cache across users" \
        in p.stdout and "the server itself reported serving 10 of 10 hits partly from its cache" in p.stdout
    with RunStore.open(tmp_path / "k.duckdb").read() as con:
        assert con.execute("SELECT reported_cached_hits FROM timing_audits").fetchone() == (10,)


def test_a_server_too_fast_to_time_gets_no_verdict(tmp_path):
    with FakeOpenAI(Behaviour("global")) as server:
        p = kvviz("audit-timing", "--base-url", server.url, "--model", "fake", "--samples", 10, "--prompt-tokens", 64,
                  "--alpha", 1e-3, "--quiet", "--db", tmp_path / "k.duckdb")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "NO VERDICT: the server answers a full prompt about as fast as a one-word one" in p.stdout


@pytest.mark.parametrize(("status", "says"), [(429, "HTTP 429"), (500, "HTTP 500"), (0, "broke off a reply")])
def test_a_server_failing_part_way_keeps_its_timings_and_gives_no_verdict(tmp_path, status, says):
    db = tmp_path / "k.duckdb"
    with FakeOpenAI(Behaviour("global", per_token=2e-4, fail_after=30, fail_status=status)) as server:
        p = kvviz("audit-timing", "--base-url", server.url, "--model", "fake", "--samples", 10, "--prompt-tokens", 64,
                  "--alpha", 1e-3, "--json", "--quiet", "--db", db)
    v = json.loads(p.stdout)
    assert p.returncode == 2 and v["verdict"] == "no verdict", p.stdout + p.stderr
    assert v["reason"].startswith("4 samples a side: at alpha 0.001 the test needs at least 7")
    assert "stopped in round 5 of 10" in v["reason"] and says in v["reason"]
    with RunStore.open(db).read() as con:
        kept = con.execute("SELECT count(*) FILTER (kind <> 'floor'), any_value(reason) FROM timing_samples "
                           "JOIN timing_audits USING (audit_id)").fetchone()
    assert kept == (13, v["reason"])  # 30 requests: four rounds (28) and a fifth's primer and first timed one


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


@pytest.mark.parametrize(("sharing", "level", "hits_cached"), [
    ("global", "global", True), ("per-user", "global", False), ("per-user", "per-user", True),
    ("off", "per-user", False)])
def test_the_protocols_hits_are_hits_only_where_the_cache_is_shared(tiny, sharing, level, hits_cached):
    with Server(tiny, sharing) as s:
        r = run_audit(AuditConfig(s.url + "/v1", "tiny", level, samples=3, prompt_tokens=40, alpha=0.5), seed=1)
    by_kind = {k: [x.cached_tokens for x in r.samples if x.kind == k] for k in ("hit", "miss", "null", "floor")}
    assert by_kind["miss"] == by_kind["null"] == by_kind["floor"] == [0, 0, 0]  # fresh prompts share nothing
    assert all(h > 0 for h in by_kind["hit"]) if hits_cached else by_kind["hit"] == [0, 0, 0]
    assert all(x.prompt_tokens == x.primer_tokens for x in r.samples if x.kind == "hit")  # the server's count


def test_an_audit_is_recorded_with_its_verdict_null_control_and_timings(tiny, tmp_path):
    with Server(tiny) as s:
        r = run_audit(AuditConfig(s.url + "/v1", "tiny", samples=3, prompt_tokens=40, alpha=0.5), seed=2)
    store, v = RunStore.open(tmp_path / "k.duckdb"), r.judge()
    audit_id = record(store, r, v)
    with store.read() as con:
        row = con.execute("SELECT level, samples, p_value, null_p_value, verdict, detected, median_floor_ms, "
                          "counted_prompt_tokens FROM timing_audits WHERE audit_id = ?", [audit_id]).fetchone()
        timings = con.execute("SELECT kind, ttft_ms, prompt_tokens, primer_tokens FROM timing_samples "
                              "WHERE audit_id = ?", [audit_id]).fetchall()
    assert row == ("global", 3, v.p_value, v.null_p_value, v.verdict, v.detected, v.median_floor_ms, v.prompt_tokens)
    assert v.prompt_tokens is not None and v.prompt_tokens >= 40
    assert sorted(t for k, t, _, _ in timings if k == "null") == sorted(r.times("null")) and len(timings) == 12
    assert {(k, primer is None) for k, _, _, primer in timings} == {("hit", False), ("miss", False),
                                                                     ("null", False), ("floor", True)}


def test_bad_settings_and_unreachable_servers_are_refused(tiny, tmp_path):
    db = str(tmp_path / "k.duckdb")
    p = kvviz_process("audit-timing", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--samples", "20",
                      "--db", db)
    assert p.returncode == 2 and "cannot reach http://127.0.0.1:9/v1" in p.stderr
    p = kvviz("audit-timing", "--base-url", "http://x/v1", "--model", "m", "--level", "tenant", "--db", db)
    assert p.returncode == 2 and "level must be one of global, per-user" in p.stderr
    p = kvviz("audit-timing", "--base-url", "http://x/v1", "--model", "m", "--samples", "8", "--db", db)
    assert p.returncode == 2 and "8 rounds (samples a side) cannot reach alpha 1e-08" in p.stderr
    assert "use at least 15 rounds" in p.stderr  # an audit that could never say "detected" is refused
    p = kvviz("audit-timing", "--base-url", "localhost:8000", "--model", "m", "--db", db)
    assert p.returncode == 2 and "the base URL must be an http(s) URL" in p.stderr
    with Server(tiny) as s:
        with pytest.raises(AuditError, match="HTTP 404: the model 'not-served' does not exist; this server serves"):
            run_audit(AuditConfig(s.url + "/v1", "not-served", samples=2, prompt_tokens=20, alpha=0.5))
        with pytest.raises(AuditError, match=r"HTTP 404: Not Found \(is the base URL right\? .* ends in /v1\)$"):
            run_audit(AuditConfig(s.url, "tiny", samples=2, prompt_tokens=20, alpha=0.5))


def test_the_audit_page_runs_an_audit_and_shows_it_beside_the_past(tmp_path, monkeypatch):
    from .apptest import AppTest

    monkeypatch.setenv("KVVIZ_DB", str(tmp_path / "k.duckdb"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
    at.run()
    at.switch_page("kvviz/ui/pages/audit.py").run()
    at.selectbox(key="audit_model").set_value("tiny-llama").run()
    at.number_input(key="audit_samples").set_value(3).run()
    at.number_input(key="audit_words").set_value(40).run()
    at.number_input(key="audit_alpha").set_value(0.5).run()
    at.button(key="audit_go").click().run()
    assert not at.exception  # timing decides the verdict on the tiny model: one message, whichever it is
    said = [s.value for s in [*at.success, *at.info, *at.error, *at.warning]]
    assert len(said) == 1 and said[0].startswith(("**Detected**", "**Not detected**", "**Inconclusive**",
                                                  "**No verdict**")), said
    assert "for the null control" in said[0] and "alpha 0.5" in said[0]
    if said[0].startswith(("**Detected**", "**Not detected**")):  # what it means for the server, said in words
        assert "shares its prompt cache across users" in said[0]
    with RunStore.open(tmp_path / "k.duckdb").read() as con:
        (audit_id,) = con.execute("SELECT audit_id FROM timing_audits").fetchone()
        assert con.execute("SELECT count(*) FROM timing_samples").fetchone()[0] == 12
    assert at.multiselect(key="audit_show").value == [audit_id]
    past = at.dataframe[0].value.iloc[0]  # the words asked, and the prompt as the server counted it
    assert past.prompt_words == 40 and past.server_prompt_tokens >= 40
    assert f"audit_past_{audit_id}" in {el.key for el in at.get("plotly_chart")}
    at.radio(key="audit_target").set_value("a server at a URL").run()
    at.text_input(key="audit_url").input("http://127.0.0.1:9/v1").run()
    at.text_input(key="audit_remote_model").input("m").run()
    at.button(key="audit_go").click().run()
    assert "cannot reach http://127.0.0.1:9/v1" in at.error[0].value  # said in one sentence, no traceback
    assert f"audit_past_{audit_id}" in {el.key for el in at.get("plotly_chart")}, "the past audits stay below"


def test_the_audit_settings_labels_fit_their_quarter_of_the_page(tmp_path, monkeypatch):
    """Level, rounds, prompt length and alpha share a row of four columns: a label longer than about 20
    characters wrapped onto a second line and pushed its input below its neighbours'."""
    from .apptest import AppTest

    monkeypatch.setenv("KVVIZ_DB", str(tmp_path / "k.duckdb"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
    at.run()
    at.switch_page("kvviz/ui/pages/audit.py").run()
    row = [at.selectbox(key="audit_level"), *(at.number_input(key=k) for k in ("audit_samples", "audit_words",
                                                                              "audit_alpha"))]
    assert all(len(w.label) <= 20 for w in row), [w.label for w in row]
    assert "one token each" in at.number_input(key="audit_words").help, "what the label left out, in its help"


def test_the_figure_marks_the_ks_distance_and_draws_the_null_and_the_floor():
    from kvviz.figures.audit_timing import ttft_ecdf

    hit, miss = [5.0, 6.0, 30.0, 7.0], [20.0, 25.0, 8.0, 40.0]
    fig = ttft_ecdf(hit, miss, null=[21.0, 9.0, 30.0], floor=[1.0, 2.0, 3.0])
    assert [t.name for t in fig.data] == ["hit (4)", "miss (4)", "null (3)", "KS distance D = 0.75"]
    assert ks_test(hit, miss)[0] == 0.75
    segment = fig.data[3]
    assert segment.x[0] == segment.x[1] == 7.0 and (segment.y[1] - segment.y[0]) == 0.75
    assert [s.x0 for s in fig.layout.shapes] == [2.0] and "floor 2.0 ms" in fig.layout.annotations[0].text


def test_each_curve_rises_from_zero_so_the_first_round_draws_a_step():
    from kvviz.figures.audit_timing import ttft_ecdf

    fig = ttft_ecdf([5.0], [9.0], null=[7.0, 8.0])
    assert [(list(t.x), list(t.y)) for t in fig.data[:3]] == [([5.0, 5.0], [0.0, 1.0]), ([9.0, 9.0], [0.0, 1.0]),
                                                             ([7.0, 7.0, 8.0], [0.0, 0.5, 1.0])]



def test_audits_drawn_side_by_side_share_one_time_axis():
    from kvviz.figures.audit_timing import ttft_ecdf

    assert ttft_ecdf([5.0], [9.0], x_max=100.0).layout.xaxis.range == (0, 102.0)
    assert ttft_ecdf([5.0], [9.0]).layout.xaxis.range is None  # alone: plotly fits it
