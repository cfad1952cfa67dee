"""The order channel (audit-timing --channel order): the exact median test on known ranks, each verdict
from known ranks, and against kvviz serve on the tiny model: a server that admits its queue by longest
cached prefix (--schedule lpm) is caught sharing across users, the same server salted per user is
isolated, and first come first served (the control) shows no cache at all, whatever it shares; a server
that refuses the dummies with HTTP 429 is said to have done so, with nothing recorded as a verdict; and one
slower than the client's timeout is said to be slow, not to have closed the connection."""

from __future__ import annotations

import itertools
import time

import pytest

import kvviz.audit_timing.probe as probe
from kvviz.audit_timing.order import judge_order, shift_test
from kvviz.audit_timing.probe import AuditConfig, run_audit
from kvviz.audit_timing.telemetry import contradiction
from kvviz.audit_timing.verdict import smallest_p
from kvviz.errors import AuditError
from kvviz.models import load_model
from kvviz.store import RunStore
from tests.cli import kvviz
from tests.test_serve import Server


def test_the_shift_test_is_exact_one_sided_and_takes_ties():
    brute = []  # every split of the pooled ranks into groups of these sizes, counted by hand
    a, b = [1, 1, 3], [0, 5, 5, 4]
    for idx in itertools.combinations(range(7), 3):
        brute.append(sum((a + b)[i] for i in idx) <= sum(a))
    assert shift_test(a, b, 5).p_value == pytest.approx(sum(brute) / len(brute))
    assert shift_test([0] * 8, [6] * 8, 8).p_value == pytest.approx(smallest_p(8))  # the timing channel's floor
    assert shift_test([6] * 8, [0] * 8, 8).p_value == 1  # one-sided: finishing later is no evidence
    same = shift_test([6] * 8, [6] * 8, 8)
    assert same.p_value == 1 and same.ks_statistic == 0 and same.said() == "shift = 0.00, p = 1"
    assert shift_test([], [1], 8).p_value is None
    assert shift_test([1] * 6, [0, 5, 5, 5, 5, 5], 5).p_value < 1e-2  # a whole kind a step from the front


def _ranks(same, cross, null, n=8):
    return {"same": [same] * n, "cross": [cross] * n, "null": [null] * n}


@pytest.mark.parametrize(("ranks", "verdict", "says"), [
    (_ranks(1, 1, 8), "shared across users", "schedules one user's prompt by what another user's request left"),
    (_ranks(1, 8, 8), "isolated", "schedules by a cache it keeps per user"),
    (_ranks(8, 8, 8), "no caching seen", "first come first served, no cache, or a queue that empties"),
    (_ranks(1, 8, 8, n=3), "no verdict", "3 samples a side"),
])
def test_each_verdict_from_known_ranks(ranks, verdict, says):
    v = judge_order(ranks, {}, {}, dummies=8, alpha=1e-3)
    assert v.verdict == verdict and says in v.reason
    assert v.ranks == {k: float(r[0]) for k, r in ranks.items()}


def test_cross_user_probes_between_the_two_are_inconclusive():
    ranks = {"same": [0] * 8, "cross": [0, 8] * 4, "null": [8] * 8}
    v = judge_order(ranks, {}, {}, dummies=8, alpha=1e-3)
    assert v.verdict == "inconclusive" and "more rounds can tell isolation from sharing" in v.reason


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


@pytest.fixture
def even_words(tiny, monkeypatch):
    """The audit's words that are four tokens each in the tiny model's tokenizer, so that every prompt
    the server counts is as long as every other (SmolLM2 counts each word as one token)."""
    tok = tiny.tokenizer
    words = tuple(w for w in probe.WORDS if len(tok(" " + w, add_special_tokens=False).input_ids) == 4)
    assert len(words) >= 10
    monkeypatch.setattr(probe, "WORDS", words)


# A step of 8 tokens: each 65-token prompt takes nine, so the dummies keep the server queueing while the probe
# arrives; blocks of 16 so that fresh prompts share no first block. Six rounds: one round whose queue drained
# early still leaves p under alpha.
ENGINE = dict(block_size=16, num_blocks=256, max_batch_tokens=8)
ORDER = dict(samples=6, prompt_tokens=16, alpha=1e-2, channel="order", dummies=5, stagger=0.05)


def _server(tiny, sharing: str, schedule: str, **kw) -> Server:
    """kvviz serve on the tiny model at a step of at least 10 ms, as a real model's (the tiny one steps in
    about a millisecond, so that on a busy machine the dummies' queue could drain before the probe arrives)."""
    return Server(tiny, sharing, config={**ENGINE, "schedule": schedule}, on_step=lambda _: time.sleep(0.01), **kw)


@pytest.mark.slow
@pytest.mark.parametrize(("sharing", "schedule", "verdict"), [
    ("per-user", "lpm", "isolated"),
    ("global", "fcfs", "no caching seen"),  # the control: it shares, but its order cannot show it
])
def test_kvviz_serve_under_each_schedule(tiny, even_words, sharing, schedule, verdict):
    with _server(tiny, sharing, schedule) as s:
        r = run_audit(AuditConfig(s.url + "/v1", "tiny", **ORDER), seed=3)
    v = r.judge()
    assert v.verdict == verdict, (v.reason, {k: [x.rank for x in r.samples if x.kind == k] for k in v.ranks})
    assert v.ranks["null"] >= 4  # a fresh probe sent after the dummies finishes behind them under either schedule
    if schedule == "lpm":  # a cached probe jumps the queue wherever its prefix is the prober's to read
        assert v.ranks["same"] <= 2
    # the cached-tokens channel reads the probes' replies as the timing channel's
    t = r.telemetry()
    assert t.reading == ("isolated" if sharing == "per-user" else "shared across users")
    assert (contradiction(v, t) == "") == (schedule == "lpm")  # first come first served hides what the server says
    if schedule == "fcfs":
        assert contradiction(v, t).startswith("the finishing order says no caching seen, but the server itself "
                                              "reported serving 6 of 6 cross-user")
        assert "does not reorder by its cache (first come first served)" in contradiction(v, t)


@pytest.mark.slow
def test_the_cli_catches_longest_prefix_first_sharing_and_records_the_ranks(tiny, even_words, tmp_path):
    db = tmp_path / "k.duckdb"
    with _server(tiny, "global", "lpm") as s:
        p = kvviz("audit-timing", "--base-url", s.url + "/v1", "--model", "tiny", "--channel", "order",
                  "--samples", 6, "--prompt-tokens", 16, "--alpha", 1e-2, "--dummies", 5, "--quiet", "--db", db)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "6 rounds of a same-user hit, a cross-user hit and a fresh prompt (the null)" in p.stdout
    assert "SHARED ACROSS USERS (exit 1): probes another user had just sent finished ahead of fresh ones" in p.stdout
    assert "the server itself reported serving 6 of 6 cross-user and 6 of 6 same-user hits" in p.stdout
    with RunStore.open(db).read() as con:
        audit = con.execute("SELECT channel, dummies, verdict, samples FROM timing_audits").fetchone()
        ranks = con.execute("SELECT kind, count(*), median(rank) FROM timing_samples GROUP BY kind "
                            "ORDER BY kind").fetchall()
    assert audit == ("order", 5, "shared across users", 6)
    assert [(k, n) for k, n, _ in ranks] == [("cross", 6), ("null", 6), ("same", 6)]
    (_, _, cross), (_, _, null), _ = ranks
    assert cross < null


@pytest.mark.slow
def test_a_server_that_refuses_the_dummies_is_said_to_and_gives_no_verdict(tiny, even_words, tmp_path):
    with _server(tiny, "global", "lpm", max_in_flight=3) as s:
        with pytest.raises(AuditError, match="refused a request with HTTP 429"):
            run_audit(AuditConfig(s.url + "/v1", "tiny", **ORDER), seed=3)
    for bad, says in ((dict(channel="sound"), "channel must be one of time, order"),
                      (dict(channel="order", dummies=1), "at least 2 dummies")):
        with pytest.raises(AuditError, match=says):
            AuditConfig("http://127.0.0.1:9/v1", "m", **bad)


def test_a_server_slower_than_the_clients_timeout_is_said_to_be_and_not_to_have_closed_the_connection():
    from tests.fake_openai import Behaviour, FakeOpenAI

    with FakeOpenAI(Behaviour("global", per_token=0.02)) as server:  # 64 words: over a second a prompt
        with pytest.raises(AuditError, match=r"did not answer a request within 0.3 s \(after 0 replies to this "
                                             r"user\): a server this slow, or this busy, cannot be audited"):
            run_audit(AuditConfig(server.url, "fake", samples=5, prompt_tokens=64, alpha=1e-2, timeout=0.3))


def _recorded_order_audit(db) -> str:
    """An order audit of ranks set by the test, recorded as the CLI records one."""
    from kvviz.audit_timing.probe import AuditResult, Sample, record

    cfg = AuditConfig("http://127.0.0.1:9/v1", "m", samples=5, prompt_tokens=16, alpha=1e-2, channel="order",
                      dummies=5)
    ranks = {"same": [0, 1, 1, 0, 2], "cross": [1, 0, 2, 1, 1], "null": [5, 5, 4, 5, 5]}
    result = AuditResult(config=cfg, samples=[
        Sample(kind=k, index=i, ttft_ms=10.0, cached_tokens=None, prompt_tokens=16, primer_tokens=16, rank=r)
        for k, rs in ranks.items() for i, r in enumerate(rs)])
    return record(RunStore.open(db), result)


def test_the_page_draws_an_order_audit_as_where_each_kind_of_probe_finished(tmp_path, monkeypatch):
    from kvviz.figures.audit_timing import rank_bars

    from .apptest import AppTest
    from .test_audit_timing import ROOT

    audit_id = _recorded_order_audit(tmp_path / "k.duckdb")
    monkeypatch.setenv("KVVIZ_DB", str(tmp_path / "k.duckdb"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
    at.run()
    at.switch_page("kvviz/ui/pages/audit.py").run()
    assert not at.exception
    past = at.dataframe[0].value.iloc[0]
    assert (past.channel, past.dummies, past.verdict) == ("order", 5, "shared across users")
    (chart,) = [el for el in at.get("plotly_chart") if el.key == f"audit_past_{audit_id}"]
    assert "order, shared across users" in chart.proto.spec and "dummies finished before the probe" in chart.proto.spec
    fig = rank_bars({"same": [0, 1, 1, 0, 2], "null": [5, 5, 4, 5, 5]}, 5)
    assert [t.name for t in fig.data] == ["same-user hit (5)", "null (5)"]
    assert list(fig.data[0].y) == [0.4, 0.4, 0.2, 0, 0, 0] and list(fig.data[1].y) == [0, 0, 0, 0, 0.2, 0.8]
