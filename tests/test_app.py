"""The Streamlit app, headless (AppTest): every page on an empty store and on one with runs, a run
started from the Run page, the inspector on a faulty run and its control, uploads, SQL and the runs
list. Chart clicks cannot be driven here; the browser test (test_browser.py) clicks them."""

import base64
import json
import re
import zipfile
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest

from kvviz.analysis.explained import explained, kept
from kvviz.models import load_model
from kvviz.runners import explain_jobs, live
from kvviz.store import RunStore
from kvviz.store.trace import export_run

from .apptest import AppTest

APP = str(Path(__file__).resolve().parent.parent / "app.py")
PAGES = ("home", "run", "inspector", "scenarios", "runs", "upload", "sql")
TIMEOUT = 120


def page(name: str, **state) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    for k, v in state.items():
        at.session_state[k] = v
    at.run()
    if name != "home":
        at.switch_page(f"kvviz/ui/pages/{name}.py").run()
    assert not at.exception, at.exception[0].value
    return at


def explained_in_background(at: AppTest, run_id: str) -> AppTest:
    """The inspector explains a capture it opens in the background: wait for it, then draw again."""
    job = explain_jobs.current(RunStore.open(), run_id)
    assert job is not None and job.wait(TIMEOUT) and job.error is None, job and job.error
    return at.run()


def run_ids(db) -> list[str]:
    with RunStore.open(db).read() as con:
        return [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY created_at").fetchall()]


def charts(at: AppTest) -> dict[str, dict]:
    """Plotly charts on the page by key: their figure specs."""
    out = {}
    for el in at.get("plotly_chart"):
        spec = json.loads(el.proto.spec)
        out[el.proto.id.split("-")[-1] if not el.key else el.key] = spec
    return out


def values(v) -> list:
    """A figure array as plotly serialises it: a list, or typed base64 ({"dtype", "bdata"})."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).tolist()
    return list(v)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny):
    """A store with the boundary scenario and its control."""
    db = tmp_path_factory.mktemp("app") / "kvviz.duckdb"
    wl = live.scenario_workload("boundary", tiny)
    faulty = live.run(RunStore.open(db), tiny, wl, "boundary", scenario_name="boundary")
    control = live.run(RunStore.open(db), tiny, wl, None, scenario_name="control of boundary")
    assert faulty.findings > 0 and control.findings == 0
    return db, faulty.run_id, control.run_id


@pytest.fixture
def empty_db(tmp_path, monkeypatch):
    db = tmp_path / "kvviz.duckdb"
    monkeypatch.setenv("KVVIZ_DB", str(db))
    return db


@pytest.fixture
def with_runs(store, monkeypatch):
    monkeypatch.setenv("KVVIZ_DB", str(store[0]))
    return store


@pytest.mark.parametrize("name", PAGES)
def test_every_page_renders_on_an_empty_store(empty_db, name):
    at = page(name)
    if name in ("home", "inspector", "runs", "sql"):
        assert any("No runs yet" in i.value for i in at.info)
        assert any(c.value.startswith("python -m kvviz run --scenario boundary") for c in at.code)
    assert not empty_db.exists() or name == "run"


@pytest.mark.parametrize("name", PAGES)
def test_every_page_renders_with_runs(with_runs, name):
    at = page(name)
    assert not at.error
    if name == "home":  # walk finding: which engine ran each recent run was missing
        assert set(at.dataframe[0].value.engine) == {"kvviz"}


def test_run_page_stores_a_run_and_opens_it(empty_db):
    at = page("run")
    at.selectbox(key="run_model").set_value("tiny-llama").run()
    at.selectbox(key="run_scenario").set_value("boundary").run()
    at.button(key="run_go").click().run()
    assert not at.exception and not at.error
    [run_id] = run_ids(empty_db)
    # the finished run stays on the page, its last step drawn, until the user opens it
    assert at.title[0].value == "Run" and run_id in at.success[0].value
    with RunStore.open(empty_db).read() as con:
        last = con.execute("SELECT max(step) FROM steps WHERE run_id = ?", [run_id]).fetchone()[0]
    assert charts(at)["run_final_pool"]["layout"]["title"]["text"] == f"Pool after step {last}, the last"
    tiles = {m.label: m.value for m in at.metric}
    assert tiles["block utilisation"] not in ("0.0%", "n/a") and tiles["slot utilisation"] != "n/a", tiles
    assert any("the last that held blocks" in c.value for c in at.caption)
    at.button(key="run_open").click().run()
    assert at.title[0].value == "Inspector" and at.session_state["run_id"] == run_id
    with RunStore.open(empty_db).read() as con:
        status, fault, findings = con.execute("SELECT status, fault, findings FROM runs").fetchone()
    assert (status, fault) == ("complete", "boundary") and findings > 0


def test_a_scenarios_request_that_names_no_arrival_step_arrives_at_step_0(empty_db):
    at = page("run")
    at.selectbox(key="run_scenario").set_value("unsalted_prefix").run()
    requests = at.dataframe[0].value
    assert dict(zip(requests.id, requests.arrival_step, strict=True)) == {"A": 0, "B": 2}


def test_prompts_that_share_a_long_start_are_shown_from_where_they_differ(empty_db):
    """Walk finding: the prompt column cut unsalted_prefix's two prompts inside their common system
    prompt, so they looked the same. The scenario's table shows each from where it differs, beside its id;
    the custom editor says it under the grid; prompts that differ early get neither."""
    from kvviz.ui.run_page import differing_parts

    at = page("run")
    at.selectbox(key="run_scenario").set_value("unsalted_prefix").run()
    table = at.dataframe[0].value
    assert list(table.columns[:3]) == ["id", "where it differs", "prompt"]
    assert dict(zip(table.id, table["where it differs"], strict=True)) == {"A": "…Hi.", "B": "…Hello."}
    at.selectbox(key="run_scenario").set_value("boundary").run()
    assert "where it differs" not in at.dataframe[0].value.columns, "Passphrase: / Password: differ at once"
    system = "You are a helpful assistant. "
    at = custom_requests({0: {"prompt": system + "Hi."}, 1: {"prompt": system + "Hello there."}})
    assert any(c.value == "Where the prompts differ: **A** …Hi. · **B** …Hello there." for c in at.caption)
    assert differing_parts({"A": system, "B": "Other words entirely", "C": system + "Again."}) == {
        "A": "(the start of C's)", "B": "Other words entirely", "C": "…Again."}
    assert differing_parts({"A": "Passphrase: red", "B": "Passphrase: green", "F": ""}) is None


def test_a_scenario_sized_to_the_tokenizer_says_so_and_runs_with_its_sized_pool(empty_db):
    at = page("run")
    at.selectbox(key="run_model").set_value("tiny-llama").run()
    at.selectbox(key="run_scenario").set_value("offload_stale_restore").run()
    sized = {t.label: t.value for t in at.text_input if t.disabled}
    assert sized == {"blocks": "sized to the model", "host tier blocks": "sized to the model"}
    at.button(key="run_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    with RunStore.open(empty_db).read() as con:
        engine = json.loads(con.execute("SELECT engine FROM runs").fetchone()[0])
    assert engine["offload"]["cpu_blocks"] == max(1, engine["num_blocks"] // 2)  # the scenario's half a pool


def custom_requests(edited_rows: dict) -> AppTest:
    """The Run page on tiny-llama with the custom request table, edited as a user would in the grid."""
    at = page("run")
    at.selectbox(key="run_model").set_value("tiny-llama").run()
    at.radio(key="run_source").set_value("custom").run()
    at.session_state["run_requests"] = {"edited_rows": edited_rows, "added_rows": [], "deleted_rows": []}
    at.run()
    return at


def test_a_run_stopped_by_a_rerun_says_so_and_keeps_the_edits(empty_db, monkeypatch):
    """Walk finding, checked in chromium: an edit committed while a run goes is kept, but the rerun it
    starts stops the run (recorded as failed) and the page said nothing. Streamlit stops the script by
    raising in it (a StopException out of the run, as here); the next render says so, edits in place.
    A refused run and a finished one say nothing of the kind."""
    from streamlit.runtime.scriptrunner_utils.exceptions import StopException

    def stopped(*args, **kw):
        raise StopException()

    stop = "The last run stopped before it finished"
    at = custom_requests({0: {"prompt": "an edit made before Run"}})
    monkeypatch.setattr(live, "run", stopped)
    at.button(key="run_go").click().run()
    at.session_state["run_requests"] = {"edited_rows": {0: {"prompt": "an edit made before Run"},
                                                        1: {"prompt": "an edit made while it ran"}},
                                        "added_rows": [], "deleted_rows": []}
    at.run()
    assert any(w.value.startswith(stop) for w in at.warning) and not at.exception
    assert list(at.session_state["run_requests_edited"].prompt) == ["an edit made before Run",
                                                                    "an edit made while it ran"]
    monkeypatch.undo()
    at.button(key="run_go").click().run()
    assert not at.exception and not at.error and at.success, "run again: it finishes"
    assert not any(w.value.startswith(stop) for w in at.warning)
    at = custom_requests({1: {"parent": "nobody"}})
    at.button(key="run_go").click().run()
    assert at.error and not any(w.value.startswith(stop) for w in at.warning), "refused: nothing was stopped"


def test_run_page_custom_workload_refused_with_the_field_named(empty_db):
    at = custom_requests({1: {"parent": "nobody"}})
    at.button(key="run_go").click().run()
    assert not at.exception
    assert any("parent" in e.value for e in at.error), [e.value for e in at.error]
    assert not empty_db.exists() or run_ids(empty_db) == []


def test_run_page_runs_a_resumed_session_with_a_host_tier_and_disaggregated_prefill(empty_db):
    at = custom_requests({1: {"parent": "A", "truncate": 12, "cache_salt": None, "arrival_step": 12,
                              "prompt": " and violet"}})
    at.number_input(key="run_host_custom").set_value(32).run()
    at.checkbox(key="run_dis_custom").check().run()
    at.button(key="run_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    [run_id] = run_ids(empty_db)
    with RunStore.open(empty_db).read() as con:
        engine = json.loads(con.execute("SELECT engine FROM runs").fetchone()[0])
        sent = con.execute("SELECT request_id FROM kv_transfers WHERE run_id = ? ORDER BY step", [run_id]).fetchall()
        prompts = dict(con.execute("SELECT request_id, prompt_ids FROM requests WHERE run_id = ?", [run_id]).fetchall())
    assert engine["offload"] == {"cpu_blocks": 32} and engine["disaggregated"] is True
    assert [r for (r,) in sent] == ["A", "B"]
    assert prompts["B"][:12] == prompts["A"][:12] and len(prompts["B"]) == 12 + len(" and violet")


def test_inspector_shows_the_leak_of_a_faulty_run(with_runs):
    _, faulty, _ = with_runs
    at = page("inspector", run_id=faulty)
    figs = charts(at)
    block_map = figs["insp_blockmap"]
    outlines = [c for t in block_map["data"] for c in values(t["marker"]["line"]["color"])]
    assert "#d62728" in outlines  # a block read by the leak is outlined in red
    at.segmented_control(key="insp_view").set_value("Leaks").run()
    found = at.dataframe(key="insp_findings").value
    assert len(found) > 0 and set(found.kind) == {"foreign"} and found.position.notna().all()
    assert found.block.isna().all() and at.dataframe(key="insp_findings").proto.placeholder == "—"  # not "None"
    assert at.button(key="insp_top_finding").label == "Go to the heaviest finding"
    at.button(key="insp_top_finding").click().run()
    assert at.session_state["insp_view"] == "Attention"
    heatmap = charts(at)["insp_heatmap"]
    assert "foreign" in {t.get("name") for t in heatmap["data"]}
    assert [sh["type"] for sh in heatmap["layout"]["shapes"]].count("rect") == 1, "the finding's query is outlined"
    assert not at.exception


def test_the_inspector_opens_a_run_at_its_first_finding_or_its_fullest_pool_and_says_why(with_runs):
    """Walk finding: a run opened at a step in its middle (the heaviest finding's) with no reason given.
    A faulty run opens at the first step with a finding, a clean one where the most blocks were in use,
    and a caption beside the slider says which and why, until the user moves to another step."""
    db, faulty, control = with_runs
    with RunStore.open(db).read() as con:
        first = con.execute("SELECT min(step) FROM findings WHERE run_id = ?", [faulty]).fetchone()[0]
        fullest = con.execute("SELECT step FROM blocks WHERE run_id = ? GROUP BY step ORDER BY count(*) FILTER "
                              "(state = 'used') DESC, step LIMIT 1", [control]).fetchone()[0]
        last = con.execute("SELECT max(step) FROM steps WHERE run_id = ?", [control]).fetchone()[0]
    at = page("inspector", run_id=faulty)
    assert at.session_state["insp_step"] == first
    said = [c.value for c in at.caption if c.value.startswith("Opened at step ")]
    assert said and said[0].startswith(f"Opened at step {first}, the first step with a finding (foreign, "), said
    at.session_state["insp_step"] = first + 1
    at.run()
    assert not [c for c in at.caption if c.value.startswith("Opened at step ")], "said only at the step it opened at"
    at = page("inspector", run_id=control)
    assert at.session_state["insp_step"] == fullest != last
    assert any(c.value == f"Opened at step {fullest}, where the most blocks were in use: this run has no finding."
               for c in at.caption)


def test_inspector_shows_no_finding_for_the_control(with_runs):
    _, _, control = with_runs
    at = page("inspector", run_id=control)
    outlines = [c for t in charts(at)["insp_blockmap"]["data"] for c in values(t["marker"]["line"]["color"])]
    assert "#d62728" not in outlines
    at.segmented_control(key="insp_view").set_value("Leaks").run()
    assert any("No findings" in s.value for s in at.success)
    assert not any("cross-tenant reads" in w.value for w in at.warning)
    at.segmented_control(key="insp_view").set_value("Attention").run()
    heatmap = charts(at)["insp_heatmap"]
    assert {t.get("name") for t in heatmap["data"]} == {"own"}


def test_a_blank_grid_of_this_step_says_the_request_leaked_nowhere_then(with_runs):
    """Walk finding: the 'this step' grid was all white beside a heatmap of foreign mass from earlier steps,
    without a word. At a step where the request put no foreign weight it says so; where it did, it does not."""
    db, faulty, _ = with_runs
    with RunStore.open(db).read() as con:
        per_step = con.execute("SELECT request_id, step, max(max_foreign) FROM leak_metrics WHERE run_id = ? "
                               "GROUP BY ALL", [faulty]).fetchall()
    clean = next((r, t) for r, t, m in per_step if m == 0)
    leaked = next((r, t) for r, t, m in per_step if m > 0)
    at = page("inspector", run_id=faulty)
    at.segmented_control(key="insp_view").set_value("Attention").run()
    for (request, step), blank in ((clean, True), (leaked, False)):
        at.selectbox(key="insp_request").set_value(request)
        at.session_state["insp_step"] = step
        at.radio(key="insp_grid_scope").set_value("this step").run()
        assert not at.exception
        said = [c.value for c in at.caption if "put no weight on another request's or a stale key" in c.value]
        assert said == ([f"{request} put no weight on another request's or a stale key at step {step}: every cell "
                         "is 0. The heatmap beside it counts every step so far; *the whole run* shows where "
                         f"{request} leaked at any step."] if blank else []), (request, step)


GONE = "is not in the store: it was deleted, or never recorded in"


def test_a_link_to_a_run_not_in_the_store_is_said_not_swapped_silently(with_runs):
    """Walk finding: a link to a run that is gone (deleted, or never recorded in this store), from
    another page or the URL, opened the newest run in its place without a word. It says so until the
    user picks a run; a link to a run that is there says nothing of the kind."""
    _, faulty, control = with_runs
    at = page("inspector", run_id="deleted0")
    said = [w.value for w in at.warning if GONE in w.value]
    assert said and said[0].startswith("Run deleted0 " + GONE), said
    newest = control  # recorded after the faulty run
    assert said[0].endswith(f"Showing run {newest} instead.") and at.selectbox(key="insp_run").value == newest
    at.selectbox(key="insp_run").set_value(faulty).run()  # the user picks a run: the link is forgotten
    assert not [w for w in at.warning if GONE in w.value] and not at.exception
    at = page("inspector", run_id=faulty)
    assert not [w for w in at.warning if GONE in w.value] and not at.error


def _end_not_written(rec, run) -> None:
    """save_run's stand-in: the steps so far written, the end (requests, findings, divergences and
    totals) not: the store as a run still recording at its last step, or killed there, leaves it."""
    rec.flush()
    rec.wait()


@pytest.fixture(scope="module")
def recording(tmp_path_factory, tiny):
    """A store with the boundary scenario still recording: its leak metrics and steps are written, its
    requests and findings not yet."""
    db = tmp_path_factory.mktemp("recording") / "kvviz.duckdb"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvviz.runners.recorded.save_run", _end_not_written)
        run_id = live.run(RunStore.open(db), tiny, live.scenario_workload("boundary", tiny), "boundary",
                          scenario_name="boundary").run_id
    with RunStore.open(db).read() as con:
        assert con.execute("SELECT status FROM runs").fetchall() == [("running",)]
        assert con.execute("SELECT count(*) FROM leak_metrics WHERE leak_rows > 0").fetchone()[0] > 0
        assert con.execute("SELECT (SELECT count(*) FROM findings) + (SELECT count(*) FROM requests)").fetchone() \
            == (0,)
    return db, run_id


NO_FINDINGS_YET = "No findings yet: a run's findings are written when it ends."


@pytest.mark.slow
def test_a_recording_run_says_its_findings_are_not_written_yet(recording, with_runs, monkeypatch):
    """Walk finding: while a run records, its Leaks view said 'No findings' beside a leak timeline that
    already showed the leak. It says they are not written yet; a finished run lists its findings."""
    db, run_id = recording
    monkeypatch.setenv("KVVIZ_DB", str(db))
    at = page("inspector", run_id=run_id)
    at.segmented_control(key="insp_view").set_value("Leaks").run()
    assert any(i.value == NO_FINDINGS_YET for i in at.info) and not at.success and not at.exception
    assert "insp_timeline" in charts(at)  # the oracle's metrics, written step by step, show the leak
    assert any(c.value.endswith(": no finding yet (a run's are written when it ends).") for c in at.caption)
    monkeypatch.setenv("KVVIZ_DB", str(with_runs[0]))
    at = page("inspector", run_id=with_runs[1])
    at.segmented_control(key="insp_view").set_value("Leaks").run()
    assert len(at.dataframe(key="insp_findings").value) > 0 and not any(NO_FINDINGS_YET in i.value for i in at.info)


@pytest.mark.slow
def test_a_recording_run_says_no_request_has_finished_yet(recording, with_runs, monkeypatch):
    """Walk finding: while a run records, its Attention view said 'This run has no requests.' It says
    none has finished yet; a finished run draws a request's heatmap."""
    db, run_id = recording
    monkeypatch.setenv("KVVIZ_DB", str(db))
    at = page("inspector", run_id=run_id)
    at.segmented_control(key="insp_view").set_value("Attention").run()
    assert any(i.value.startswith("No request has finished yet") for i in at.info) and not at.exception
    monkeypatch.setenv("KVVIZ_DB", str(with_runs[0]))
    at = page("inspector", run_id=with_runs[2])
    at.segmented_control(key="insp_view").set_value("Attention").run()
    assert "insp_heatmap" in charts(at) and not any("No request" in i.value for i in at.info)


@pytest.mark.slow
def test_an_unsalted_run_says_its_cross_tenant_reads_beside_the_zero_leak_figures(empty_db):
    """Run from the Run page: the inspector it opens, the Leaks view and the heatmap say which blocks of
    tenant-a tenant-b read and when, and the heatmap draws them as another tenant's."""
    at = page("run")
    at.selectbox(key="run_model").set_value("tiny-llama").run()
    at.selectbox(key="run_scenario").set_value("unsalted_prefix").run()
    at.button(key="run_go").click().run()
    at.button(key="run_open").click().run()
    assert not at.exception and not at.error and at.title[0].value == "Inspector"
    [run_id] = run_ids(empty_db)
    with RunStore.open(empty_db).read() as con:
        hit = sorted(b for (b,) in con.execute("SELECT block FROM block_events WHERE run_id = ? AND kind = 'hit' "
                                               "AND request_id = 'B'", [run_id]).fetchall())
    said = f"cross-tenant reads: {len(hit)} blocks of tenant-a read by tenant-b (B read blocks "
    assert any(said in w.value for w in at.warning), [w.value for w in at.warning]  # under findings and mass 0
    assert any("foreign mass stay 0" in w.value for w in at.warning if said in w.value)
    at = page("inspector", run_id=run_id)  # a rerun here would run the Run page again
    at.segmented_control(key="insp_view").set_value("Leaks").run()
    assert any(said in m.value for m in at.markdown)
    found = at.dataframe(key="insp_findings").value
    assert set(found.kind) == {"cross_tenant"} and sorted(found.block) == hit
    assert found[["layer", "head", "mass", "position"]].isna().all().all(), "a block read: no query position"
    assert list(found.columns[:5]) == ["kind", "request_id", "step", "last_step", "block"]
    assert at.button(key="insp_top_finding").label == "Go to the first finding", "no mass: none is heaviest"
    at.segmented_control(key="insp_view").set_value("Attention").run()
    heatmap = charts(at)["insp_heatmap"]
    assert "another tenant's (same content)" in {t.get("name") for t in heatmap["data"]}
    assert "cross-tenant reads: " in heatmap["layout"]["title"]["text"]
    assert not at.exception


@pytest.mark.slow
def test_a_run_that_also_leaked_does_not_say_its_leak_figures_stay_0(empty_db):
    """Walk finding: a page table of zeros made B read tenant-a's block 0 on SmolLM2, part of it the same tokens at
    the same positions (a cross-tenant read) and the rest not (a leak); the notice said the figures stay 0 beside
    a foreign mass near 1. The notice follows the run's own figure: the same run, its foreign mass set as such a
    run's would be, says the figures count the other keys."""
    from kvviz.analysis import cross_reads

    assert "stay 0" in cross_reads.why(False) and "count the keys that differ" in cross_reads.why(True)
    at = page("run")
    at.selectbox(key="run_model").set_value("tiny-llama").run()
    at.selectbox(key="run_scenario").set_value("unsalted_prefix").run()
    at.button(key="run_go").click().run()
    [run_id] = run_ids(empty_db)
    at = page("inspector", run_id=run_id)
    assert [w.value for w in at.warning if "cross-tenant reads" in w.value and "stay 0" in w.value]
    with duckdb.connect(str(empty_db)) as con:
        con.execute("UPDATE runs SET max_foreign_mass = 0.9947, leak_rate = 0.378")
    at = page("inspector", run_id=run_id)
    warned = [w.value for w in at.warning if "cross-tenant reads" in w.value]
    assert warned and all("count the keys that differ" in w and "stay 0" not in w for w in warned)


@pytest.mark.parametrize("fault", ["unsalted_prefix", None], ids=["unsalted", "control"])
def test_the_inspector_opens_a_cross_tenant_run_where_b_read_a_s_blocks_and_outlines_them(tiny, tmp_path,
                                                                                          monkeypatch, fault):
    """B writes one token, as on smollm2: it arrives, reads A's blocks and finishes in one step. The
    inspector opens the Blocks view at that step with the blocks B read outlined, and does not send the
    user a step back (where B was not there yet); the control outlines nothing."""
    from kvviz.figures.palette import CROSS_READ

    db = tmp_path / "kvviz.duckdb"
    monkeypatch.setenv("KVVIZ_DB", str(db))
    wl = live.scenario_workload("unsalted_prefix", tiny)
    wl["requests"] = [r | {"max_new_tokens": 1} if r["id"] == "B" else r for r in wl["requests"]]
    run_id = live.run(RunStore.open(db), tiny, wl, fault).run_id
    with RunStore.open(db).read() as con:
        read = dict(con.execute("SELECT block, step FROM findings WHERE run_id = ? AND kind = 'cross_tenant'",
                                [run_id]).fetchall())
        b_ran = con.execute("SELECT list(DISTINCT step) FROM step_work WHERE run_id = ? AND request_id = 'B'",
                            [run_id]).fetchone()[0]
    at = page("inspector", run_id=run_id)
    assert at.session_state["insp_view"] == "Blocks" and not at.exception
    block_map = charts(at)["insp_blockmap"]
    outlined = {row[0] for t in block_map["data"]
                for row, c in zip(t["customdata"], values(t["marker"]["line"]["color"]), strict=True)
                if c == CROSS_READ}
    said = " ".join(c.value for c in at.caption)
    assert "step back one" not in said
    if fault:
        assert len(b_ran) == 1 and set(read.values()) == set(b_ran), "B ran one step: it read A's blocks then"
        assert at.session_state["insp_step"] == b_ran[0] and outlined == set(read)
        assert f"{len(read)} read by another tenant" in block_map["layout"]["title"]["text"]
        assert "B ran in this step only" in said and "Black outline" in said
    else:
        assert read == {} and outlined == set() and "Black outline" not in said


def test_the_scenarios_side_by_side_says_the_faults_cross_tenant_reads_and_not_the_controls(empty_db):
    """unsalted_prefix leaks no attention (its heatmap shows none): the side by side says the reads beside
    it, under the fault's column only."""
    from kvviz.analysis import cross_reads

    at = page("scenarios")
    at.selectbox(key="sc_name").set_value("unsalted_prefix")
    at.selectbox(key="sc_model").set_value("tiny-llama")
    at.button(key="sc_go").click().run()
    assert not at.exception and not at.error
    pair = at.session_state["sc_pair"]
    with RunStore.open(empty_db).read() as con:
        said = cross_reads.sentence(cross_reads.from_store(con, pair["scenario"]))
        assert said and cross_reads.from_store(con, pair["control"]) == []
    warned = [w.value for w in at.warning if "cross-tenant reads" in w.value]
    assert len(warned) == 1 and warned[0].startswith(f"**{said}.**") and "foreign mass stay 0" in warned[0]
    served = [dict(zip(t.value.request_id, t.value.cached_tokens, strict=True)) for t in at.dataframe[:2]]
    assert served[0]["B"] > 0 and served[1]["B"] == 0, "B's prompt came from A's cache under the fault only"
    assert "sc_diff" not in {el.key for el in at.get("plotly_chart")}, "no blank grid of equal foreign mass"
    assert any("the same as in the control run at every layer and head: the keys read across tenants" in m.value
               for m in at.markdown)


def test_the_scenarios_side_by_side_draws_the_foreign_mass_a_fault_adds(empty_db):
    """The positive case of the one above: a leak of attention draws its layer x head difference; once one
    of its runs is deleted, the page says so instead of failing."""
    from kvviz.analysis.runs import delete_run

    at = page("scenarios")
    at.selectbox(key="sc_name").set_value("boundary")
    at.selectbox(key="sc_model").set_value("tiny-llama")
    at.button(key="sc_go").click().run()
    assert not at.exception and not at.error
    assert "sc_diff" in {el.key for el in at.get("plotly_chart")}
    (grid,) = charts(at)["sc_diff"]["data"]  # the difference on a scale centred at 0, the layers that differ only
    assert grid["type"] == "heatmap" and grid["zmid"] == 0 and grid["zmin"] == -grid["zmax"]
    assert 0 < len(grid["y"]) and all(any(t for t in row) for row in grid["text"])
    panels = [charts(at)[f"sc_hm_{r}"] for r in ("scenario", "control")]
    tops = {t["zmax"] for p in panels for t in p["data"] if t["name"] == "own"}
    assert len(tops) == 1, f"the two heatmaps colour their own weights on different scales: {tops}"
    assert any(c.value.startswith("Largest difference: ") and float(c.value.split(": ")[1].rstrip(".")) > 0
               for c in at.caption)
    texts = [d for d in at.dataframe if "tenant" in d.value.columns]  # no tenants here: a dash, not "None"
    assert len(texts) == 2 and all(d.value.tenant.isna().all() and d.proto.placeholder == "—" for d in texts)
    pair = at.session_state["sc_pair"]
    assert page("inspector").session_state["insp_run"] == pair["scenario"], \
        "a new session's inspector opens the run under study (the newest), not its control"
    control = pair["control"]
    delete_run(RunStore.open(empty_db), control)  # deleted since, from the Runs page or the CLI
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert [w.value for w in at.warning if "no longer in the store" in w.value] == [
        f"This comparison's control run ({control}) is no longer in the store: it was deleted. Run the scenario "
        "again to compare."]
    assert "Side by side" not in [h.value for h in at.subheader], "no panel drawn from half a comparison"


def test_upload_imports_a_trace_and_refuses_a_broken_one(with_runs, tmp_path, monkeypatch):
    db, faulty, _ = with_runs
    trace = export_run(RunStore.open(db), faulty, tmp_path / "t.zip")
    target = tmp_path / "fresh.duckdb"
    monkeypatch.setenv("KVVIZ_DB", str(target))
    at = page("upload")
    at.file_uploader(key="upload_file").set_value(("t.zip", trace.read_bytes(), "application/zip")).run()
    at.button(key="upload_go").click().run()
    assert not at.error and run_ids(target) == [faulty]
    at = page("upload")
    at.file_uploader(key="upload_file").set_value(("again.zip", trace.read_bytes(), "application/zip")).run()
    at.button(key="upload_go").click().run()
    assert not at.error and any(f"imported before, as run {faulty}" in i.value for i in at.info)
    assert at.session_state["upload_run"] == faulty
    broken = tmp_path / "broken.zip"
    with zipfile.ZipFile(broken, "w") as z:
        z.writestr("manifest.json", "{not json")
    at = page("upload")
    at.file_uploader(key="upload_file").set_value(("broken.zip", broken.read_bytes(), "application/zip")).run()
    at.button(key="upload_go").click().run()
    assert any("Not imported" in e.value and "manifest.json" in e.value for e in at.error)
    assert run_ids(target) == [faulty]  # nothing added
    kept = sorted(f.name for f in (target.parent / "uploads").glob("*/*.zip"))
    assert kept == ["again.zip", "t.zip"], "the refused upload is not kept"


def test_sql_page_runs_a_select_and_shows_a_refusal(with_runs):
    at = page("sql")
    at.text_area(key="sql_text").input("SELECT run_id, fault FROM runs ORDER BY fault NULLS FIRST")
    at.button[0].click().run()  # the form's submit button
    rows = at.dataframe[0].value
    assert list(rows.fault.fillna("none")) == ["none", "boundary"]
    assert at.dataframe[0].proto.placeholder == "—", "a NULL is drawn as the other pages draw it, not None"
    at.text_area(key="sql_text").input("DROP TABLE runs")
    at.button[0].click().run()
    assert any("only SELECT queries are allowed" in e.value and "DROP" in e.value for e in at.error)
    assert len(run_ids(with_runs[0])) == 2


def test_the_sql_leak_rate_example_looks_at_the_newest_run_with_findings(with_runs, tmp_path, monkeypatch):
    """Walk finding: after a scenario replay the newest run is its clean control, and the example showed
    its flat zeros. It takes the newest run with findings; in a store with none, the newest run."""
    db, faulty, control = with_runs
    at = page("sql")
    at.selectbox(key="sql_example").set_value("Leak rate over time").run()
    at.button[0].click().run()
    shown = at.dataframe[0].value
    with RunStore.open(db).read() as con:
        want = con.execute("SELECT step, request_id, leak_rate FROM leak_rate_per_step WHERE run_id = ?",
                           [faulty]).fetchall()
    assert sorted(zip(shown.step, shown.request_id, shown.leak_rate, strict=True)) == sorted(want), \
        "the faulty run's rows, not the newer control's"
    assert max(r[2] for r in want) > 0 and set(shown.run_id) == {faulty}, "and it says which run it took"
    assert at.selectbox(key="sql_example").value == "Leak rate over time"
    at.text_area(key="sql_text").input(at.text_area(key="sql_text").value + " LIMIT 3")
    at.button[0].click().run()
    assert at.selectbox(key="sql_example").value is None, "an edited query is no longer the example it was"
    assert len(at.dataframe[0].value) == 3 and at.text_area(key="sql_text").value.endswith("LIMIT 3")
    clean = tmp_path / "clean.duckdb"
    clean.write_bytes(Path(db).read_bytes())
    with duckdb.connect(str(clean)) as con:
        con.execute("UPDATE runs SET findings = 0")  # as if no run had found anything
    monkeypatch.setenv("KVVIZ_DB", str(clean))
    at = page("sql")
    at.selectbox(key="sql_example").set_value("Leak rate over time").run()
    at.button[0].click().run()
    assert set(at.dataframe[0].value.run_id) == {control}, "none with findings: the newest"


def test_the_sql_quick_chart_draws_a_line_per_series_and_bars_along_names(with_runs):
    """Two requests' rows along one step axis are two lines, not one zig-zag; run ids along x are
    bars; all-zero values sit at the bottom of the axis."""
    at = page("sql")
    at.text_area(key="sql_text").input("SELECT * FROM (VALUES (0, 'A', 0.0), (1, 'A', 0.0), (0, 'B', 0.0), "
                                       "(1, 'B', 0.0)) t(step, request_id, leak_rate)")
    at.button[0].click().run()
    assert at.selectbox(key="sql_colour_1").value == "request_id" and at.radio(key="sql_kind_1").value == "line"
    chart = charts(at)["sql_chart"]
    assert sorted(t["name"] for t in chart["data"]) == ["A", "B"]
    assert chart["layout"]["yaxis"]["rangemode"] == "tozero"
    at.text_area(key="sql_text").input("SELECT run_id, steps FROM runs")  # the same session: its own defaults
    at.button[0].click().run()
    assert at.selectbox(key="sql_colour_2").value is None and at.radio(key="sql_kind_2").value == "bar"
    at.text_area(key="sql_text").input("SELECT * FROM (VALUES (6.5, 'A', 1.0), (14, 'A', 2.0), (12.5, 'B', 1.5)) "
                                       "t(position, request_id, entropy)")  # no x repeats, but it goes back
    at.button[0].click().run()
    assert at.selectbox(key="sql_colour_3").value == "request_id" and at.radio(key="sql_kind_3").value == "line"


def test_the_sql_page_says_why_a_result_of_no_numbers_has_no_chart(with_runs):
    at = page("sql")
    at.text_area(key="sql_text").input("SELECT * FROM (VALUES ('a', [1.0, 2.0]), ('b', [3.0, 4.0])) t(name, q)")
    at.button[0].click().run()
    assert "sql_chart" not in charts(at) and any("No quick chart: no column holds a number" in c.value
                                                  for c in at.caption)
    at.text_area(key="sql_text").input("SELECT * FROM (VALUES ('a', 1.0), ('b', 3.0)) t(name, q)")
    at.button[0].click().run()
    assert "sql_chart" in charts(at) and not any("No quick chart" in c.value for c in at.caption)


def test_the_sql_quick_chart_plots_a_measure_not_a_layer_number(with_runs):
    """The walk's 'Top leaking heads' chart plotted the sum of `layer`: y defaults to the mass."""
    at = page("sql")
    at.selectbox(key="sql_example").set_value("Top leaking heads").run()
    at.button[0].click().run()
    assert at.selectbox(key="sql_y_1").value == "max_foreign_mass"
    assert at.radio(key="sql_kind_1").value == "bar" and at.selectbox(key="sql_colour_1").value is None
    shown = at.dataframe[0].value
    assert shown.run_id.duplicated().any(), "several heads of one run: their bars stack"
    chart = charts(at)["sql_chart"]
    assert chart["layout"]["yaxis"]["title"]["text"] == "max_foreign_mass, the largest of the rows of each run_id"
    heights = dict(zip(values(chart["data"][0]["x"]), values(chart["data"][0]["y"]), strict=True))
    assert heights == shown.groupby("run_id").max_foreign_mass.max().to_dict(), "a maximum's bar, not their sum"
    at.text_area(key="sql_text").input("SELECT * FROM (VALUES ('r', 3, 2, 7), ('s', 1, 0, 9)) t(run_id, layer, head, "
                                       "leak_rows)")  # no float: the first count that is not an identifier
    at.button[0].click().run()
    assert at.selectbox(key="sql_y_2").value == "leak_rows"
    at.text_area(key="sql_text").input("SELECT * FROM (VALUES ('r', 0.0, 2.5), ('s', NULL, 1.5)) t(run_id, leak_rate, "
                                       "max_foreign_mass)")  # the walk: the first example charted all-zero leak_rate
    at.button[0].click().run()
    assert at.selectbox(key="sql_y_3").value == "max_foreign_mass", "a column zero or empty in every row is not y"


def test_runs_page_compares_and_deletes(store, tmp_path, monkeypatch):
    db = tmp_path / "copy.duckdb"
    with RunStore.open(store[0]).read() as con:
        con.execute("SELECT 1")  # the source is readable; copy it so deleting leaves the shared store alone
    db.write_bytes(Path(store[0]).read_bytes())
    monkeypatch.setenv("KVVIZ_DB", str(db))
    _, faulty, control = store
    at = page("runs")
    at.text_input(key="runs_ids").input(f"{faulty},{control}").run()
    assert any(d.value is not None for d in at.dataframe) and not at.exception
    summary = next(d.value for d in at.dataframe if faulty in d.value.columns)
    assert summary.loc["engine"].tolist() == ["kvviz", "kvviz"], "a kvviz run beside a transformers one says so"
    with RunStore.open(db).read() as con:  # walk finding: two engines on one workload differed only by findings
        prompt, cached = con.execute("SELECT sum(len(prompt_ids)), sum(greatest(cached_tokens, 0)) FROM requests "
                                     "WHERE run_id = ?", [faulty]).fetchone()
    assert summary.loc[["prompt_tokens", "cached_tokens", "hit_rate"], faulty].tolist() == [
        str(prompt), str(cached), str(round(cached / prompt, 4))]
    assert all(len(v.partition(".")[2]) <= 4 for v in summary.loc["leak_rate"]), summary.loc["leak_rate"]
    lines = {t["name"]: t["line"] for t in charts(at)["runs_cmp_timeline"]["data"] if t.get("showlegend")}
    assert lines[f"A ({faulty})"]["color"] == lines[f"A ({control})"]["color"], "one request, one colour"
    assert lines[f"A ({faulty})"]["dash"] != lines[f"A ({control})"]["dash"], "one run, one dash"
    at.text_input(key="runs_ids").input(faulty).run()
    at.checkbox(key=f"runs_sure_{faulty}").check().run()
    at.button(key="runs_delete").click().run()
    assert not at.exception
    assert run_ids(db) == [control]
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM attention WHERE run_id = ?", [faulty]).fetchone()[0] == 0
    con.close()


def test_empty_cells_show_a_dash_not_none_in_the_runs_and_requests_tables(with_runs):
    """The control has no fault and no request a parent: missing values the tables draw as an em dash
    (st.dataframe's default draws the word None, which reads as a value)."""
    _, faulty, control = with_runs
    at = page("runs")
    [listing] = [d for d in at.dataframe if "run_id" in d.value.columns]
    assert pd.isna(listing.value.set_index("run_id").fault[control]) and listing.proto.placeholder == "—"
    at.text_input(key="runs_ids").input(f"{faulty},{control}").run()
    summary = next(d.value for d in at.dataframe if faulty in d.value.columns)
    assert summary.loc["fault", control] == "—" and not (summary == "None").any().any()
    at = page("inspector", run_id=control)
    at.segmented_control(key="insp_view").set_value("Requests").run()
    [requests] = at.dataframe
    assert requests.value.parent.isna().any() and requests.proto.placeholder == "—", "a missing value, drawn as —"


def test_the_upload_page_imports_a_synthetic_example_capture_once(empty_db, monkeypatch):
    from kvviz.capture import synthetic

    write = synthetic.write_example
    monkeypatch.setattr(synthetic, "write_example", lambda path, events: write(path, 4000))
    at = page("upload")
    assert any("synthetic" in m.value for m in at.markdown), "it says the example is not from a server"
    at.button(key="upload_example").click().run()
    [run_id] = run_ids(empty_db)
    assert not at.exception and any("Imported example-fleet.jsonl" in s.value for s in at.success)
    with RunStore.open(empty_db).read() as con:
        replicas, removed = con.execute("SELECT count(DISTINCT replica), count(*) FILTER (kind = 'BlockRemoved') "
                                        "FROM kv_events WHERE run_id = ?", [run_id]).fetchone()
    assert replicas == 3 and removed == 0, "4000 events fill no replica's 4096 blocks"
    at = page("upload")
    at.button(key="upload_example").click().run()
    assert run_ids(empty_db) == [run_id] and any("imported before" in i.value for i in at.info)
    at.button(key="upload_open").click().run()
    assert at.title[0].value == "Inspector" and not at.exception


@pytest.mark.slow
def test_an_uploaded_capture_opens_with_the_views_it_supports(empty_db, tmp_path):
    from .test_capture import batch, stored_map, write_capture

    cap = write_capture(tmp_path / "c.jsonl", [
        batch(stored_map([11, 12], None, [1, 2, 3, 4], salt="tenant-a")),
        batch(stored_map([21], 12, [5, 6])),
        batch(stored_map([11], None, [1, 2], salt="tenant-b")),  # one hash under two salts
        batch({"type": "BlockRemoved", "block_hashes": [21, 12], "medium": "GPU"}),
    ])
    at = page("upload")
    at.file_uploader(key="upload_file").set_value(("c.jsonl", cap.read_bytes(), "application/jsonl")).run()
    at.button(key="upload_go").click().run()
    [run_id] = run_ids(empty_db)
    at.button(key="upload_open").click().run()
    assert at.title[0].value == "Inspector" and not at.exception
    at.switch_page("kvviz/ui/pages/inspector.py").run()  # later reruns in AppTest follow its own page, not the app's
    assert at.session_state["run_id"] == run_id
    assert any("no physical block ids and no attention" in i.value for i in at.info)
    assert at.segmented_control(key="insp_view").value == "Activity"
    stored = next(t for t in charts(at)["insp_activity"]["data"] if t["name"] == "stored (new)")
    tiles = {m.label: m.value for m in at.metric}
    assert sum(values(stored["y"])) > 0 and (tiles["new blocks"], tiles["hits"]) == ("3", "1"), "11 again: a hit"
    explained_in_background(at, run_id)
    at.toggle(key="insp_explain").set_value(True).run()
    reasons = {t["name"]: sum(values(t["y"])) for t in charts(at)["insp_activity"]["data"]}
    assert reasons.get("miss: cold") == 2 and not at.exception, "11 -> 12, then 21 after 12: tokens never cached"
    with RunStore.open(empty_db).read() as con:
        assert kept(con, run_id), "explained once: kept for the next session and for SQL"
    at.segmented_control(key="insp_view").set_value("Prefix tree").run()
    [icicle] = charts(at)["insp_reuse_tree"]["data"]
    assert values(icicle["ids"]) == ["all", f"{21:016x}"], "11-12-21: one chain of single children, one segment"
    assert values(icicle["marker"]["colors"]) == ["#eceff1", "#d62728"], "11 was used by two tenants"
    assert values(icicle["labels"]) == ["all blocks", "3 blocks from b"], "named by its first block, 11 = 0xb"
    assert charts(at)["insp_reuse_tree"]["layout"]["uniformtext"] == {"minsize": 11, "mode": "hide"}, \
        "a label too long for its segment is hidden, not shrunk unreadably small"
    at.radio(key="insp_tree_how").set_value("as stored, block by block").run()
    tree = charts(at)["insp_tree"]
    assert sum(len(values(t["x"])) for t in tree["data"][1:]) == 3  # three distinct hashes stored
    assert any("#d62728" in values(t["marker"]["line"]["color"]) for t in tree["data"][1:]), "11: two salts"
    at.segmented_control(key="insp_view").set_value("Occupancy").run()
    at.radio(key="insp_split").set_value("tenant").run()
    tenant, untold = charts(at)["insp_occupancy"]["data"]  # b's store of 11 was a hit on a's block: b caches nothing
    assert tenant["name"] == "tenant-a" and values(tenant["y"])[-1] == 1, "12 removed, 11 left"
    assert untold["name"] == "tenant-a's chain, own tenant unknown" and values(untold["y"])[-1] == 0, \
        "21 continues a's chain by an event naming no salt; removed"
    at.segmented_control(key="insp_view").set_value("Lifetimes").run()
    assert "insp_durations" in charts(at) and not at.exception
    at.segmented_control(key="insp_view").set_value("Cross-tenant").run()
    found = at.dataframe[-1].value  # the salts by name, where and which block: no engine columns left empty
    assert found.to_dict("records") == [{"tenant": "tenant-b", "stored_first_by": "tenant-a", "replica": "replica-0",
                                         "block_hash": f"{11:016x}", "message": 2}]
    marks = {t["name"]: values(t["y"]) for t in charts(at)["insp_cross_tenant"]["data"]}
    padded = f"{11:016x}"  # as the findings table above names it
    assert marks == {"tenant-a: stored": [padded], "tenant-b: hit": [padded]}, "a stored it, b's store hit"
    assert any(m.value.startswith("**1** block of this range served more than one tenant the stream names; **0** "
                                  "more") for m in at.markdown), "both named: b's hit names its salt"


def test_a_capture_the_cli_explained_opens_with_its_reasons_and_is_not_explained_again(empty_db, tmp_path):
    from kvviz.runners.uploads import import_file

    from .test_capture import batch, stored_map, write_capture

    cap = write_capture(tmp_path / "c.jsonl", [batch(stored_map([11, 12], None, [1, 2, 3, 4], salt="a")),
                                               batch(stored_map([21], 12, [5, 6]))])
    store = RunStore.open(empty_db)
    run_id = import_file(cap, store)
    explained(store, run_id)  # as the CLI does
    at = page("inspector", run_id=run_id)
    assert explain_jobs.current(store, run_id) is None and not at.get("progress"), "kept: nothing to work out"
    at.toggle(key="insp_explain").set_value(True).run()
    reasons = {t["name"]: sum(values(t["y"])) for t in charts(at)["insp_activity"]["data"]}
    assert reasons.get("miss: cold") == 2 and not at.exception


def test_a_capture_without_hits_says_they_are_not_reported_not_zero(empty_db, tmp_path):
    """No repeated store: the server did not report hits (vLLM's default mode), so 0 hits would be false.
    The upload test above is the control: a capture with a repeated store shows its count."""
    from kvviz.runners.uploads import import_file

    from .test_capture import batch, stored_map, write_capture

    cap = write_capture(tmp_path / "c.jsonl", [batch(stored_map([11, 12], None, [1, 2, 3, 4], salt="a")),
                                               batch(stored_map([21], 12, [5, 6]))])
    at = page("inspector", run_id=import_file(cap, RunStore.open(empty_db)))
    tiles = {m.label: m.value for m in at.metric}
    assert (tiles["new blocks"], tiles["hits"], tiles["hit rate (tokens)"]) == ("3", "not reported", "not reported")


@pytest.mark.slow
def test_the_prefix_tree_caption_counts_the_segments_drawn_not_those_a_click_opens(empty_db, tmp_path):
    """1 forks into 2 and 3, 2 into 4 and 5: five segments, but the icicle draws its root and two levels
    (1; 2 and 3) until one is clicked. A capture two levels deep is the control: all of it drawn."""
    from kvviz.runners.uploads import import_file

    from .test_capture import batch, stored_map, write_capture

    store = RunStore.open(empty_db)
    forks = [(1, None), (2, 1), (3, 1), (4, 2), (5, 2)]
    deep = write_capture(tmp_path / "deep.jsonl", [batch(stored_map([h], p, [h, h])) for h, p in forks])
    shallow = write_capture(tmp_path / "shallow.jsonl", [batch(stored_map([h], p, [h, h])) for h, p in forks[:3]])
    for cap, said in ((deep, "3 segments of 3 blocks drawn (2 deeper: click a segment to open them)."),
                      (shallow, "3 segments of 3 blocks drawn.")):
        at = page("inspector", run_id=import_file(cap, store))
        at.segmented_control(key="insp_view").set_value("Prefix tree").run()
        [icicle] = charts(at)["insp_reuse_tree"]["data"]
        assert icicle["maxdepth"] == 3 and len(values(icicle["ids"])) == len(forks if cap == deep else forks[:3]) + 1
        assert any(c.value.endswith(said) for c in at.caption), [c.value for c in at.caption]


@pytest.mark.slow
def test_a_fleet_capture_shows_one_replicas_tree_at_a_time_and_its_occupancy_each(empty_db, tmp_path):
    from kvviz.runners.uploads import import_file

    from .test_fleet_capture import full_mode_messages, interleaved, write_dataset

    msgs = interleaved(full_mode_messages("pod-a", 20), full_mode_messages("pod-b", 10) * 2)
    run_id = import_file(write_dataset(tmp_path / "ds", msgs).folder, RunStore.open(empty_db))
    at = page("inspector", run_id=run_id)
    at.segmented_control(key="insp_view").set_value("Prefix tree").run()
    at.radio(key="insp_tree_how").set_value("as stored, block by block").run()
    assert at.selectbox(key="insp_replica").options == ["pod-a", "pod-b"] and not at.exception
    nodes = {}
    for replica in ("pod-a", "pod-b"):
        at.selectbox(key="insp_replica").set_value(replica).run()
        nodes[replica] = sum(len(values(t["x"])) for t in charts(at)["insp_tree"]["data"][1:])
        assert any(f"on {replica}" in c.value for c in at.caption)
    with RunStore.open(empty_db).read() as con:
        for replica, n in nodes.items():
            assert n == con.execute("SELECT count(DISTINCT block_hash) FROM kv_events WHERE run_id = ? AND "
                                    "replica = ? AND kind = 'BlockStored'", [run_id, replica]).fetchone()[0]
    at.segmented_control(key="insp_view").set_value("Occupancy").run()
    lines = [t["name"] for t in charts(at)["insp_occupancy"]["data"]]
    assert lines == ["pod-a", "pod-b"] and not at.exception


def test_a_capture_whose_dataset_moved_says_so_and_keeps_to_the_capture_views(empty_db, tmp_path):
    from kvviz.runners.uploads import import_file

    from .test_fleet_capture import full_mode_messages, write_dataset

    folder = write_dataset(tmp_path / "ds", full_mode_messages("pod-a", 12)).folder
    run_id = import_file(folder, RunStore.open(empty_db), in_place=True)
    folder.rename(tmp_path / "elsewhere")
    at = page("inspector", run_id=run_id)
    assert not at.exception
    assert any("no longer at" in e.value for e in at.error)
    assert any("can be read" in i.value for i in at.info) and not at.segmented_control


def test_a_long_capture_is_looked_at_over_a_time_range_not_message_by_message(empty_db, tmp_path):
    from kvviz.runners.uploads import import_file
    from kvviz.ui.inspector import MANY_STEPS

    from .test_fleet_capture import full_mode_messages, write_dataset

    msgs = full_mode_messages("pod-a", MANY_STEPS + 100)  # one message a second
    run_id = import_file(write_dataset(tmp_path / "ds", msgs, rotate_rows=10_000).folder, RunStore.open(empty_db))
    at = page("inspector", run_id=run_id)
    assert not at.exception and not at.select_slider and not at.slider(key="insp_range").value[0]
    assert at.slider(key="insp_range").max == MANY_STEPS + 98  # the last message (seq 2099) is an empty batch
    stored = next(t for t in charts(at)["insp_activity"]["data"] if t["name"] == "stored (new)")
    assert len(values(stored["x"])) <= 300, "a few hundred intervals, not a bar per message"
    at.slider(key="insp_range").set_value((0.0, 50.0)).run()
    assert not at.exception and any("(50 s of" in c.value for c in at.caption)
    at.segmented_control(key="insp_view").set_value("Prefix tree").run()
    assert "insp_reuse_tree" in charts(at) and not at.exception
    at.radio(key="insp_tree_how").set_value("as stored, block by block").run()
    assert any("stored in the range (messages 0 to 50)" in c.value for c in at.caption)
    at.slider(key="insp_range").set_value((100.0, 150.0)).run()
    assert any("All " in c.value and "(messages 100 to 150)" in c.value for c in at.caption), "the range's own blocks"
    at.button(key="insp_range_all").click().run()
    assert at.slider(key="insp_range").value == (0.0, MANY_STEPS + 98)


def test_inspector_plays_through_the_steps_and_stops_at_the_end(with_runs):
    _, faulty, _ = with_runs
    at = page("inspector", run_id=faulty)
    steps = at.select_slider(key="insp_step").options
    at.session_state["insp_step"] = int(steps[-2])
    at.button(key="insp_play").click().run()
    assert at.session_state["insp_playing"] is True and at.button(key="insp_play").label == "Pause"
    at.session_state["insp_tick"] = 0.0  # as if the timer's interval had passed
    at.run()  # a tick: the last step
    at.session_state["insp_tick"] = 0.0
    at.run()  # a tick at the end: it stops
    assert at.session_state["insp_step"] == int(steps[-1]) and at.session_state["insp_playing"] is False
    assert not at.exception


def test_settings_survive_a_visit_to_another_page(empty_db):
    at = custom_requests({0: {"prompt": "a prompt I typed"}})
    at.number_input(key="run_nb_custom").set_value(99).run()
    at.number_input(key="run_host_custom").set_value(12).run()
    at.checkbox(key="run_dis_custom").check().run()
    at.switch_page("kvviz/ui/pages/sql.py").run()
    at.switch_page("kvviz/ui/pages/run.py").run()
    assert not at.exception
    assert at.selectbox(key="run_model").value == "tiny-llama" and at.radio(key="run_source").value == "custom"
    assert at.number_input(key="run_nb_custom").value == 99
    assert at.number_input(key="run_host_custom").value == 12 and at.checkbox(key="run_dis_custom").value
    assert at.data_editor(key="run_requests").value.prompt[0] == "a prompt I typed"


def test_a_huge_pool_draws_only_the_blocks_in_use(tiny, tmp_path, monkeypatch):
    db = tmp_path / "big.duckdb"
    wl = {"requests": [{"id": "A", "prompt": "a small request", "max_new_tokens": 2}],
          "engine": {"block_size": 4, "num_blocks": 4096}}
    run_id = live.run(RunStore.open(db), tiny, wl).run_id
    monkeypatch.setenv("KVVIZ_DB", str(db))
    at = page("inspector", run_id=run_id)
    assert any("Blocks 256..4095 are not drawn: all free." in c.value for c in at.caption)
    drawn = sum(len(values(t["x"])) for t in charts(at)["insp_blockmap"]["data"])
    assert drawn == 256


def test_a_fault_scope_naming_no_request_is_refused_before_recording(empty_db):
    at = page("run")
    at.selectbox(key="run_model").set_value("tiny-llama").run()
    at.selectbox(key="run_scenario").set_value("boundary").run()
    at.text_input(key="run_fr_boundary").input("Q").run()
    at.button(key="run_go").click().run()
    assert any("fault requests: 'Q' is not a request of this workload" in e.value for e in at.error)
    assert not empty_db.exists() or run_ids(empty_db) == []


def test_a_run_that_died_before_its_first_step_opens_without_error(tiny, tmp_path, monkeypatch):
    from kvviz.engine.workload import Workload
    from kvviz.store.recorder import RunRecorder

    db = tmp_path / "dead.duckdb"
    rec = RunRecorder(RunStore.open(db), "dead0", model=tiny,
                      workload=Workload.from_dict({"requests": [{"id": "A", "prompt": "x"}]}))
    rec.fail(KeyboardInterrupt())
    monkeypatch.setenv("KVVIZ_DB", str(db))
    at = page("inspector", run_id="dead0")
    assert any("failed" in e.value and "stopped before it finished (Ctrl-C)" in e.value for e in at.error)
    assert any("no recorded steps" in w.value for w in at.warning)
    at = page("runs")
    assert not at.exception


def test_two_captures_compare_and_a_fault_that_never_struck_is_said(empty_db, tiny, tmp_path):
    """Review findings: comparing two captures (no leak metrics) drew a traceback; a fault confined to
    steps after the run's end looked like a detector miss."""
    from kvviz.catalogue.faults import Scope
    from kvviz.runners.uploads import import_file

    from .test_capture import batch, stored_map, write_capture

    store = RunStore.open(empty_db)
    caps = [import_file(write_capture(tmp_path / f"c{i}.jsonl", [batch(stored_map([11 + i], None, [1, 2]))]), store)
            for i in range(2)]
    at = page("runs")
    at.text_input(key="runs_ids").input(", ".join(caps)).run()
    assert not at.exception and not at.error
    late = live.run(store, tiny, live.scenario_workload("boundary", tiny), "boundary",
                    scope=Scope(steps=frozenset({999}))).run_id
    at = page("inspector", run_id=late)
    assert any("the fault never struck" in c.value for c in at.caption)
    at = page("runs")
    assert "steps 999" in list(at.dataframe[0].value.fault_scope)  # said as words, not raw JSON


def test_the_sql_pages_schema_shows_what_each_table_and_column_holds(with_runs):
    """The declaration's notes reach the file as comments, and the schema list says them."""
    at = page("sql")
    text = " ".join(m.value for m in at.markdown)
    assert "**runs** (table): One row per run" in text and "`status` varchar (running | complete | failed)" in text
    assert "**positional_entropy** (view)" in text


@pytest.mark.slow
def test_an_offloading_run_shows_its_host_tier_next_to_the_pool(tiny, tmp_path, monkeypatch):
    db = tmp_path / "offload.duckdb"
    system = "You are a helpful assistant. Answer in one short sentence."
    wl = {"requests": [{"id": "A", "prompt": system, "max_new_tokens": 2},
                       {"id": "B", "prompt": "Unrelated filler text " * 4, "max_new_tokens": 2, "arrival_step": 4},
                       {"id": "D", "prompt": system + " Again.", "max_new_tokens": 3, "arrival_step": 9}],
          "engine": {"block_size": 4, "num_blocks": 30, "offload": {"cpu_blocks": 20}}}
    run_id = live.run(RunStore.open(db), tiny, wl).run_id
    with RunStore.open(db).read() as con:
        restored_at = con.execute("SELECT min(step) FROM block_events WHERE run_id = ? AND kind = 'restore'",
                                  [run_id]).fetchone()[0]
        held = con.execute("SELECT count(*) FROM host_blocks WHERE run_id = ? AND step = ? AND state = 'cached'",
                           [run_id, restored_at]).fetchone()[0]
    assert restored_at is not None and held > 0
    monkeypatch.setenv("KVVIZ_DB", str(db))
    at = page("inspector", run_id=run_id)
    at.session_state["insp_step"] = restored_at
    at.run()
    host = charts(at)["insp_hostmap"]
    assert f"Host tier (CPU) after step {restored_at}: {held} of 20 blocks hold" in host["layout"]["title"]["text"], \
        "those this step moved included"
    assert sum(len(values(t["x"])) for t in host["data"]) == 20  # every host block drawn
    moved = next(c.value for c in at.caption if "This step" in c.value)
    assert int(re.search(r"(\d+) restored", moved).group(1)) > 0, moved
    assert "restored" in {t["name"] for t in host["data"]}  # the host blocks copied back are coloured
    with RunStore.open(db).read() as con:
        a_done = con.execute("SELECT finish_step FROM requests WHERE run_id = ? AND request_id = 'A'",
                             [run_id]).fetchone()[0]
    at.session_state["insp_step"] = a_done
    at.run()
    assert any("A finished in this step and released its blocks" in c.value for c in at.caption)
    at.session_state["insp_step"] = a_done - 1
    at.run()
    assert not any("finished in this step" in c.value for c in at.caption), "A holds its blocks before"


@pytest.mark.parametrize(("fault", "delivered", "said"), [
    (None, {"A": True, "B": True}, None),
    ("transfer_wrong_request", {"A": True, "B": False}, "B at step 3 got K/V written by A"),
    ("transfer_failed_silently", {"A": False, "B": False}, "A at step 1 got slots never written")])
def test_the_transfers_table_says_whose_kv_each_request_received(tiny, tmp_path, monkeypatch, fault, delivered, said):
    db = tmp_path / "dis.duckdb"
    wl = {"requests": [{"id": "A", "prompt": "The first prompt of all", "max_new_tokens": 3},
                       {"id": "B", "prompt": "A second prompt, quite different", "max_new_tokens": 3,
                        "arrival_step": 2}],
          "engine": {"block_size": 4, "num_blocks": 24, "disaggregated": True}}
    run_id = live.run(RunStore.open(db), tiny, wl, fault).run_id
    with RunStore.open(db).read() as con:
        last = con.execute("SELECT max(step) FROM steps WHERE run_id = ?", [run_id]).fetchone()[0]
    monkeypatch.setenv("KVVIZ_DB", str(db))
    at = page("inspector", run_id=run_id)
    at.session_state["insp_step"] = last
    at.run()
    sent = next(d.value for d in at.dataframe if "delivered" in d.value.columns)  # no key without a selection
    assert list(sent.request_id) == ["A", "B"]
    assert sent.set_index("request_id").delivered.to_dict() == delivered
    warned = [w.value for w in at.warning if "transfers left decode blocks" in w.value]
    assert bool(warned) == (fault is not None) and (said is None or said in warned[0]), warned
    assert any(s.get("type") == "path" for s in charts(at)["insp_blockmap"]["layout"].get("shapes", []))


def test_the_run_page_runs_transformers_and_the_inspector_says_which_engine_ran(empty_db):
    """The engine choice: the default custom workload (two tenants, a common prefix) through transformers'
    continuous batching under the kernel chosen (kvviz's engine offers none), stored as a transformers run,
    opened in the inspector, which names the engine and the kernel."""
    at = custom_requests({})
    assert not [s for s in at.selectbox if s.key.startswith("run_kern")]
    at.selectbox(key="run_be").set_value("transformers").run()
    at.selectbox(key="run_kern-transformers").set_value("sdpa_paged").run()
    at.button(key="run_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    [run_id] = run_ids(empty_db)
    with RunStore.open(empty_db).read() as con:
        assert con.execute("SELECT backend, status FROM runs").fetchone() == ("transformers", "complete")
    at.button(key="run_open").click().run()
    assert at.title[0].value == "Inspector"
    assert any("engine: transformers' continuous batching" in m.value for m in at.markdown)
    assert any(c.value.startswith("transformers' own continuous batching ran this run") for c in at.caption)
    assert any(c.value.startswith("Kernel sdpa_paged returns no weights") for c in at.caption)
    assert any("its reserved trash blocks, last in the map, hold no request's tokens" in c.value for c in at.caption)
    run_choice = at.selectbox(key="insp_run")
    assert re.search(r" · transformers · fault none · complete · \d{4}-\d\d-\d\d \d\d:\d\d:\d\d$",
                     run_choice.format_func(run_id)), "when it was made: two runs of one scenario differ by it"
    assert page("runs").dataframe[0].value.set_index("run_id").engine[run_id] == "transformers"
    assert any("cross-tenant reads: " in w.value and "tenant-1 read by tenant-2" in w.value for w in at.warning)


def test_the_engine_pickers_show_short_names_and_say_the_rest_in_their_help(empty_db):
    """Walk finding: "transformers' continuous batching" was cut to "transformers' co..." in the Run page's
    fifth of a row; the options are the engines' short names, the help says what each one is."""
    for name, key in (("run", "run_be"), ("scenarios", "sc_engine")):
        picker = page(name).selectbox(key=key)
        assert picker.options == ["kvviz", "transformers", "llama.cpp"], picker.options
        assert picker.help.startswith("kvviz: kvviz's own paged engine. transformers: Hugging Face transformers' "
                                      "own continuous batching")
        assert "llama.cpp: llama.cpp through its C API" in picker.help


def test_the_run_page_runs_a_masked_scenario_in_transformers_with_its_own_paged_isolation(empty_db):
    """The default scenario (passphrase, masked on kvviz's engine) with transformers chosen: the settings
    transformers cannot take are shown fixed, not refused after Run; kvviz's engine keeps them editable."""
    at = page("run")
    at.selectbox(key="run_model").set_value("tiny-llama").run()
    assert at.selectbox(key="run_iso_passphrase").value == "masked"
    at.selectbox(key="run_be").set_value("transformers").run()
    fixed = {t.label: t.value for t in at.text_input if t.disabled}
    assert fixed == {"isolation": "paged", "host tier blocks": "0", "fault": "none", "fault steps": "",
                     "fault requests": "", "fault layers": ""}, fixed
    at.button(key="run_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    with RunStore.open(empty_db).read() as con:
        assert con.execute("SELECT backend, status FROM runs").fetchone() == ("transformers", "complete")
    at.switch_page("kvviz/ui/pages/run.py").run()
    at.selectbox(key="run_be").set_value("kvviz").run()
    assert at.selectbox(key="run_iso_passphrase").value == "masked"
    assert not [t for t in at.text_input if t.disabled]


def test_the_scenarios_page_runs_a_scenario_in_transformers_beside_kvviz_s_engine(empty_db):
    """unsalted_prefix's requests in transformers (no salt, no fault injected) read across tenants; kvviz's
    engine, salted, runs them clean; each column says so."""
    at = page("scenarios")
    at.selectbox(key="sc_name").set_value("unsalted_prefix")
    at.selectbox(key="sc_model").set_value("tiny-llama")
    at.selectbox(key="sc_engine").set_value("transformers").run()
    assert at.button(key="sc_go").label == "Run it in transformers and in kvviz's engine"
    at.button(key="sc_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    pair = at.session_state["sc_pair"]
    with RunStore.open(empty_db).read() as con:
        backends = dict(con.execute("SELECT run_id, backend FROM runs").fetchall())
        fault = con.execute("SELECT fault FROM runs WHERE run_id = ?", [pair["transformers"]]).fetchone()[0]
    assert backends == {pair["transformers"]: "transformers", pair["control"]: "kvviz"} and fault is None
    assert [m.value.split(":")[0] for m in at.markdown if m.value.startswith("#### ")] == [
        "#### transformers", "#### kvviz's engine, clean"]
    warned = [w.value for w in at.warning]
    assert any(w.startswith("the oracles report ") for w in warned)
    assert len([w for w in warned if "cross-tenant reads" in w]) == 1
    assert any(s.value == "clean" for s in at.success)


@pytest.mark.slow
def test_the_pages_that_only_read_start_without_the_engine():
    """Home, Runs, SQL, Upload and the inspector import no torch or transformers (seconds on a first
    load): only a page that runs a model loads them, when it first needs one."""
    import subprocess
    import sys

    pages = ("home", "runs_page", "sql_page", "upload_page", "inspector")
    code = "; ".join(f"import kvviz.ui.{p}" for p in pages) + (
        "; import sys; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_scenarios_page_runs_a_llama_cpp_misuse_beside_its_control(empty_db):
    """With llama.cpp chosen, its API misuses follow the catalogue, marked as such; one runs with its
    control on llama.cpp: the detector fires, the control stays clean, both recorded as llama.cpp runs."""
    at = page("scenarios")
    at.selectbox(key="sc_engine").set_value("llama.cpp").run()
    names = at.selectbox(key="sc_name").options
    assert names[-5:] == [
        "reuse_without_rm: llama.cpp API misuse: a sequence reused without seq_rm (llama_memory_seq_rm)",
        "cp_one_long: llama.cpp API misuse: seq_cp one cell too long (llama_memory_seq_cp)",
        "one_sequence: llama.cpp API misuse: every request in one sequence (llama_batch)",
        "restore_wrong: llama.cpp API misuse: a prompt cache restored into the wrong request "
        "(llama_state_seq_set_data)",
        "positions_from_zero: llama.cpp API misuse: positions restarted at 0 (llama_batch)"], names[-5:]
    at.selectbox(key="sc_name").set_value("reuse_without_rm")
    at.selectbox(key="sc_model").set_value("tiny-llama").run()
    assert any("*Marked as such:*" in m.value for m in at.markdown)
    at.button(key="sc_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    pair = at.session_state["sc_pair"]
    with RunStore.open(empty_db).read() as con:
        rows = dict(con.execute("SELECT run_id, backend || ' ' || coalesce(fault, '-') FROM runs").fetchall())
    assert rows == {pair["scenario"]: "llama.cpp reuse_without_rm", pair["control"]: "llama.cpp -"}
    assert any(s.value == "the detector fired" for s in at.success) and any(s.value == "clean" for s in at.success)
    at.selectbox(key="sc_engine").set_value("kvviz").run()  # the misuses are llama.cpp's: listed no more
    assert "reuse_without_rm" not in " ".join(at.selectbox(key="sc_name").options)


def test_a_scenario_an_engine_cannot_run_is_refused_before_anything_runs(empty_db):
    """Walk finding: control_forks on transformers ran and recorded kvviz's side first, then refused the
    forks with the progress bar frozen at a third. Every run of the plan is checked before the first."""
    at = page("scenarios")
    at.selectbox(key="sc_name").set_value("control_forks")
    at.selectbox(key="sc_model").set_value("tiny-llama")
    at.selectbox(key="sc_engine").set_value("transformers").run()
    at.button(key="sc_go").click().run()
    assert [e.value for e in at.error][0].startswith("requests[1].parent: transformers' manager forks only")
    assert not Path(empty_db).exists() or run_ids(empty_db) == []
    assert not at.get("progress")


def test_the_run_page_runs_llama_cpp_with_its_kernel_and_misuse_and_says_which_engine_ran(empty_db):
    at = custom_requests({})
    at.selectbox(key="run_be").set_value("llama.cpp").run()
    fixed = {t.label: t.value for t in at.text_input if t.disabled}
    assert fixed["host tier blocks"] == "0", fixed
    iso = at.selectbox(key="run_iso-llama.cpp_custom")
    assert iso.options == ["masked", "streams"] and iso.value == "masked"  # kv_unified on, or a stream per sequence
    iso.set_value("streams").run()
    assert at.selectbox(key="run_kern-llama.cpp").options == ["eager_paged", "flash_attn"]
    at.selectbox(key="run_kern-llama.cpp").set_value("flash_attn").run()
    at.selectbox(key="run_misuse").set_value("one_sequence").run()
    at.button(key="run_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    with RunStore.open(empty_db).read() as con:
        row = con.execute("SELECT backend, fault, status, engine->>'kernel', engine->>'isolation' FROM runs").fetchone()
    assert row == ("llama.cpp", "one_sequence", "complete", "flash_attn", "streams")
    assert any("on llama.cpp, streams isolation) finished" in s.value for s in at.success)
    at.button(key="run_open").click().run()
    assert any("engine: llama.cpp, streams isolation" in m.value for m in at.markdown)


@pytest.mark.parametrize("backend", ["transformers", "llama.cpp"])
def test_the_cache_view_says_how_the_other_engines_reuse_prompts(backend, tiny, empty_db):
    """Walk finding: a transformers request that ended in its prefill step left nothing to reuse, and the
    next one's miss read as cold with nothing said; llama.cpp's hits are prefixes of any length."""
    wl = json.loads((Path(__file__).resolve().parent.parent / "examples/engines/resend-after-finish.json").read_text())
    wl["engine"]["backend"] = backend
    run_id = live.run(RunStore.open(empty_db), tiny, wl).run_id
    at = page("inspector", run_id=run_id)
    at.segmented_control(key="insp_view").set_value("Cache").run()
    assert not at.exception and not at.error
    assert not any("telemetry_mismatch" in w.value for w in at.warning), "the counts are right: nothing to say"
    said = " ".join(c.value for c in at.caption)
    assert ("transformers registers no block a request fills in its last forward" in said) == (backend ==
                                                                                              "transformers")
    assert ("llama.cpp reuses cells, not blocks" in said) == (backend == "llama.cpp")
    columns = list(next(d for d in at.dataframe if "hit tokens" in d.value.columns).value.columns)
    assert ("reason" in columns) == (backend != "llama.cpp"), "block reasons would contradict cell-wise hits"


def test_the_engine_chosen_on_the_run_page_stays_when_the_workload_changes(empty_db):
    """Walk finding: picking another scenario, or custom requests, put the engine back to kvviz's."""
    at = page("run")
    at.selectbox(key="run_be").set_value("llama.cpp").run()
    at.selectbox(key="run_kern-llama.cpp").set_value("flash_attn").run()
    at.selectbox(key="run_scenario").set_value("boundary").run()
    at.radio(key="run_source").set_value("custom").run()
    assert at.selectbox(key="run_be").value == "llama.cpp"
    assert at.selectbox(key="run_kern-llama.cpp").value == "flash_attn"


def test_a_misuse_llama_cpp_refuses_is_said_as_an_outcome_beside_its_control(empty_db):
    """Walk finding: positions_from_zero showed only a red error and hid its control."""
    at = page("scenarios")
    at.selectbox(key="sc_engine").set_value("llama.cpp").run()
    at.selectbox(key="sc_name").set_value("positions_from_zero")
    at.selectbox(key="sc_model").set_value("tiny-llama").run()
    at.button(key="sc_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any(s.value.startswith("llama.cpp refused this misuse: its run failed at step ") for s in at.success)
    assert any(s.value == "clean" for s in at.success)
    with RunStore.open(empty_db).read() as con:
        assert sorted(r[0] for r in con.execute("SELECT status FROM runs").fetchall()) == ["complete", "failed"]
