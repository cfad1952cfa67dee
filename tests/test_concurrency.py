"""Many runs on one model at once: attention routed per call (no run changes the shared model), the
reference oracle usable at any time, and runs queued first come first served with their place said."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import pytest
import torch

from kvviz.catalogue.scenarios import scenario
from kvviz.engine import Engine
from kvviz.engine.workload import Workload
from kvviz.models import load_model
from kvviz.models.queue import ModelQueue, waiting_message
from kvviz.oracle.reference import isolated_logits
from kvviz.runners.checked import run_checked

from .engine_workloads import make, workloads


@functools.cache
def tiny(name: str = "tiny-llama"):
    return load_model(name)


def in_threads(fns) -> list:
    """Run each function in its own thread, started together; re-raise the first error."""
    results, errors = [None] * len(fns), []
    start = threading.Barrier(len(fns))

    def go(i, fn):
        try:
            start.wait()
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_the_reference_oracle_runs_while_engines_run_on_the_same_model(name):
    """The race of issue 13: a reference forward while another thread's engine run is in its steps.
    With the model switched per run this crashed or read the other run's attention."""
    m = tiny(name)
    ids = [int(t) for t in m.tokenizer("The seven colours of the rainbow are red, orange").input_ids]
    alone = isolated_logits(m, ids, ids[:6])
    wl = make(workloads(m.tokenizer)["mixed_lengths_late_arrivals_chunked"], "paged", "inspect")
    expect = Engine(m, wl.engine).run(wl)
    unqueued = dataclasses.replace(m, queue=ModelQueue())  # the same nn.Module, not waiting for the other turn
    stop = threading.Event()

    def engine_runs():
        outs = []
        while not stop.is_set() or not outs:
            outs.append([r.output_ids for r in Engine(unqueued, wl.engine).run(wl).requests])
        return outs

    def references():
        try:
            return [isolated_logits(m, ids, ids[:6]) for _ in range(15)]
        finally:
            stop.set()

    outs, refs = in_threads([engine_runs, references])
    for ref in refs:
        assert torch.equal(ref, alone)
    for out in outs:
        assert out == [r.output_ids for r in expect.requests]


def test_two_engine_runs_at_once_on_one_model_each_equal_their_run_alone():
    m = tiny()
    wls = workloads(m.tokenizer)
    a = make(wls["mixed_lengths_late_arrivals_chunked"], "paged", "inspect")
    b = make(wls[list(wls)[1]], "masked", "fast")
    alone = [[r.output_ids for r in Engine(m, w.engine).run(w).requests] for w in (a, b)]
    together = in_threads([lambda w=w: [r.output_ids for r in Engine(dataclasses.replace(m, queue=ModelQueue()),
                                                                     w.engine).run(w).requests]
                           for w in (a, b)])
    assert together == alone


def test_checked_runs_in_threads_queue_and_each_equals_its_run_alone():
    m = tiny()
    names = ["boundary", "global", "control_forks", "early_free"]
    built = {n: (Workload.from_dict(scenario(n).build(m.tokenizer)), scenario(n).fault) for n in names}
    alone = {n: run_checked(m, wl, fault) for n, (wl, fault) in built.items()}
    heard: dict[str, list[int]] = {n: [] for n in names}
    together = in_threads([lambda n=n: run_checked(m, *built[n], on_wait=heard[n].append) for n in names])
    for n, run in zip(names, together, strict=True):
        assert [r.output_ids for r in run.result.requests] == [r.output_ids for r in alone[n].result.requests]
        assert [f.to_dict() for f in run.findings] == [f.to_dict() for f in alone[n].findings]
        assert [d.to_dict() for d in run.divergences] == [d.to_dict() for d in alone[n].divergences]
    assert bool(alone["boundary"].findings) and not alone["control_forks"].findings  # the detector fired, control clean
    waits = sorted(max(h) for h in heard.values() if h)
    assert waits == [1, 2, 3]  # four runs at once: three waited, and each heard its place in the line


def test_the_queue_is_first_come_first_served_and_says_how_many_are_ahead():
    q, order, said = ModelQueue(), [], {}
    gate = threading.Event()

    def holder():
        with q.turn():
            order.append("holder")
            gate.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    while q.waiting == 0 and not order:
        time.sleep(0.001)
    def waiter(i):
        with q.turn(said[i].append):
            order.append(i)

    said.update({i: [] for i in range(3)})
    waiters = [threading.Thread(target=waiter, args=(i,)) for i in range(3)]
    # Enter the line one at a time so the order is known.
    for i, w in enumerate(waiters):
        w.start()
        while q.waiting < i + 1:
            time.sleep(0.001)
    gate.set()
    for w in [t, *waiters]:
        w.join(10)
    assert order == ["holder", 0, 1, 2]
    assert said[0] == [1] and said[1][0] == 2 and said[2][0] == 3
    assert said[2] == sorted(said[2], reverse=True)  # the number only goes down
    assert waiting_message(1) == "waiting for the model: 1 run ahead"
    assert waiting_message(3) == "waiting for the model: 3 runs ahead"


def test_a_turn_is_reentrant_and_a_cancelled_wait_leaves_the_line():
    q = ModelQueue()
    with q.turn():
        with q.turn():  # the same thread: no deadlock
            pass
        errors = []

        def impatient():
            def give_up(ahead):
                raise TimeoutError(f"{ahead} ahead")
            try:
                with q.turn(give_up):
                    pass
            except TimeoutError as e:
                errors.append(e)

        th = threading.Thread(target=impatient)
        th.start()
        th.join(10)
        assert [str(e) for e in errors] == ["1 ahead"]
        assert q.waiting == 0  # the cancelled ticket is gone
    done = []

    def later():
        with q.turn():
            done.append(1)

    th = threading.Thread(target=later)
    th.start()
    th.join(10)
    assert done == [1]  # the model is free again


def test_the_line_spans_processes_and_a_dead_process_never_blocks_it(tmp_path):
    """Two queues on one line folder stand for two processes; a ticket left by a killed process is
    skipped and removed."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{1:020d}-{int(gone.stdout)}-1"  # older than any real ticket, its process ended
    dead.touch()
    first, second = ModelQueue(tmp_path), ModelQueue(tmp_path)
    with first.turn():  # not blocked by the dead ticket
        assert not dead.exists()
        heard, entered = [], threading.Event()

        def other():
            with second.turn(heard.append):
                entered.set()

        th = threading.Thread(target=other)
        th.start()
        assert not entered.wait(0.5)  # the other "process" waits for this one
        assert heard == [1]
    th.join(10)
    assert entered.is_set() and list(tmp_path.iterdir()) == []  # tickets are removed on the way out


@pytest.mark.slow
def test_a_cli_run_waits_for_a_run_of_another_process_and_says_so(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    m = tiny()
    cmd = [sys.executable, "-m", "kvviz", "run", "--scenario", "control_forks", "--model", "tiny-llama", "--db",
           str(tmp_path / "k.duckdb"), "--quiet", "--json"]
    with m.queue.turn():  # this process holds the model
        cli = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        line = cli.stderr.readline()
        while line and "waiting for the model" not in line:
            line = cli.stderr.readline()
        assert line.strip() == "kvviz: waiting for the model: 1 run ahead"
        time.sleep(0.5)
        assert cli.poll() is None  # still waiting while the turn is held
    out, err = cli.communicate(timeout=300)
    assert cli.returncode == 0, err


def test_a_waiting_run_is_told_its_place_every_second_so_a_left_page_can_cancel_it():
    q, calls, errors = ModelQueue(), [], []
    held, release = threading.Event(), threading.Event()

    def holder():
        with q.turn():
            held.set()
            release.wait(10)

    def left_page(ahead):
        calls.append(ahead)
        if len(calls) == 2:  # the unchanged place is said again: the second call is the heartbeat
            raise InterruptedError("the page was left")

    def waiter():
        try:
            with q.turn(left_page):
                errors.append("the run started")
        except InterruptedError as e:
            errors.append(str(e))

    h = threading.Thread(target=holder)
    h.start()
    held.wait(5)
    w = threading.Thread(target=waiter)
    w.start()
    w.join(5)
    assert errors == ["the page was left"] and calls == [1, 1] and q.waiting == 0
    release.set()
    h.join(5)


def test_both_lines_keep_one_order_even_when_a_ticket_is_slow_to_write(tmp_path, monkeypatch):
    """A thread switch between joining the process's line and the machine's must not let two runs
    stand in opposite orders in the two lines (each would wait for the other forever)."""
    from kvviz.models import queue as queue_module

    real, slowed = queue_module._FileLine.join, threading.Event()

    def slow_first_join(self):
        if not slowed.is_set():
            slowed.set()
            time.sleep(0.05)
        return real(self)

    monkeypatch.setattr(queue_module._FileLine, "join", slow_first_join)
    q, done = ModelQueue(tmp_path), []

    def run(i):
        with q.turn():
            done.append(i)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert sorted(done) == [0, 1, 2]


def test_a_zombie_holds_no_place_in_the_model_line():
    """A process that exited but was not yet reaped still answers kill(pid, 0): its ticket must not
    block the line for good."""
    import subprocess
    import sys
    import time

    from kvviz.models.queue import _alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while _alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child.pid), "an exited, unreaped child counts as dead"
    finally:
        child.wait()
    import os

    assert _alive(os.getpid())
