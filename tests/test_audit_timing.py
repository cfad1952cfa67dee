"""The paired timing audit: the verdicts and the null control on known timings, the symmetric schedule
against stand-in servers whose timing the test sets (shared, isolated and uncached servers told apart;
a server with leftover work and no cache is not accused; one that fails part way keeps its timings),
the protocol's hits and misses as kvviz serve reports them under each sharing policy, its records,
refusals, --help, the page and the figure; on SmolLM2 the verdicts on kvviz serve are in
tests/test_audit_smollm2.py. The cached-tokens channel: tests/test_audit_telemetry.py."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest

from kvviz.audit_timing import defaults
from kvviz.audit_timing.probe import ORDERS, AuditConfig, record, run_audit
from kvviz.audit_timing.verdict import VERDICTS, fewest_samples, judge, ks_test, samples_to_separate
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


def _times(rng: random.Random, n: int, same, cross, miss: float, null: float, floor: float = 1.0) -> dict:
    """n times a kind around each centre; a kind given as a list of centres takes them in turn."""
    centres = {"same": same, "cross": cross, "miss": miss, "null": null, "floor": floor}
    return {k: [(c[i % len(c)] if isinstance(c, list) else c) + rng.random() for i in range(n)]
            for k, c in centres.items()}


TOKENS = {k: [64] * 20 for k in ("same", "cross", "miss", "null")}


@pytest.mark.parametrize(("same", "cross", "null", "verdict", "says"), [
    (10, 10, 30, "shared across users", "cross-user hits reach their first token sooner than misses"),
    (10, 30, 30, "isolated", "this server caches prompts per user and shares none across users"),
    (30, 30, 30, "no caching seen", "cannot tell a server that isolates users from one whose cache it cannot see"),
    (10, [10, 30], 30, "inconclusive", "cross-user hits are neither sooner than misses"),  # half of them hit
    (10, 10, 10, "inconclusive", "the null control (a miss primed by the prober itself"),  # biased: null as fast
])
def test_each_verdict_from_known_times(same, cross, null, verdict, says):
    v = judge(_times(random.Random(0), 20, same, cross, 30, null), TOKENS, 1e-8, primer_tokens=2)
    assert (v.verdict, v.exit_status) == (verdict, VERDICTS[verdict]) and says in v.reason, v
    assert v.samples == 20 and v.prompt_tokens == 64 and v.medians_ms["miss"] > 30


def test_no_caching_seen_says_what_to_try_and_isolated_needs_cross_user_hits_later_than_same_user_ones():
    rng = random.Random(2)
    none = judge(_times(rng, 20, 30, 30, 30, 30), TOKENS, 1e-8, primer_tokens=3)
    assert none.exit_status == 4 and none.same.p_value >= 1e-8
    assert "longer prompts (--prompt-tokens), primers that generate more than 3 tokens (--primer-tokens), more " \
           "rounds, or the server's prefix cache turned on" in none.reason
    isolated = judge(_times(rng, 20, 10, 30, 30, 30), TOKENS, 1e-8)
    assert isolated.verdict == "isolated" and isolated.apart.p_value < 1e-8 and isolated.cross.p_value >= 1e-8
    between = judge(_times(rng, 20, 10, [10, 30], 30, 30), TOKENS, 1e-8)  # the control: not later than same-user
    assert between.verdict == "inconclusive" and between.apart.p_value >= 1e-8 and between.cross.p_value >= 1e-8


def test_no_verdict_from_too_few_samples_unequal_prompts_or_a_server_too_fast_to_time():
    rng = random.Random(1)
    few = judge(_times(rng, 9, 10, 10, 30, 30), {}, 1e-8, stopped="stopped in round 10 of 250: HTTP 429")
    assert few.verdict == "no verdict" and few.exit_status == 2 and few.samples == 9
    assert few.reason.startswith(f"9 samples a side: at alpha 1e-08 the test needs at least {fewest_samples(1e-8)}")
    assert few.reason.endswith("(stopped in round 10 of 250: HTTP 429)") and few.cross.p_value is not None
    unequal = judge(_times(rng, 20, 10, 10, 30, 30), {**TOKENS, "miss": [80] * 20, "null": [80] * 20}, 1e-8)
    assert unequal.verdict == "no verdict"
    assert "unequal length (same 64, cross 64, miss 80, null 80 tokens)" in unequal.reason
    fast = judge(_times(rng, 20, 1.0, 1.0, 1.0, 1.0, floor=1.0), {}, 1e-8)
    assert fast.verdict == "no verdict" and "cannot show in time: use longer prompts" in fast.reason
    # a control: the same timings a clear step above the floor do get a verdict
    assert judge(_times(rng, 20, 5.0, 5.0, 5.0, 5.0, floor=1.0), {}, 1e-8).verdict == "no caching seen"


def test_the_smallest_sample_that_separates_is_the_fewest_at_which_the_distance_reaches_alpha():
    assert fewest_samples(1e-8) == 15 and samples_to_separate(1.0, 1e-8) == 15
    for d, alpha in ((0.75, 1e-8), (0.5, 1e-3), (0.3, 0.01)):
        n = samples_to_separate(d, alpha)
        for m, reaches in ((n, True), (n - 1, False)):
            fast, slow = list(range(m)), [x + math.ceil(d * m) for x in range(m)]  # D = ceil(d m) / m
            assert (ks_test(fast, slow)[1] < alpha) is reaches, (d, alpha, m)


FAST = dict(samples=10, prompt_tokens=64, alpha=1e-3)  # 10 rounds reach 1e-3 (complete separation: 5.4e-6)


@pytest.mark.slow
def test_a_server_with_leftover_work_and_no_cache_is_not_accused():
    """The reported false accusation: work left from the previous request landed on misses only. With
    a primer before every timed request, the tail lands on primers, and the null control agrees."""
    with FakeOpenAI(Behaviour("off", per_token=3e-4, tail=0.015)) as server:
        r = run_audit(AuditConfig(server.url, "fake", **FAST), seed=0)
    v = r.judge()
    assert v.verdict == "no caching seen" and v.cross.p_value > 1e-3 and v.null.p_value > 1e-3, v
    assert v.medians_ms["cross"] > 0.8 * v.medians_ms["miss"]  # no gap at all, not merely an insignificant one


@pytest.mark.parametrize(("behaviour", "primer", "verdict"), [
    (Behaviour("global"), 2, "shared across users"), (Behaviour("per-key"), 2, "isolated"),
    (Behaviour("off"), 2, "no caching seen"),
    # a server that caches nothing of a request ending in its prefill step, as transformers serve:
    (Behaviour("global", cache_after=2), 1, "no caching seen"), (Behaviour("global", cache_after=2), 2,
                                                                 "shared across users")])
@pytest.mark.slow
def test_the_paired_schedule_tells_shared_isolated_and_uncached_servers_apart(behaviour, primer, verdict):
    behaviour.per_token = 6e-4  # a miss's 38 ms of prefill stands clear of the floor on a loaded machine
    with FakeOpenAI(behaviour) as server:
        r = run_audit(AuditConfig(server.url, "fake", primer_tokens=primer, **FAST), seed=1)
    v = r.judge()
    assert v.verdict == verdict and v.null.p_value > 1e-3, v
    cached = {k: {s.cached_tokens for s in r.samples if s.kind == k} for k in ("same", "cross", "miss", "null")}
    assert cached["miss"] == cached["null"] == {0}  # fresh prompts share nothing
    assert cached["same"] == ({0} if verdict == "no caching seen" else {64})
    assert cached["cross"] == ({64} if verdict == "shared across users" else {0})


@pytest.mark.slow
def test_every_timed_request_follows_a_primer_of_its_length_in_balanced_orders():
    with FakeOpenAI(Behaviour("global", per_token=1e-5)) as server:
        r = run_audit(AuditConfig(server.url, "fake", **FAST), seed=2)
        log = server.log
    assert len(log) == 9 * 10  # four primers, four timed requests and a floor a round
    timed = [s for s in r.samples if s.kind != "floor"]
    assert all(s.prompt_tokens == s.primer_tokens == 64 for s in timed)
    assert [s.prompt_tokens for s in r.samples if s.kind == "floor"] == [1] * 10
    rounds = [tuple(s.kind for s in r.samples if s.index == i and s.kind != "floor") for i in range(10)]
    assert rounds == [ORDERS[i % 4] for i in range(10)]
    for i in range(4):  # each kind in each place once, and right after each other kind once
        assert sorted(o[i] for o in ORDERS) == ["cross", "miss", "null", "same"]
    assert len({(o[i], o[i + 1]) for o in ORDERS for i in range(3)}) == 12
    pairs = [(log[j], log[j + 1]) for start in range(0, len(log), 9) for j in range(start, start + 8, 2)]
    senders = {"same": ("kvviz-audit", True), "cross": ("kvviz-audit-other", True),  # (primed by, the same prompt)
               "miss": ("kvviz-audit-other", False), "null": ("kvviz-audit", False)}
    for s, ((primer_key, primer, primer_max), (key, prompt, max_tokens)) in zip(timed, pairs, strict=True):
        assert (primer_key, primer == prompt, primer_max, key, max_tokens) == (*senders[s.kind], 2, "kvviz-audit", 1)


@pytest.mark.slow
def test_the_cli_says_the_verdict_and_what_the_server_reported(tmp_path):
    with FakeOpenAI(Behaviour("global", per_token=2e-4)) as server:
        p = kvviz("audit-timing", "--base-url", server.url, "--model", "fake", "--samples", 10, "--prompt-tokens", 64,
                  "--alpha", 1e-3, "--quiet", "--db", tmp_path / "k.duckdb")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "SHARED ACROSS USERS (exit 1): cross-user hits reach their first token sooner than misses" in p.stdout
    assert "each after a primer of max_tokens 2" in p.stdout
    assert ("cached tokens: the server itself reported serving 10 of 10 cross-user and 10 of 10 same-user hits from "
            "its cache (shared across users)") in p.stdout and "CONTRADICTION" not in p.stdout
    with RunStore.open(tmp_path / "k.duckdb").read() as con:
        row = con.execute("SELECT level, verdict, primer_tokens, reported_cached_hits, reported_cached_same, "
                          "telemetry, contradiction, same_p_value < 1e-3 FROM timing_audits").fetchone()
        kinds = con.execute("SELECT DISTINCT kind FROM timing_samples ORDER BY kind").fetchall()
    assert row == ("paired", "shared across users", 2, 10, 10, "shared across users", None, True)
    assert kinds == [("cross",), ("floor",), ("miss",), ("null",), ("same",)]


@pytest.mark.slow
def test_a_server_too_fast_to_time_gets_no_verdict(tmp_path):
    with FakeOpenAI(Behaviour("global")) as server:
        p = kvviz("audit-timing", "--base-url", server.url, "--model", "fake", "--samples", 10, "--prompt-tokens", 64,
                  "--alpha", 1e-3, "--quiet", "--db", tmp_path / "k.duckdb")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "NO VERDICT (exit 2): a full prompt came no measurably later than a one-word one" in p.stdout
    assert "use longer prompts, or more rounds where the times are noisy" in p.stdout


@pytest.mark.parametrize(("fail", "says"), [
    ("429", "HTTP 429"), ("500", "HTTP 500"), ("break", "broke off a reply"),
    ("silent", "streamed no reply to a request (asked with stream: true), so there is no time to first token"),
    ("close", "closed the connection after")])
@pytest.mark.slow
def test_a_server_failing_part_way_keeps_its_timings_and_gives_no_verdict(tmp_path, fail, says):
    db = tmp_path / "k.duckdb"
    with FakeOpenAI(Behaviour("global", per_token=2e-4, fail_after=30, fail=fail)) as server:
        p = kvviz("audit-timing", "--base-url", server.url, "--model", "fake", "--samples", 10, "--prompt-tokens", 64,
                  "--alpha", 1e-3, "--json", "--quiet", "--db", db)
    v = json.loads(p.stdout)
    assert p.returncode == 2 and v["verdict"] == "no verdict", p.stdout + p.stderr
    assert v["reason"].startswith("3 samples a side: at alpha 0.001 the test needs at least 7")
    assert "stopped in round 4 of 10" in v["reason"] and says in v["reason"]
    # what was measured is kept and read: the server's own counts still speak (the timing channel cannot)
    assert v["telemetry"]["reading"] == "shared across users" and v["telemetry"]["cross_of"] == 3
    with RunStore.open(db).read() as con:
        kept = con.execute("SELECT count(*) FILTER (kind <> 'floor'), any_value(reason) FROM timing_samples "
                           "JOIN timing_audits USING (audit_id)").fetchone()
    assert kept == (13, v["reason"])  # 30 requests: three rounds (27), then a primer, a timed one and a primer


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


@pytest.mark.parametrize(("sharing", "reading"), [("global", "shared across users"), ("per-user", "isolated"),
                                                  ("off", "no caching seen")])
def test_kvviz_serve_reports_each_kind_of_hit_cached_exactly_where_its_policy_shares(tiny, sharing, reading):
    with Server(tiny, sharing) as s:
        r = run_audit(AuditConfig(s.url + "/v1", "tiny", samples=3, prompt_tokens=40, alpha=0.5), seed=1)
    by_kind = {k: [x.cached_tokens for x in r.samples if x.kind == k] for k in ("same", "cross", "miss", "null",
                                                                              "floor")}
    assert by_kind["miss"] == by_kind["null"] == by_kind["floor"] == [0, 0, 0]  # fresh prompts share nothing
    assert all(h > 0 for h in by_kind["same"]) if sharing != "off" else by_kind["same"] == [0, 0, 0]
    assert all(h > 0 for h in by_kind["cross"]) if sharing == "global" else by_kind["cross"] == [0, 0, 0]
    assert all(x.prompt_tokens == x.primer_tokens for x in r.samples if x.kind in ("same", "cross"))
    assert r.telemetry().reading == reading


def test_an_audit_is_recorded_with_its_verdict_controls_and_timings(tiny, tmp_path):
    with Server(tiny) as s:
        r = run_audit(AuditConfig(s.url + "/v1", "tiny", samples=3, prompt_tokens=40, primer_tokens=3, alpha=0.5),
                      seed=2)
    store, v = RunStore.open(tmp_path / "k.duckdb"), r.judge()
    audit_id = record(store, r, v)
    with store.read() as con:
        row = con.execute("SELECT level, samples, p_value, same_p_value, apart_p_value, null_p_value, verdict, "
                          "median_floor_ms, counted_prompt_tokens, primer_tokens, telemetry FROM timing_audits "
                          "WHERE audit_id = ?", [audit_id]).fetchone()
        timings = con.execute("SELECT kind, ttft_ms, prompt_tokens, primer_tokens FROM timing_samples "
                              "WHERE audit_id = ?", [audit_id]).fetchall()
    assert row == ("paired", 3, v.cross.p_value, v.same.p_value, v.apart.p_value, v.null.p_value, v.verdict,
                   v.medians_ms["floor"], v.prompt_tokens, 3, "shared across users")
    assert v.prompt_tokens is not None and v.prompt_tokens >= 40
    assert sorted(t for k, t, _, _ in timings if k == "null") == sorted(r.times("null")) and len(timings) == 15
    assert {(k, primer is None) for k, _, _, primer in timings} == {
        ("same", False), ("cross", False), ("miss", False), ("null", False), ("floor", True)}


def test_bad_settings_and_unreachable_servers_are_refused(tiny, tmp_path):
    db = str(tmp_path / "k.duckdb")
    p = kvviz_process("audit-timing", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--samples", "20",
                      "--db", db)
    assert p.returncode == 2 and "cannot reach http://127.0.0.1:9/v1" in p.stderr
    p = kvviz("audit-timing", "--base-url", "http://x/v1", "--model", "m", "--level", "global", "--db", db)
    assert p.returncode == 2 and "--level is gone: every audit is now paired" in p.stderr and "drop --level" in p.stderr
    p = kvviz("audit-timing", "--base-url", "http://x/v1", "--model", "m", "--samples", "8", "--db", db)
    assert p.returncode == 2 and "8 rounds (samples a side) cannot reach alpha 1e-08" in p.stderr
    assert "use at least 15 rounds" in p.stderr  # an audit that could never give a verdict is refused
    p = kvviz("audit-timing", "--base-url", "http://x/v1", "--model", "m", "--primer-tokens", "0", "--db", db)
    assert p.returncode == 2 and "the primers' max_tokens must be >= 1, got 0" in p.stderr
    p = kvviz("audit-timing", "--base-url", "localhost:8000", "--model", "m", "--db", db)
    assert p.returncode == 2 and "the base URL must be an http(s) URL" in p.stderr
    with Server(tiny) as s:
        with pytest.raises(AuditError, match="HTTP 404: the model 'not-served' does not exist; this server serves"):
            run_audit(AuditConfig(s.url + "/v1", "not-served", samples=2, prompt_tokens=20, alpha=0.5))
        with pytest.raises(AuditError, match=r"HTTP 404: Not Found \(is the base URL right\? .* ends in /v1\)$"):
            run_audit(AuditConfig(s.url, "tiny", samples=2, prompt_tokens=20, alpha=0.5))


def test_help_and_readme_give_every_verdict_its_exit_status_the_floor_and_the_one_set_of_defaults():
    p = kvviz("audit-timing", "--help")
    text = " ".join(p.stdout.split())  # argparse wraps the options' help
    for verdict, code in VERDICTS.items():
        assert re.search(rf"\b{code} {verdict} ", text), verdict
    assert "then the floor, a one-word prompt timed alone" in text and "--level is gone" in text
    assert f"(default {defaults.ROUNDS};" in text and f"(default {defaults.PROMPT_WORDS}:" in text
    assert f"(default {defaults.PRIMER_TOKENS}:" in text and f"(default {defaults.ALPHA:g})" in text
    readme = " ".join((ROOT / "README.md").read_text().split())
    for verdict, code in VERDICTS.items():
        assert f"**{verdict}** (exit {code}" in readme, verdict


def test_the_audit_page_runs_an_audit_and_shows_it_beside_the_past(tmp_path, monkeypatch):
    from .apptest import AppTest

    monkeypatch.setenv("KVVIZ_DB", str(tmp_path / "k.duckdb"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
    at.run()
    at.switch_page("kvviz/ui/pages/audit.py").run()
    at.selectbox(key="audit_model").set_value("tiny-llama").run()
    at.number_input(key="audit_samples").set_value(3).run()
    at.number_input(key="audit_words").set_value(40).run()
    at.number_input(key="audit_primer").set_value(3).run()
    at.number_input(key="audit_alpha").set_value(0.5).run()
    at.button(key="audit_go").click().run()
    assert not at.exception  # timing decides the verdict on the tiny model: one message, whichever it is
    said = [s.value for s in [*at.success, *at.info, *at.error, *at.warning]]
    assert len(said) == 1 and re.match(r"\*\*(Isolated|Shared across users|No caching seen|Inconclusive|No "
                                       r"verdict)\*\* on a kvviz server on tiny-llama", said[0]), said
    assert "for the null control, primers of max_tokens 3" in said[0] and "alpha 0.5" in said[0]
    assert ("Cached tokens: the server itself reported serving 3 of 3 cross-user and 3 of 3 same-user hits from its "
            "cache (shared across users)") in said[0]
    assert at.error, "sharing across users, said by the server itself, is red whatever timing says"
    with RunStore.open(tmp_path / "k.duckdb").read() as con:
        (audit_id,) = con.execute("SELECT audit_id FROM timing_audits").fetchone()
        assert con.execute("SELECT count(*) FROM timing_samples").fetchone()[0] == 15
    assert at.multiselect(key="audit_show").value == [audit_id]
    past = at.dataframe[0].value.iloc[0]  # the words asked, and the prompt as the server counted it
    assert past.prompt_words == 40 and past.server_prompt_tokens >= 40 and past.primer_tokens == 3
    assert past.level == "paired" and past.telemetry == "shared across users"
    assert f"audit_past_{audit_id}" in {el.key for el in at.get("plotly_chart")}
    at.radio(key="audit_target").set_value("a server at a URL").run()
    at.text_input(key="audit_url").input("http://127.0.0.1:9/v1").run()
    at.text_input(key="audit_remote_model").input("m").run()
    at.button(key="audit_go").click().run()
    assert "cannot reach http://127.0.0.1:9/v1" in at.error[0].value  # said in one sentence, no traceback
    assert f"audit_past_{audit_id}" in {el.key for el in at.get("plotly_chart")}, "the past audits stay below"


def test_the_page_starts_from_the_command_lines_defaults_and_its_labels_fit(tmp_path, monkeypatch):
    """Primer tokens, rounds, prompt length and alpha share a row of four columns: a label longer than
    about 20 characters wrapped onto a second line and pushed its input below its neighbours'."""
    from kvviz.cli import build_parser

    from .apptest import AppTest

    monkeypatch.setenv("KVVIZ_DB", str(tmp_path / "k.duckdb"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
    at.run()
    at.switch_page("kvviz/ui/pages/audit.py").run()
    row = [at.number_input(key=k) for k in ("audit_primer", "audit_samples", "audit_words", "audit_alpha")]
    assert all(len(w.label) <= 20 for w in row), [w.label for w in row]
    assert "one token each" in at.number_input(key="audit_words").help, "what the label left out, in its help"
    cli = build_parser().parse_args(["audit-timing", "--base-url", "http://x/v1", "--model", "m"])
    assert [w.value for w in row] == [cli.primer_tokens, cli.samples, cli.prompt_tokens, cli.alpha] == [
        defaults.PRIMER_TOKENS, defaults.ROUNDS, defaults.PROMPT_WORDS, defaults.ALPHA]


def test_the_figure_draws_each_kind_and_marks_each_hits_ks_distance():
    from kvviz.figures.audit_timing import ttft_ecdf

    same, cross, miss = [5.0, 6.0, 30.0, 7.0], [20.0, 26.0, 9.0, 41.0], [20.0, 25.0, 8.0, 40.0]
    fig = ttft_ecdf({"same": same, "cross": cross, "miss": miss, "null": [21.0, 9.0, 30.0], "floor": [1.0, 2.0, 3.0]})
    assert [t.name for t in fig.data] == ["same-user hit (4)", "cross-user hit (4)", "miss (4)", "null (3)",
                                          "same-user hit KS distance D = 0.75", "cross-user hit KS distance D = 0.00"]
    assert ks_test(same, miss)[0] == 0.75
    segment = fig.data[4]
    assert segment.x[0] == segment.x[1] == 7.0 and (segment.y[1] - segment.y[0]) == 0.75
    assert [s.x0 for s in fig.layout.shapes] == [2.0] and "floor 2.0 ms" in fig.layout.annotations[0].text
    old = ttft_ecdf({"hit": same, "miss": miss})  # an audit from before the paired one
    assert [t.name for t in old.data] == ["hit (4)", "miss (4)", "hit KS distance D = 0.75"]


def test_each_curve_rises_from_zero_so_the_first_round_draws_a_step():
    from kvviz.figures.audit_timing import ttft_ecdf

    fig = ttft_ecdf({"same": [5.0], "miss": [9.0], "null": [7.0, 8.0]})
    assert [(list(t.x), list(t.y)) for t in fig.data[:3]] == [([5.0, 5.0], [0.0, 1.0]), ([9.0, 9.0], [0.0, 1.0]),
                                                             ([7.0, 7.0, 8.0], [0.0, 0.5, 1.0])]


def test_audits_drawn_side_by_side_share_one_time_axis():
    from kvviz.figures.audit_timing import ttft_ecdf

    assert ttft_ecdf({"same": [5.0], "miss": [9.0]}, x_max=100.0).layout.xaxis.range == (0, 102.0)
    assert ttft_ecdf({"same": [5.0], "miss": [9.0]}).layout.xaxis.range is None  # alone: plotly fits it
