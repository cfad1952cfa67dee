"""The cache SQL views: block_lifetimes (each life of a cached block: when stored, hit, removed) and
hit_rate_per_interval, on a capture worked out by hand and on an engine run against its own events
and its capture."""

from __future__ import annotations

import pytest

from kvviz.analysis.explain import explain_run
from kvviz.capture.capture_file import CaptureWriter, Message
from kvviz.runners.uploads import import_file
from kvviz.store import RunStore
from tests.test_capture import batch, stored_map
from tests.test_explain import misses  # noqa: F401 (a fixture)

A, B, C = 11, 12, 13


def test_lives_hits_and_idle_time_of_a_capture_by_hand(tmp_path):
    removed = {"type": "BlockRemoved", "medium": "GPU"}
    timeline = [  # (ts, events)
        (0.0, [stored_map([A], None, [1, 2])]),
        (30.0, [stored_map([A], None, [1, 2])]),  # a repeat: a hit (kv_cache_report_mode=full)
        (100.0, [removed | {"block_hashes": [A]}]),
        (120.0, [stored_map([A], None, [1, 2])]),  # a second life
        (200.0, [{"type": "AllBlocksCleared"}]),  # ends it
        (210.0, [stored_map([B], None, [3, 4])]),  # still cached at the end
        (220.0, [removed | {"block_hashes": [C]}]),  # never cached: no life
    ]
    w = CaptureWriter(tmp_path / "c.jsonl", {"replica-0": "x"})
    for seq, (ts, events) in enumerate(timeline):
        w.add(Message("replica-0", 0, seq, "kv", batch(*events, ts=ts)))
    w.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    run = import_file(tmp_path / "c.jsonl", store)
    with store.read() as con:
        lives = con.execute("SELECT block_hash, life, stored_step, removed_step, lifetime_s, hits, last_hit_step, "
                            "idle_s FROM block_lifetimes WHERE run_id = ? ORDER BY block_hash, life", [run]).fetchall()
        rates = con.execute("SELECT interval_start, tokens, hit_tokens, hit_rate FROM hit_rate_per_interval "
                            "WHERE run_id = ? ORDER BY interval_start", [run]).fetchall()
    assert lives == [(A, 1, 0, 2, 100.0, 1, 1, 70.0), (A, 2, 3, 4, 80.0, 0, None, 80.0),
                     (B, 1, 5, None, None, 0, None, None)]
    assert rates == [(0.0, 4, 2, 0.5), (120.0, 2, 0, 0.0), (180.0, 2, 0, 0.0)]


def test_an_engine_runs_lives_and_hits_agree_with_its_events_and_its_capture(misses):  # noqa: F811
    store, run_id, capture_id, first = misses
    with store.read() as con:
        events = con.execute("SELECT step, kind, block, hash FROM block_events WHERE run_id = ? ORDER BY step, seq",
                             [run_id]).fetchall()
        lives = con.execute("SELECT block_hash, life, stored_step, removed_step, hits FROM block_lifetimes "
                            "WHERE run_id = ? ORDER BY block_hash, life", [run_id]).fetchall()
        captured = con.execute("SELECT block_hash, life, removed_step IS NULL FROM block_lifetimes WHERE run_id = ? "
                               "ORDER BY block_hash, life", [capture_id]).fetchall()
        served = con.execute("SELECT sum(hit_tokens), sum(tokens) FROM hit_rate_per_interval WHERE run_id = ?",
                             [run_id]).fetchone()
        looked_up = con.execute("SELECT sum(hit_tokens), sum(tokens) FROM cache_lookups WHERE run_id = ?",
                                [run_id]).fetchone()
    expected, open_life = [], {}  # the lives replayed from the engine's own block events, per block holding a hash
    published, cached = [], set()  # as a capture sees them: per hash, from its first store to its first removal
    for step, kind, block, h in events:
        if kind == "cache":
            open_life[h, block] = [h, step, block, None, 0]
            expected.append(open_life[h, block])
            if h not in cached:
                cached.add(h)
                published.append([h, True])  # [hash, still cached]
        elif kind == "evict" and (h, block) in open_life:
            open_life.pop((h, block))[3] = step
            if h in cached:
                cached.discard(h)
                next(p for p in reversed(published) if p[0] == h)[1] = False
        elif kind == "hit":
            for life in open_life.values():
                if life[2] == block:
                    life[4] += 1
    expected.sort(key=lambda e: e[:3])
    lives_of = {h: 0 for h, *_ in expected}
    numbered = []
    for h, stored, _, removed, hits in expected:
        lives_of[h] += 1
        numbered.append((h, lives_of[h], stored, removed, hits))
    assert lives == numbered
    assert any(e[3] is not None for e in expected) and any(e[4] > 0 for e in expected), "evictions and hits"
    assert len(published) < len(lives), "a prompt repeated whole recomputes its last block: a second copy"
    nth = {h: 0 for h, _ in published}
    for p in published:
        nth[p[0]] += 1
        p.insert(1, nth[p[0]])
    assert captured == sorted(tuple(p) for p in published), \
        "the capture has a life per stretch a hash was cached, from its first store to its first removal"
    assert served == looked_up and served[0] > 0


@pytest.mark.parametrize("view", ["block_lifetimes", "hit_rate_per_interval", "lookup_explanations"])
def test_the_sql_page_offers_the_cache_views(view):
    from kvviz.ui.sql_page import EXAMPLES

    assert any(view in sql for sql in EXAMPLES.values())


def test_the_cache_figures_draw_what_they_are_given():
    import pandas as pd

    from kvviz.figures import cache as cache_fig

    rates = pd.DataFrame({"interval_start": [0, 3], "tokens": [24, 24], "hit_tokens": [0, 16],
                          "hit_rate": [0.0, 16 / 24]})
    fig = cache_fig.hit_rate(rates, current=3)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["served from the cache"].y) == [0, 16] and list(by_name["computed (missed)"].y) == [24, 8]
    assert list(by_name["hit rate so far"].y) == [0.0, 16 / 48]
    lives = pd.DataFrame({"lifetime_steps": [5, None, 7], "idle_steps": [2, None, 1]})
    hist = cache_fig.lifetimes(lives)
    assert [list(t.x) for t in hist.data] == [[5, 7], [2, 1]], "lives still cached at the end are left out"


def test_the_inspectors_cache_view_shows_each_lookups_reason_up_to_the_step(misses, monkeypatch):  # noqa: F811
    from tests.test_app import charts, page

    store, run_id, _, first = misses
    monkeypatch.setenv("KVVIZ_DB", str(store.path))
    at = page("inspector", run_id=run_id)
    at.segmented_control(key="insp_view").set_value("Cache").run()
    assert not at.exception
    last = int(at.select_slider(key="insp_step").options[-1])
    at.session_state["insp_step"] = last
    at.run()
    table = at.dataframe[0].value
    firsts = table.drop_duplicates("request")  # a preempted request looks up again when it is re-admitted
    assert dict(zip(firsts.request, firsts.reason, strict=True)) == {r: e.reason for r, e in first.items()}
    assert "preempted" in set(table.reason)
    assert {"insp_hits", "insp_lives"} <= set(charts(at))
    at.session_state["insp_step"] = 2
    at.run()
    early = at.dataframe[0].value
    assert set(early.step) <= {0, 1, 2} and len(early) < len(table)


def test_the_inspectors_cache_view_explains_a_run_once_not_at_every_step(misses, monkeypatch):  # noqa: F811
    from kvviz.ui import inspect_cache
    from tests.test_app import page

    store, run_id, _, _ = misses
    monkeypatch.setenv("KVVIZ_DB", str(store.path))
    calls = []
    monkeypatch.setattr(inspect_cache, "explain_run", lambda con, rid: calls.append(rid) or explain_run(con, rid))
    inspect_cache._worked_out.clear()
    at = page("inspector", run_id=run_id)
    at.segmented_control(key="insp_view").set_value("Cache").run()
    for step in (1, 2, 3):
        at.session_state["insp_step"] = step
        at.run()
    assert not at.exception and len(at.dataframe[0].value) > 0
    assert calls == [run_id]


def test_the_cache_chart_spans_the_run_and_its_rate_axis_reads_in_percent():
    import pandas as pd

    from kvviz.figures import cache as cache_fig

    one = pd.DataFrame({"interval_start": [0], "tokens": [8], "hit_tokens": [0], "hit_rate": [0.0]})
    fig = cache_fig.hit_rate(one, current=0, steps=(0, 5))
    assert list(fig.layout.xaxis.range) == [-0.5, 5.5], "one lookup at step 0 still shows the run's steps"
    assert fig.layout.yaxis2.tickformat == ".0%" and fig.layout.yaxis2.dtick == 0.25


def test_evidence_says_what_its_numbers_count():
    from kvviz.ui.common import evidence_text

    assert evidence_text({"tokens_after": 2, "before": 3, "new_from_token": 8}) == (
        "2 prompt tokens after the cached ones (computed: a block not full, or the last token), "
        "3 steps before this lookup, new from token 8")


def test_a_lookup_that_hit_nothing_is_not_said_to_have_tokens_after_the_cached_ones():
    from kvviz.analysis.explain import Explanation
    from kvviz.ui.common import lookups_table

    short = Explanation("C", 0, 0, 0, 0, "partial_block", {"tokens_after": 3})  # a prompt shorter than a block
    assert lookups_table([short]).evidence[0].startswith("3 prompt tokens, none of them in a whole block")


def test_a_hit_on_another_tenants_blocks_is_a_column_of_its_own():
    from kvviz.analysis.explain import Explanation
    from kvviz.ui.common import lookups_table

    own = Explanation("A", 0, 0, 0, 0, "cold", {"new_from_token": 0})
    crossed = Explanation("B", 2, 12, 3, 12, "partial_block", {"tokens_after": 2, "hits_cached_under": "tenant-a"})
    assert "hits cached under" not in lookups_table([own]).columns  # no column where no hit crossed tenants
    table = lookups_table([own, crossed])
    assert list(table["hits cached under"].fillna("")) == ["", "tenant-a"]
    assert "cached under" not in table.evidence[1] and table.evidence[1].startswith("2 prompt tokens after")
