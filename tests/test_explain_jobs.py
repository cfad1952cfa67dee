"""A capture opened in the app is explained in the background, once for every session: the page draws
while it works, says how far it has gone, shows the reasons when it is done, and says in a sentence
why it failed (with a button to try again)."""

from __future__ import annotations

import shutil
import threading

import pytest

from kvviz.analysis import explained as explained_mod
from kvviz.analysis.explained import STAGES, kept
from kvviz.capture.dataset import DatasetWriter
from kvviz.capture.events import decode_batch
from kvviz.capture.synthetic import fleet_messages
from kvviz.runners import explain_jobs
from kvviz.runners.uploads import import_file
from kvviz.store import RunStore

from .test_app import charts, page, values

WAIT_S = 60  # a tiny capture is explained in well under a second; this only bounds a hang


@pytest.fixture
def capture(tmp_path, monkeypatch):
    """A generated two-replica capture of about 400 events, registered in place in a new store."""
    db = tmp_path / "kvviz.duckdb"
    monkeypatch.setenv("KVVIZ_DB", str(db))
    folder = tmp_path / "ds"
    w = DatasetWriter(folder, {"replica-0": "synthetic", "replica-1": "synthetic"})
    for m in fleet_messages(400, capacity=16):  # evicts: every reason a fleet gives
        w.add(m, decode_batch(m.payload, "test"))
    w.close()
    store = RunStore.open(db)
    run_id = import_file(folder, store, in_place=True)
    with store.read() as con:
        assert not kept(con, run_id)
    return store, run_id, folder


@pytest.mark.parametrize("example", [True, False], ids=["example", "benchmarks-fleet"])
def test_the_example_fleet_shows_evicted_misses_reuse_and_a_prompt_cached_without_its_salt(tmp_path, example):
    """The example's conversations come back (some after eviction: an evicted miss, idle shorter than
    lifetime) and one prompt is hashed alike for every tenant (a block under two salts: findings); the
    benchmarks' fleet, without either, has no cross-tenant block."""
    folder = tmp_path / "ds"
    w = DatasetWriter(folder, {"replica-0": "synthetic", "replica-1": "synthetic"})
    knobs = {"turns": 0.3, "unsalted": 0.05} if example else {}
    for m in fleet_messages(4000, capacity=64, **knobs):
        w.add(m, decode_batch(m.payload, "test"))
    w.close()
    store = RunStore.open(tmp_path / "k.duckdb")
    run = import_file(folder, store, in_place=True)
    reasons = explained_mod.explained(store, run).by_reason()
    with store.read() as con:
        findings = con.execute("SELECT count(*) FROM findings WHERE run_id = ? AND kind = 'cross_tenant'",
                               [run]).fetchone()[0]
        reused = con.execute("SELECT count(*) FROM kv_events WHERE run_id = ? AND idle_s < lifetime_s",
                             [run]).fetchone()[0]
    if example:
        assert reasons["evicted"] > 0 and findings > 0 and reused > 0, (reasons, findings, reused)
    else:
        assert findings == 0, "every tenant's prompts are its own"


@pytest.fixture(autouse=True)
def no_job_left():
    """No test's explain runs on into the next (where it would call the next test's stand-in)."""
    yield
    for gate in Gate.made:
        gate.go.set()
    Gate.made.clear()
    explain_jobs._stop_all()


class Gate:
    """Stands in for explain_capture: counts the calls, holds each until let go, then fails the first
    `failures` of them or runs the real one."""

    made: list[Gate] = []

    def __init__(self, monkeypatch, failures: int = 0, hold: bool = True) -> None:
        Gate.made.append(self)
        self.calls, self.failures = 0, failures
        self.go, self.entered = threading.Event(), threading.Event()
        if not hold:
            self.go.set()
        self.real = explained_mod.explain_capture
        monkeypatch.setattr(explained_mod, "explain_capture", self)

    def __call__(self, con, run_id, progress=None):
        self.calls += 1
        self.entered.set()
        if progress:
            progress(STAGES[0], "")
        assert self.go.wait(WAIT_S)
        if self.calls <= self.failures:
            raise RuntimeError("the machine ran out of disk\nand a second line nobody needs")
        return self.real(con, run_id, progress)


def _progress_text(at) -> list[str]:
    return [p.proto.text for p in at.get("progress")]


@pytest.mark.slow
def test_opening_an_unexplained_capture_explains_it_in_the_background_and_the_activity_view_shows_why(
    capture, monkeypatch
):
    store, run_id, _ = capture
    gate = Gate(monkeypatch)
    at = page("inspector", run_id=run_id)  # the page has drawn while explain waits at the gate
    job = explain_jobs.current(store, run_id)
    assert job is not None and gate.entered.wait(WAIT_S) and not job.done and gate.calls == 1
    [said] = _progress_text(at)
    assert "stage 1 of 11: numbering the events" in said and "in the background" in said
    assert at.toggle(key="insp_explain").disabled and "insp_activity" in charts(at), "the chart draws meanwhile"
    gate.go.set()
    assert job.wait(WAIT_S) and job.error is None
    at.run()
    assert not _progress_text(at) and not at.toggle(key="insp_explain").disabled
    at.toggle(key="insp_explain").set_value(True).run()
    reasons = {t["name"] for t in charts(at)["insp_activity"]["data"] if sum(values(t["y"]))}
    assert {"miss: diverged", "miss: evicted"} <= reasons and not at.exception
    assert len(at.dataframe[-1].value) > 0, "the explained lookups of the range, listed"
    with store.read() as con:
        assert kept(con, run_id)
        by_sql = con.execute("SELECT count(*) FROM lookup_explanations WHERE run_id = ?", [run_id]).fetchone()[0]
    assert by_sql > 0, "the SQL page's example reads what the background kept"
    assert gate.calls == 1


@pytest.mark.slow
def test_a_second_session_follows_the_same_explanation_and_then_reads_it_without_another(capture, monkeypatch):
    store, run_id, _ = capture
    gate = Gate(monkeypatch)
    first = page("inspector", run_id=run_id)
    job = explain_jobs.current(store, run_id)
    assert gate.entered.wait(WAIT_S)
    second = page("inspector", run_id=run_id)  # another session while the first one's explain runs
    assert explain_jobs.current(store, run_id) is job and gate.calls == 1, "followed, not started again"
    assert _progress_text(second) and _progress_text(first)
    sql = page("sql")
    assert any(run_id in c.value and "in the background" in c.value for c in sql.caption)
    gate.go.set()
    assert job.wait(WAIT_S) and job.error is None
    second.run()
    second.toggle(key="insp_explain").set_value(True).run()
    assert any(t["name"].startswith("miss: ") for t in charts(second)["insp_activity"]["data"])
    assert gate.calls == 1, "one explain for both sessions"


def test_a_failed_explain_says_why_in_a_sentence_and_explain_again_works(capture, monkeypatch):
    store, run_id, _ = capture
    gate = Gate(monkeypatch, failures=1, hold=False)
    at = page("inspector", run_id=run_id)
    assert explain_jobs.current(store, run_id).wait(WAIT_S)
    at.run()
    [error] = at.error
    assert error.value.startswith("Explaining the misses failed: RuntimeError: the machine ran out of disk.")
    assert "second line" not in error.value and not at.exception
    assert "insp_activity" in charts(at), "the capture stays readable"
    at.run()
    assert gate.calls == 1, "a failure is not retried on its own at every rerun"
    at.button(key="insp_explain_retry").click().run()
    assert explain_jobs.current(store, run_id).wait(WAIT_S)
    at.run()
    assert not at.error and gate.calls == 2
    at.toggle(key="insp_explain").set_value(True).run()
    assert any(t["name"].startswith("miss: ") for t in charts(at)["insp_activity"]["data"])


def test_a_dataset_deleted_while_it_is_explained_is_said_and_nothing_is_kept(capture, monkeypatch):
    store, run_id, folder = capture
    gate = Gate(monkeypatch)
    at = page("inspector", run_id=run_id)
    assert gate.entered.wait(WAIT_S)  # explain has its own connection to the dataset: now it goes
    shutil.rmtree(folder)
    gate.go.set()
    job = explain_jobs.current(store, run_id)
    assert job.wait(WAIT_S)
    assert job.error.startswith(f"Explaining the misses failed: the capture's dataset at {folder} could not be read")
    assert "it is no longer there" in job.error and "\n" not in job.error
    at.run()
    assert not at.exception
    with store.read() as con:
        assert not kept(con, run_id)
    again = explain_jobs.retry(store, run_id)  # the store knows by now: said before any work
    assert again is not job and again.wait(WAIT_S) and gate.calls == 1
    assert again.error == (
        f"Explaining the misses failed: capture {run_id} cannot be read: its capture dataset is no longer at "
        f"{folder} (import it again)."
    )


def test_progress_says_the_stage_and_never_goes_back():
    stages = explain_jobs.STAGES
    mid = explain_jobs._fraction(stages.index("the lookups"), "the lookups", 0.5)
    assert mid == pytest.approx((stages.index("the lookups") - 1 + 0.5) / (len(stages) - 1))
    rounds = explain_jobs._fraction(3, stages[3], 0.9)
    assert rounds == pytest.approx(2 / (len(stages) - 1)), "a stage of rounds does not know how many are left"
    p = explain_jobs.Progress(3, stages[3], "round 3", None, 0.25, 4.2)
    assert p.sentence() == "stage 3 of 11: naming each block's prefix (round 3); 4 s so far"
    waiting = explain_jobs.Progress(0, stages[0], "process 42", None, 0.0, 1.0)
    assert explain_jobs._fraction(0, stages[0], None) == 0.0
    assert waiting.sentence() == "waiting for another process that is explaining this run (process 42); 1 s so far"


EXITING = """
import sys, time
from kvviz.runners import explain_jobs
from kvviz.runners.uploads import import_file
from kvviz.capture.dataset import DatasetWriter
from kvviz.capture.events import decode_batch
from kvviz.capture.synthetic import fleet_messages
from kvviz.store import RunStore

w = DatasetWriter(sys.argv[1] + "/ds", {"replica-0": "s", "replica-1": "s"})
for m in fleet_messages(200_000):
    w.add(m, decode_batch(m.payload, "test"))
w.close()
store = RunStore.open(sys.argv[1] + "/kvviz.duckdb")
job = explain_jobs.ensure(store, import_file(sys.argv[1] + "/ds", store, in_place=True))
while job.progress().index < 2:  # well inside DuckDB's statements
    time.sleep(0.01)
print("exiting", job.progress().stage, flush=True)
"""


@pytest.mark.slow
def test_a_process_that_exits_while_a_capture_is_explained_stops_it_and_exits_cleanly(tmp_path):
    import subprocess
    import sys
    import time

    start = time.monotonic()
    p = subprocess.run([sys.executable, "-c", EXITING, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "exiting" in p.stdout, p.stderr[-2000:]
    assert "FATAL" not in p.stderr and "terminate" not in p.stderr
    assert time.monotonic() - start < 120


def test_the_store_stays_free_for_writers_while_a_dataset_registered_in_place_is_explained(capture, monkeypatch):
    """Explain reads the dataset on a DuckDB of its own: a writer of this process (a run recording, an
    import) is not held behind it."""
    store, run_id, _ = capture
    gate = Gate(monkeypatch)
    job = explain_jobs.ensure(store, run_id)
    assert gate.entered.wait(WAIT_S) and not job.done
    wrote = threading.Event()

    def write() -> None:
        with store.write() as con:
            con.execute("UPDATE runs SET scenario = 'renamed meanwhile' WHERE run_id = ?", [run_id])
        wrote.set()

    threading.Thread(target=write, daemon=True).start()
    assert wrote.wait(WAIT_S) and not job.done, "written while explain still works"
    gate.go.set()
    assert job.wait(WAIT_S) and job.error is None
    with store.read() as con:
        assert kept(con, run_id)


class Stages:
    """A Watch that keeps what it was told."""

    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []

    def stage(self, stage: str, detail: str) -> None:
        self.said.append((stage, detail))

    def running_on(self, con) -> None:
        pass


def _explain_in_thread(store, run_id) -> tuple[threading.Thread, Stages, list]:
    watch, answer = Stages(), []
    thread = threading.Thread(target=lambda: answer.append(explained_mod.explained(store, run_id, watch)))
    thread.start()
    return thread, watch, answer


def test_a_second_process_waits_for_the_first_ones_answer_instead_of_explaining_again(capture, monkeypatch):
    """Another process (here: a live `sleep` named in the claim) is explaining the capture: this one waits,
    says so, and reads the answer the other keeps; explain itself never runs here."""
    import subprocess

    from kvviz.store.claims import claim_path

    store, run_id, _ = capture
    monkeypatch.setattr(explained_mod, "POLL_S", 0.05)
    with store.read() as con:  # the other process's answer, worked out before it is kept
        want = explained_mod.explain_capture(con, run_id)
    other = subprocess.Popen(["sleep", "60"])
    try:
        claim_path(store.path, f"explain-{run_id}").write_text(str(other.pid))
        calls = []
        monkeypatch.setattr(explained_mod, "explain_capture", lambda *a, **k: calls.append(a) or want)
        thread, watch, answer = _explain_in_thread(store, run_id)
        thread.join(0.5)
        assert thread.is_alive() and watch.said == [(explained_mod.WAITING, f"process {other.pid}")]
        explained_mod._keep(store, run_id, want)  # the other process keeps its answer
        thread.join(WAIT_S)
        with store.read() as con:
            assert answer == [explained_mod.read_kept(con, run_id)] and not calls
    finally:
        other.kill()
        other.wait()


def test_a_claim_whose_process_died_is_taken_over(capture, monkeypatch):
    """The first process died midway (its claim stays): the next one does the work, keeps the answer and
    removes the claim; so does a waiter whose holder dies while it waits."""
    import subprocess

    from kvviz.store.claims import claim_path

    store, run_id, _ = capture
    monkeypatch.setattr(explained_mod, "POLL_S", 0.05)
    claim = claim_path(store.path, f"explain-{run_id}")
    other = subprocess.Popen(["sleep", "60"])
    claim.write_text(str(other.pid))
    thread, watch, answer = _explain_in_thread(store, run_id)
    thread.join(0.5)
    assert thread.is_alive(), "waits while the holder lives"
    other.kill()
    other.wait()
    thread.join(WAIT_S)
    assert answer and answer[0] and watch.said[0][0] == explained_mod.WAITING and len(watch.said) > 1
    assert not claim.exists()
    with store.read() as con:
        assert kept(con, run_id)
