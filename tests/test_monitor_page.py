"""The app's Live page: one monitor for every session, started from the page on a replayed capture;
the figures as they come, the thresholds of the shipped rules shown and the crossings marked, and a
clean stream's counts left unmarked."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvviz.capture.capture_file import CaptureWriter
from kvviz.capture.synthetic import fleet_messages
from kvviz.serve.local import free_port
from kvviz.ui.live_page import shared

from .apptest import AppTest

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def live_page() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.switch_page("kvviz/ui/pages/live.py").run()
    assert not at.exception, at.exception[0].value
    return at


def capture(path: Path, unsalted: float) -> Path:
    writer = CaptureWriter(path, {"replica-0": "synthetic", "replica-1": "synthetic"})
    for m in fleet_messages(20_000, replicas=2, unsalted=unsalted, capacity=256):
        writer.add(m)
    writer.close()
    return path


@pytest.fixture
def stopped(tmp_path, monkeypatch):
    """The app's shared monitor, stopped after the test; the run store an empty one of its own."""
    monkeypatch.setenv("KVVIZ_DB", str(tmp_path / "kvviz.duckdb"))
    yield shared()
    shared().stop()


def test_the_page_waits_for_something_to_follow(stopped):
    stopped.stop()
    stopped.feed = None
    at = live_page()
    assert any("Nothing followed yet" in i.value for i in at.info)


def replayed(path: Path, capacity: int) -> AppTest:
    at = live_page()
    at.text_input(key="live_path").set_value(str(path))
    at.number_input(key="live_speed").set_value(0.0)
    at.number_input(key="live_capacity").set_value(capacity)
    at.button(key="live_go").click().run()
    live = shared()
    end = time.monotonic() + 60
    while not live.settled():  # the replay ends, and a point after it
        assert time.monotonic() < end, "the replay did not end"
        time.sleep(0.2)
    return at.run()


@pytest.mark.slow
def test_a_replayed_stream_with_cross_tenant_blocks_is_marked_and_every_session_sees_it(stopped, tmp_path):
    at = replayed(capture(tmp_path / "cross.jsonl", unsalted=0.05), capacity=100)
    assert not at.exception, at.exception[0].value
    metrics = {m.label: m for m in at.metric}
    assert int(metrics["cross-tenant blocks"].value.replace(",", "")) > 0
    assert metrics["cross-tenant blocks"].proto.delta == "should be 0"
    assert metrics["block utilisation"].proto.delta.startswith("past the alert threshold (over 95%")
    assert int(metrics["block utilisation"].value.rstrip("%")) > 100  # a pool of 256 a replica, 100 typed in
    assert any("more blocks held than the capacity given" in c.value for c in at.caption)
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert any("block utilisation alert: over 95%" in a.get("text", "") for a in spec["layout"]["annotations"])
    assert any(t.get("name") == "block utilisation past its threshold" and t["x"] for t in spec["data"])
    other = live_page()  # another session: the same monitor
    assert any("The app's monitor replayed all of cross.jsonl at full speed: " in m.value for m in other.markdown)
    replicas = other.dataframe[0].value
    assert len(replicas) and not replicas["followed"].any()  # the replay is over: no replica is followed
    points = len(shared().course)
    time.sleep(1.5)
    assert len(shared().course) == points, "a feed that ended adds no flat points to the chart"


@pytest.mark.slow
def test_a_clean_stream_leaves_the_zero_counts_and_utilisation_unmarked(stopped, tmp_path):
    at = replayed(capture(tmp_path / "clean.jsonl", unsalted=0.0), capacity=100_000)
    metrics = {m.label: m for m in at.metric}
    assert metrics["cross-tenant blocks"].value == "0" and not metrics["cross-tenant blocks"].proto.delta
    assert not metrics["block utilisation"].proto.delta
    assert not any("more blocks held than the capacity given" in c.value for c in at.caption)
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert not any(t.get("name") == "block utilisation past its threshold" and t["x"] for t in spec["data"])


def test_publishers_given_wrong_are_refused_in_one_sentence_and_nothing_starts(stopped):
    stopped.stop()
    stopped.feed = None
    at = live_page()
    at.radio(key="live_source").set_value("Publishers").run()
    at.text_area(key="live_endpoints").set_value("a=tcp://127.0.0.1:1\na=tcp://127.0.0.1:2")
    at.button(key="live_go").click().run()
    assert [e.value for e in at.error] == ["--endpoint: replica name 'a' is given twice"]
    assert stopped.feed is None and not stopped.running()


def test_a_capture_that_fails_on_its_first_line_says_why_and_draws_no_figures(stopped, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not a capture\n")
    at = live_page()
    at.text_input(key="live_path").set_value(str(bad))
    at.button(key="live_go").click().run()
    end = time.monotonic() + 30
    while shared().running():
        assert time.monotonic() < end, "the replay did not end"
        time.sleep(0.1)
    at.run()
    assert [e.value.split(": ")[0] for e in at.error] == ["The app's monitor stopped following bad.jsonl at 1x "
                                                          "after 0 messages"]
    assert "bad.jsonl: line 1: not valid JSON" in at.error[0].value
    assert not at.metric and not at.get("plotly_chart")


def test_publishers_that_never_answer_are_said_and_draw_no_empty_figures(stopped):
    at = live_page()
    at.radio(key="live_source").set_value("Publishers").run()
    at.text_area(key="live_endpoints").set_value(f"a=tcp://127.0.0.1:{free_port()}")
    at.button(key="live_go").click().run()
    assert shared().running()
    time.sleep(1.5)  # a fold or two
    at.run()
    assert any("following 1 publisher: 0 connected, 0 messages so far" in m.value for m in at.markdown)
    assert any("No publisher has answered yet" in w.value for w in at.warning)
    assert not at.metric and not at.get("plotly_chart")
