"""A checked run recorded step by step into the run store: what `kvviz run` and the UI's Run and
Scenarios pages do. A run that dies is marked failed in the database, with its steps so far."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..catalogue.faults import Scope
from ..engine import Engine, StepRecord
from ..engine.observer import AttentionObserver
from ..engine.workload import Workload, WorkloadError
from ..models import LoadedModel
from ..models.queue import WaitCallback
from ..oracle import ProvenanceOracle
from ..oracle.reference import ReferenceCallback
from ..store import RunStore
from ..store.attention import AttentionRecorder, AttentionSelection
from ..store.recorder import RunRecorder
from ..util.ids import new_run_id
from .backends import as_run, backend_kind
from .checked import CheckedRun, check_fault, run_checked

DEFAULT_SELECTION = AttentionSelection()
StepCallback = Callable[[StepRecord, ProvenanceOracle], None]


def record_run(store: RunStore, model: LoadedModel, wl: Workload, fault: str | None = None, *,
               scenario: str | None = None, scope: Scope | None = None,
               selection: AttentionSelection = DEFAULT_SELECTION, on_step: StepCallback | None = None,
               probes: Sequence[AttentionObserver] = (), on_wait: WaitCallback | None = None,
               on_reference: ReferenceCallback | None = None) -> CheckedRun:
    """Run with both oracles, recording every step; on_step sees each step and the oracle so far. The
    run row is written once the run has its turn on the model (on_wait hears the queue until then)."""
    asked, wl = wl, as_run(wl)  # what the oracle runs: the record says so (and the run's notes what changed)
    check_fault(fault, wl)  # bad input is refused before a run row exists
    Engine(model, wl.engine).check(wl)
    backend_kind(wl).check(model, wl)
    if scope is not None:
        check_scope(wl, model.config.num_hidden_layers, "fault", scope.requests, scope.layers)
    check_scope(wl, model.config.num_hidden_layers, "attention", selection.requests, selection.full_layers)
    with model.queue.turn(on_wait):
        run_id, oracle = new_run_id(), ProvenanceOracle()
        attention = AttentionRecorder(oracle, model.config.num_hidden_layers, selection)
        rec = RunRecorder(store, run_id, model=model, workload=wl, scenario=scenario, fault=fault, oracle=oracle,
                          fault_scope=None if scope is None or fault is None else scope.to_dict(), attention=attention)

        def step(r: StepRecord) -> None:
            rec.on_step(r)
            if on_step is not None:
                on_step(r, oracle)

        try:
            run = run_checked(model, asked, fault, on_step=step, probes=[attention, *probes], run_id=run_id,
                              oracle=oracle, scope=scope, on_reference=on_reference)
        except BaseException as e:
            rec.fail(e)
            raise
        save_run(rec, run)
        return run


def save_run(rec: RunRecorder, run: CheckedRun, seconds: float | None = None) -> None:
    """The end of a recorded run: its requests, findings, divergences and totals (the engine's thread;
    the writer thread turns them into rows)."""
    res, summary = run.result, run.summary()
    specs = {s.id: s for s in run.workload.requests}
    for r in res.requests:
        rec.add_request(r, specs[r.id].cache_salt, specs[r.id].parent)
    rec.add_findings(run.findings)
    rec.add_divergences(run.divergences)
    st = res.stats
    rec.complete(st.steps, seconds if seconds is not None else st.seconds, st.generated_tokens,
                 summary["leak"]["max_foreign_mass"], summary["leak"]["leak_rate"], len(run.findings),
                 notes=run.notes)


def check_scope(wl: Workload, num_layers: int, what: str, requests: frozenset[str] | None,
                layers: frozenset[int] | None) -> None:
    """A scope (a fault's, or the attention kept) naming a request or layer the run does not have
    would confine it to nothing, and pass for a detector miss or an empty recording: refuse it."""
    ids = {r.id for r in wl.requests}
    unknown = sorted((requests or set()) - ids)
    if unknown:
        raise WorkloadError(f"{what} requests: {unknown[0]!r} is not a request of this workload "
                            f"({', '.join(sorted(ids))})")
    bad = sorted(x for x in layers or () if not 0 <= x < num_layers)
    if bad:
        raise WorkloadError(f"{what} layers: the model has layers 0..{num_layers - 1}, not {bad[0]}")
