"""The app on the bug classes of 2026 (docs/faults.md), as a new user met them in the browser walk:
a finding the telemetry check adds once the requests have ended is counted on the Run page and said in
words in the Leaks view; a request cancelled before its first token has no first-token step; the
side by side does not say a fault whose findings move no attention changed what was read."""

import re

import pytest

from kvviz.runners import live
from kvviz.store import RunStore
from kvviz.ui.live_page import shared

from . import test_app, test_monitor_page
from .test_app import charts, page, run_ids

empty_db, tiny = test_app.empty_db, test_app.tiny  # test_app's fixtures, shared
stopped, capture, replayed = test_monitor_page.stopped, test_monitor_page.capture, test_monitor_page.replayed


@pytest.mark.slow
def test_the_run_page_counts_the_telemetry_finding_made_after_the_last_step(empty_db):
    at = page("run")
    at.selectbox(key="run_model").set_value("tiny-llama").run()
    at.selectbox(key="run_scenario").set_value("uncounted_restore").run()
    at.button(key="run_go").click().run()
    assert not at.exception and not at.error
    [run_id] = run_ids(empty_db)
    with RunStore.open(empty_db).read() as con:
        (n,) = con.execute("SELECT count(*) FROM findings WHERE run_id = ?", [run_id]).fetchone()
    assert n == 1
    assert "1 finding." in at.success[0].value, at.success[0].value  # not "0 findings", nor "1 findings"
    assert any("telemetry_mismatch" in w.value and "after the last step" in w.value
               and "hit rate below counts what the replies reported" in w.value for w in at.warning)
    findings = next(m for m in at.metric if m.label == "findings")
    assert findings.value == "1" and findings.proto.delta == "+1 after the last step"
    at = page("inspector", run_id=run_id)
    at.segmented_control(key="insp_view").set_value("Leaks").run()
    said = [m.value for m in at.markdown if "telemetry_mismatch]" in m.value]
    assert len(said) == 1 and "C's reply reported 0 cached tokens" in said[0] and "(A's K/V)" in said[0], said
    at.segmented_control(key="insp_view").set_value("Cache").run()  # its hit rate is the engine's own count
    assert any("1 request was served cached K/V they do not count" in w.value for w in at.warning)


@pytest.mark.slow
def test_a_request_cancelled_before_its_first_token_has_no_first_token_step(empty_db, tiny):
    out = live.run(RunStore.open(empty_db), tiny, live.scenario_workload("hash_before_write", tiny),
                   "hash_before_write", scenario_name="hash_before_write")
    at = page("inspector", run_id=out.run_id)
    at.segmented_control(key="insp_view").set_value("Requests").run()
    df = at.dataframe[0].value.set_index("request_id")
    assert df.loc["A", "finish_reason"] == "cancelled" and df.first_token_step.isna()["A"]  # not -1
    assert df.loc["C", "first_token_step"] >= 0
    # its steps skip the one no request ran (A cancelled, C not yet arrived): the slider says so
    with RunStore.open(empty_db).read() as con:
        steps = [s for (s,) in con.execute("SELECT step FROM steps WHERE run_id = ? ORDER BY step",
                                           [out.run_id]).fetchall()]
    if steps[-1] - steps[0] + 1 != len(steps):
        assert "a step no request ran is skipped" in at.select_slider(key="insp_step").label


def test_the_side_by_side_of_a_telemetry_fault_does_not_say_what_was_read_changed(empty_db):
    at = page("scenarios")
    at.selectbox(key="sc_name").set_value("uncounted_restore")
    at.selectbox(key="sc_model").set_value("tiny-llama")
    at.button(key="sc_go").click().run()
    assert not at.exception and not at.error
    text = [m.value for m in at.markdown if m.value.startswith("**Generated text:**")]
    assert len(text) == 1 and "telemetry_mismatch" in text[0] and "only what was read" not in text[0], text


@pytest.mark.slow
def test_the_cross_tenant_caption_counts_the_blocks_drawn_on_each_replica(empty_db, tmp_path):
    """Walk finding: on the example fleet every one of the 12 blocks (4 hashes on 3 replicas) was drawn, and the
    caption said "The 4 most used drawn"; with the inferred ones it counts rows drawn of those counted above."""
    from kvviz.capture.synthetic import write_example
    from kvviz.runners.uploads import import_file

    write_example(tmp_path / "fleet.jsonl", 20_000)
    run_id = import_file(tmp_path / "fleet.jsonl", RunStore.open(empty_db))
    at = page("inspector", run_id=run_id)
    at.segmented_control(key="insp_view").set_value("Cross-tenant").run()
    assert not at.exception
    blocks = charts(at)["insp_cross_tenant"]["layout"]["yaxis"]["categoryarray"]
    said = [c.value for c in at.caption if "A salt is meant to keep tenants' blocks apart" in c.value]
    named = [int(m.value.split("**")[1].replace(",", "")) for m in at.markdown if "more carry a second salt" in m.value]
    assert named == [len(blocks)] and len(said) == 1 and not said[0].startswith("The "), (named, len(blocks), said)
    at.toggle(key="insp_inferred").set_value(True).run()
    rows = len(charts(at)["insp_cross_tenant"]["layout"]["yaxis"]["categoryarray"])
    counts = [int(n.replace(",", "")) for m in at.markdown if "more carry a second salt" in m.value
              for n in re.findall(r"\*\*([\d,]+)\*\*", m.value)]
    said = [c.value for c in at.caption if "A salt is meant to keep tenants' blocks apart" in c.value]
    assert said[0].startswith(f"The {rows} most used of the {sum(counts):,} drawn.") == (rows < sum(counts)), \
        (rows, counts, said)


@pytest.mark.slow
def test_the_live_hit_rate_after_a_replay_ends_is_the_last_one_measured_and_says_when(stopped, tmp_path):
    """Walk findings: once a replayed capture had ended, the hit rate tile read "-" (no store in the last
    second) under a course that had shown 26% for a minute; and the course went on a flat point a second."""
    at = replayed(capture(tmp_path / "fleet.jsonl", unsalted=0.0), capacity=256)
    course = shared().course  # it ends with the point taken once the replay had ended
    measured = [p.hit_ratio for p in course if p.hit_ratio is not None]
    tile = {m.label: m.value for m in at.metric}["hit rate"]
    assert measured and tile == f"{measured[-1]:.0%}", tile
    said = any(c.value.startswith("as of ") and "nothing stored since" in c.value for c in at.caption)
    assert said == (course[-1].hit_ratio is None), "a rate from an earlier second says when it was measured"
