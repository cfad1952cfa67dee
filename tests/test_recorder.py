"""The recorder's writer thread: the engine hands steps over through a bounded queue and waits only
when it is full; a write that fails reaches the engine's thread as a StoreError with the run marked
failed; a run stopped midway leaves a readable database with the run marked."""

from __future__ import annotations

import functools
import threading
import time

import pytest

from kvviz.catalogue.scenarios import SCENARIOS
from kvviz.engine import Engine
from kvviz.engine.workload import Workload
from kvviz.models import load_model
from kvviz.runners.checked import run_checked
from kvviz.runners.recorded import save_run
from kvviz.store import RunStore, StoreError
from kvviz.store.recorder import RunRecorder
from kvviz.util.ids import new_run_id


@functools.cache
def tiny():
    return load_model("tiny-llama")


def workload() -> Workload:
    return Workload.from_dict(SCENARIOS["control_forks"].workload)


def status(store: RunStore, run_id: str) -> tuple:
    with store.read() as con:
        return con.execute("SELECT status, error, (SELECT count(*) FROM steps WHERE run_id = $r), "
                           "(SELECT count(*) FROM blocks WHERE run_id = $r) FROM runs WHERE run_id = $r",
                           {"r": run_id}).fetchone()


def run_recorded(store: RunStore, rec: RunRecorder, stop_at: int | None = None,
                 stop: BaseException | None = None) -> None:
    """What record_run does around a run: a failure marks the run failed and is raised."""
    wl = workload()

    def on_step(r):
        rec.on_step(r)
        if r.step == stop_at:
            raise stop

    try:
        run = run_checked(tiny(), wl, on_step=on_step, run_id=rec.run_id)
    except BaseException as e:
        rec.fail(e)
        raise
    save_run(rec, run)


def test_the_engine_waits_only_when_the_queue_is_full(tmp_path):
    """A writer held at its first step: the engine hands over queue_steps more and then waits;
    released, every step is written."""
    m, store = tiny(), RunStore.open(tmp_path / "k.duckdb")
    records = []
    Engine(m, workload().engine).run(workload(), on_step=records.append)
    assert len(records) >= 5
    rec = RunRecorder(store, new_run_id(), model=m, workload=workload(), queue_steps=2, flush_every=100)
    started, release = threading.Event(), threading.Event()
    step_rows = rec._step_rows

    def held(*args):
        started.set()
        release.wait(10)
        step_rows(*args)

    rec._step_rows = held
    handed = []

    def engine():
        for r in records:
            rec.on_step(r)
            handed.append(r.step)

    producer = threading.Thread(target=engine, daemon=True)
    producer.start()
    assert started.wait(10)
    deadline = time.monotonic() + 10
    while len(handed) < 3 and time.monotonic() < deadline:  # one in the writer's hands, two queued
        time.sleep(0.01)
    producer.join(0.3)
    assert producer.is_alive() and len(handed) == 3  # the fourth waits for room
    release.set()
    producer.join(10)
    assert not producer.is_alive() and len(handed) == len(records)
    rec.complete(len(records), 0.0, 0, None, None, 0)
    assert status(store, rec.run_id)[:3] == ("complete", None, len(records))


@pytest.mark.parametrize("broken", [False, True])
def test_a_failed_write_reaches_the_engine_and_marks_the_run_failed(tmp_path, monkeypatch, broken):
    store = RunStore.open(tmp_path / "k.duckdb")
    rec = RunRecorder(store, new_run_id(), model=tiny(), workload=workload(), flush_every=1, flush_seconds=0)
    insert, writes = rec._insert, []

    def failing_insert(tables, close_part=False):
        writes.append(threading.current_thread().name)
        if broken and len(writes) == 2:
            raise OSError("No space left on device")
        insert(tables, close_part)

    monkeypatch.setattr(rec, "_insert", failing_insert)
    if not broken:  # the control: the same run, written in full
        run_recorded(store, rec)
        assert status(store, rec.run_id)[:2] == ("complete", None)
        return
    with pytest.raises(StoreError, match=r"recording run .* failed: OSError: No space left on device"):
        run_recorded(store, rec)
    state, error, steps, _ = status(store, rec.run_id)
    assert state == "failed" and "No space left on device" in error
    assert steps == 1  # what was written before the failure stays readable
    assert set(writes) == {f"kvviz-recorder-{rec.run_id}"}  # written off the engine's thread


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), RuntimeError("power cut")])
def test_a_run_stopped_midway_leaves_a_readable_database_with_the_run_marked(tmp_path, stop):
    """Steps the writer still held when the run stopped are written before the run is marked."""
    store = RunStore.open(tmp_path / "k.duckdb")
    rec = RunRecorder(store, new_run_id(), model=tiny(), workload=workload(), flush_every=100)
    with pytest.raises(type(stop)):
        run_recorded(store, rec, stop_at=2, stop=stop)
    state, error, steps, blocks = status(store, rec.run_id)
    assert state == "failed" and steps == 3 and blocks > 0
    assert error == ("stopped before it finished (Ctrl-C)" if isinstance(stop, KeyboardInterrupt)
                     else "RuntimeError: power cut")


def stored(store: RunStore) -> str:
    """The attention rows as the recorder stored them (null key lists where a row reads its query's keys):
    the Parquet parts of the store's runs."""
    return (f"(SELECT * FROM read_parquet('{store.attention_dir}/*/*.parquet') "
            "WHERE run_id IN (SELECT run_id FROM runs))")


def test_keys_written_once_per_query_read_back_as_the_rows_that_hold_their_own(tmp_path, monkeypatch):
    """The usual case (no weight outside what a query could see) writes each query's keys once and its
    rows without them; the `attention` view joins them back to exactly the rows the per-head pass (which
    keeps each row's own keys, as a fault needs) writes for the same run."""
    from kvviz.runners.recorded import record_run
    from kvviz.store.attention import AttentionRecorder

    def recorded(name: str) -> tuple[list, int, int]:
        store = RunStore.open(tmp_path / f"{name}.duckdb")
        record_run(store, tiny(), workload())
        with store.read() as con:
            rows = con.execute("SELECT step, layer, head, request_id, position, key_slots, weights, key_classes "
                               "FROM attention ORDER BY ALL").fetchall()
            shared, keys = con.execute("SELECT count(*) FILTER (key_slots IS NULL), (SELECT count(*) FROM "
                                       f"attention_keys) FROM {stored(store)}").fetchone()
        return rows, shared, keys

    split, shared, keys = recorded("split")
    monkeypatch.setattr(AttentionRecorder, "_strays", staticmethod(lambda group, stack: [True] * len(stack)))
    whole, whole_shared, whole_keys = recorded("whole")
    assert split == whole and len(split) == shared > keys > 0
    assert whole_shared == whole_keys == 0


def test_layers_cut_together_or_one_at_a_time_record_the_same_rows(tmp_path, monkeypatch):
    """A step's layers wait and are cut into cells together; a pending limit of one cell cuts each
    layer alone (as a prefill chunk's big layer is): the rows must not depend on where the cuts fall,
    and a fault's rows (which keep their own keys) are among them."""
    from kvviz.runners.recorded import record_run
    from kvviz.store import attention

    wl = Workload.from_dict(SCENARIOS["low_precision_fill"].workload)

    def recorded(name: str) -> list:
        store = RunStore.open(tmp_path / f"{name}.duckdb")
        record_run(store, tiny(), wl, fault="low_precision_fill")
        with store.read() as con:
            return con.execute("SELECT step, layer, head, request_id, position, key_slots, weights, key_classes "
                               "FROM attention ORDER BY ALL").fetchall()

    together = recorded("together")
    monkeypatch.setattr(attention, "PENDING_CELLS", 1)
    alone = recorded("alone")
    assert together == alone and len(together) > 0
    with RunStore.open(tmp_path / "together.duckdb").read() as con:
        own = con.execute(f"SELECT count(*) FROM {stored(RunStore.open(tmp_path / 'together.duckdb'))} "
                          "WHERE key_slots IS NOT NULL").fetchone()[0]
    assert own > 0, "a fill value that is not -inf puts weight outside what a query could see"


def test_attention_rows_written_as_they_come_are_the_rows_written_at_the_flushes(tmp_path, monkeypatch):
    """The writer turns held attention rows into a row group once GROUP_CELLS weights wait (between
    flushes, so a run's end has little left); a limit of one cell writes a row group every step: the
    rows read back must be the same, and the part must hold more row groups."""
    import pyarrow.parquet as pq

    from kvviz.runners.recorded import record_run
    from kvviz.store import recorder

    wl = Workload.from_dict(SCENARIOS["low_precision_fill"].workload)

    def recorded(name: str) -> tuple[list, int]:
        store = RunStore.open(tmp_path / f"{name}.duckdb")
        record_run(store, tiny(), wl, fault="low_precision_fill")
        with store.read() as con:
            rows = con.execute("SELECT step, layer, head, request_id, position, key_slots, weights, key_classes "
                               "FROM attention ORDER BY ALL").fetchall()
        groups = sum(pq.ParquetFile(f).num_row_groups for f in store.attention_dir.glob("*/*.parquet"))
        return rows, groups

    at_flushes, few = recorded("at-flushes")
    monkeypatch.setattr(recorder, "GROUP_CELLS", 1)
    as_they_come, many = recorded("as-they-come")
    assert as_they_come == at_flushes and len(at_flushes) > 0
    assert many > few, "a row group as each step's rows come, not only at the flushes"
