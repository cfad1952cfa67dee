"""The timing audit's cached-tokens channel (what the server itself reports of each probe) beside the
timing verdict: its reading, a contradiction where the two disagree, a server whose replies carry no
usage or refuse the primers' max_tokens; and audits stored before the paired one, still read."""

from __future__ import annotations

import json
import random

import duckdb
import pandas as pd
import pytest

from kvviz.audit_timing.recorded import list_audits, timings
from kvviz.audit_timing.telemetry import contradiction, read, said, tone
from kvviz.audit_timing.verdict import judge
from kvviz.store import SCHEMA_VERSION, RunStore
from kvviz.store.schema import TABLES
from tests.cli import kvviz
from tests.fake_openai import Behaviour, FakeOpenAI

FAST = ("--samples", 10, "--prompt-tokens", 64, "--alpha", 1e-3, "--quiet")


def _cached(same: list[int | None], cross: list[int | None], fresh: int | None = 0) -> dict:
    return {"same": same, "cross": cross, "miss": [fresh] * 4, "null": [fresh] * 4}


def test_the_channel_reads_what_the_server_said_of_each_kind_of_hit():
    shared = read(_cached([64] * 4, [0, 0, 64, 0]), any_usage=True)
    assert (shared.reading, shared.cross_cached, shared.cross_of, shared.same_cached) == ("shared across users", 1,
                                                                                        4, 4)
    assert said(shared) == ("the server itself reported serving 1 of 4 cross-user and 4 of 4 same-user hits from its "
                            "cache (shared across users)")
    assert read(_cached([64] * 4, [0] * 4), True).reading == "isolated"
    assert read(_cached([0] * 4, [0] * 4), True).reading == "no caching seen"
    # a chat template every prompt shares is cached for misses too: a hit is more than a fresh prompt gets
    template = read(_cached([80] * 4, [16] * 4, fresh=16), True)
    assert (template.reading, template.baseline, template.cross_cached) == ("isolated", 16, 0)
    partial = read(_cached([64, None, 64, 64], [0] * 4), True)
    assert partial.reading == "isolated" and partial.same_of == 3
    assert partial.note == "1 of 8 probes' replies did not say how many tokens were cached"


def test_a_channel_the_server_gives_nothing_to_is_said_unusable_never_read():
    none = read(_cached([None] * 4, [None] * 4, fresh=None), any_usage=False)
    assert none.reading is None and said(none) == ("the cached-tokens channel could not be used: the server returned "
                                                   "no usage with its streamed replies (asked for with stream_options "
                                                   "include_usage)")
    counts = read(_cached([None] * 4, [None] * 4, fresh=None), any_usage=True)
    assert counts.reading is None and "carry usage but no prompt_tokens_details.cached_tokens" in counts.note
    assert read({}, False).note.endswith("no probe was answered")


def _verdict(same: float, cross: float):
    rng = random.Random(0)
    times = {k: [c + rng.random() for _ in range(20)] for k, c in
             (("same", same), ("cross", cross), ("miss", 30), ("null", 30), ("floor", 1))}
    return judge(times, {}, 1e-8)


def test_a_contradiction_is_found_where_timing_and_the_servers_counts_disagree():
    isolated, shared, uncached = _verdict(10, 30), _verdict(10, 10), _verdict(30, 30)
    says_shared = read(_cached([64] * 20, [64] * 20), True)
    says_isolated = read(_cached([64] * 20, [0] * 20), True)
    says_nothing = read(_cached([0] * 20, [0] * 20), True)
    assert contradiction(isolated, says_shared) == (
        "timing says isolated, but the server itself reported serving 20 of 20 cross-user and 20 of 20 same-user hits "
        "from its cache (shared across users): timing could not see it (more rounds, longer prompts or a quieter "
        "machine)")
    assert contradiction(shared, says_nothing).startswith("timing says shared across users, but the server itself "
                                                          "reported serving only 0 of 20 cross-user")
    assert contradiction(uncached, says_isolated).startswith("timing says no caching seen, but")
    # controls: agreement, and a channel with no reading, are no finding
    for v, t in ((isolated, says_isolated), (shared, says_shared), (uncached, says_nothing),
                 (isolated, read({}, False))):
        assert contradiction(v, t) == "", (v.verdict, t.reading)
    assert (tone(isolated, says_isolated), tone(isolated, says_shared), tone(shared, says_nothing),
            tone(uncached, says_nothing), tone(isolated, read({}, False))) == (
        "success", "error", "error", "warning", "success")


@pytest.mark.slow
def test_the_cli_reports_and_stores_a_contradiction(tmp_path):
    """A server that shares its cache across users and reports 0 cached tokens for every request."""
    with FakeOpenAI(Behaviour("global", per_token=2e-4, usage="zero")) as server:
        p = kvviz("audit-timing", "--base-url", server.url, "--model", "fake", *FAST, "--db", tmp_path / "k.duckdb")
    assert p.returncode == 1, p.stdout + p.stderr  # the exit status is the timing verdict's
    assert "CONTRADICTION: timing says shared across users, but the server itself reported serving only 0 of 10" \
        in p.stdout
    with RunStore.open(tmp_path / "k.duckdb").read() as con:
        row = con.execute("SELECT verdict, telemetry, reported_cached_hits, contradiction "
                          "FROM timing_audits").fetchone()
    assert row[:3] == ("shared across users", "no caching seen", 0) and row[3].startswith("timing says shared")


@pytest.mark.slow
def test_a_server_without_usage_gets_a_timing_verdict_and_no_reading_from_its_counts(tmp_path):
    db = tmp_path / "k.duckdb"
    for usage, why in (("none", "the server returned no usage with its streamed replies"),
                       ("counts", "the replies carry usage but no prompt_tokens_details.cached_tokens")):
        with FakeOpenAI(Behaviour("per-key", per_token=2e-4, usage=usage)) as server:
            p = kvviz("audit-timing", "--base-url", server.url, "--model", "fake", *FAST, "--json", "--db", db)
        v = json.loads(p.stdout)
        assert p.returncode == 0 and v["verdict"] == "isolated", p.stdout + p.stderr
        assert v["telemetry"]["reading"] is None and why in v["telemetry"]["note"] and v["contradiction"] is None
        assert v["prompt_tokens"] == (None if usage == "none" else 64)
    with RunStore.open(db).read() as con:
        rows = con.execute("SELECT telemetry, reported_cached_hits, reported_cached_same, telemetry_note "
                           "FROM timing_audits ORDER BY created_at").fetchall()
    assert [r[:3] for r in rows] == [(None, None, None)] * 2 and "could not be used" in rows[0][3]


@pytest.mark.slow
def test_llama_cpps_own_count_is_read_where_usage_lacks_cached_tokens(tmp_path):
    """A server that says what it served from its cache only as llama-server does, in the last chunk's
    timings.cache_n: the channel reads it (per-key: every same-user hit cached, no cross-user one), and
    a stored audit keeps each probe's count; where usage has prompt_tokens_details too, usage wins."""
    db = tmp_path / "k.duckdb"
    with FakeOpenAI(Behaviour("per-key", per_token=2e-4, usage="timings")) as server:
        p = kvviz("audit-timing", "--base-url", server.url, "--model", "fake", *FAST, "--json", "--db", db)
    v = json.loads(p.stdout)
    assert p.returncode == 0 and v["verdict"] == "isolated", p.stdout + p.stderr
    t = v["telemetry"]
    assert (t["reading"], t["same_cached"], t["same_of"], t["cross_cached"], t["cross_of"]) == ("isolated", 10, 10,
                                                                                               0, 10), t
    with RunStore.open(db).read() as con:
        cached = dict(con.execute("SELECT kind, max(cached_tokens) FROM timing_samples WHERE kind <> 'floor' "
                                  "GROUP BY kind").fetchall())
    assert cached == {"same": 64, "cross": 0, "miss": 0, "null": 0}

    from kvviz.audit_timing.client import Prober

    with FakeOpenAI(Behaviour("global", usage="zero")) as server:  # usage says 0; a cache_n beside it is not read
        prober = Prober(server.url, "fake", "completions", "k", "u", 10)
        prober.send("one two three", 2)
        server.behaviour.usage = "timings"
        assert prober.send("one two three").cached_tokens == 3  # what timings.cache_n said
        server.behaviour.usage = "zero"
        assert prober.send("one two three").cached_tokens == 0


@pytest.mark.slow
def test_a_primer_max_tokens_the_server_refuses_is_said_with_what_to_try(tmp_path):
    db = tmp_path / "k.duckdb"
    with FakeOpenAI(Behaviour("global", per_token=2e-4, max_tokens=1)) as server:
        p = kvviz("audit-timing", "--base-url", server.url, "--model", "fake", *FAST, "--db", db)
        assert p.returncode == 2 and p.stdout == "", p.stdout
        assert ("refused a primer asking for max_tokens 2 with HTTP 400: max_tokens must be at most 1; --primer-tokens "
                "1 asks for one, though a server may then cache nothing of the primer") in p.stderr
        control = kvviz("audit-timing", "--base-url", server.url, "--model", "fake", *FAST, "--primer-tokens", 1,
                        "--db", db)
    assert control.returncode == 1 and "each after a primer of max_tokens 1" in control.stdout, control.stdout
    with RunStore.open(db).read() as con:
        assert con.execute("SELECT primer_tokens FROM timing_audits").fetchall() == [(1,)]  # the refused one: none


def test_audits_stored_before_the_paired_one_are_upgraded_in_place_and_still_read(tmp_path):
    db = tmp_path / "k.duckdb"
    with RunStore.open(db).write():  # a new file, with today's schema
        pass
    con = duckdb.connect(str(db))  # made into a version 16 file holding a global-level audit
    for c in TABLES["timing_audits"].columns:
        if c.added_in == "17":
            con.execute(f"ALTER TABLE timing_audits DROP COLUMN {c.name}")
    con.execute("INSERT INTO timing_audits (audit_id, created_at, base_url, model, level, samples, prompt_tokens, "
                "alpha, ks_statistic, p_value, median_hit_ms, median_miss_ms, detected, verdict, null_p_value) VALUES "
                "('old', now(), 'http://x/v1', 'm', 'global', 2, 64, 0.5, 1.0, 0.17, 5.0, 9.0, true, 'detected', 0.5)")
    con.executemany("INSERT INTO timing_samples (audit_id, kind, sample, ttft_ms) VALUES ('old', ?, ?, ?)",
                    [("hit", 0, 5.0), ("hit", 1, 5.5), ("miss", 0, 9.0), ("miss", 1, 9.5), ("floor", 0, 1.0)])
    con.execute("UPDATE meta SET value = '16' WHERE key = 'schema_version'")
    con.close()
    with RunStore.open(db).read() as con:
        version = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
        row = list_audits(con).iloc[0]
        drawn = timings(con, "old")
    assert version == SCHEMA_VERSION == "19"
    assert (row.level, row.verdict, row.median_cross_ms) == ("global", "detected", 5.0) and pd.isna(row.primer_tokens)
    assert drawn == {"hit": [5.0, 5.5], "miss": [9.0, 9.5], "floor": [1.0]}  # drawn as it was timed: plain hits
