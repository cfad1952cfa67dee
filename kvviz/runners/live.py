"""Runs the engine for the UI: a recorded, checked run that reports each step as plain data (the
pool as a block-map frame, tokens so far, the oracle's counters), so pages never touch the engine."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from ..analysis import cross_reads
from ..analysis.run_metrics import LiveMetrics
from ..catalogue.faults import Scope
from ..catalogue.scenarios import scenario
from ..engine import Engine, StepRecord
from ..engine.workload import Workload
from ..llama_backend import MISUSES
from ..models import LoadedModel, load_model
from ..models.queue import WaitCallback, waiting_message  # noqa: F401 (the pages say it)
from ..oracle import ProvenanceOracle
from ..oracle.reference import ReferenceCallback
from ..store import RunStore
from ..store.attention import AttentionSelection
from .backends import as_run, backend_kind
from .checked import check_fault
from .recorded import DEFAULT_SELECTION, record_run


@dataclass
class LiveStep:
    step: int
    tokens: int  # generated so far
    total: int  # tokens the workload asks for (an upper bound: EOS may stop a request early)
    blocks: pd.DataFrame  # block, state, refcount, owners: what figures.blocks.block_map draws
    findings: int
    cross_tenant: str | None  # "cross-tenant reads: ..." so far (no attention figure moves for them), or None
    metrics: dict[str, float | None]  # run_metrics.METRICS after this step (None: nothing to count yet)
    history: dict[str, list[float | None]]  # each metric after every step so far (grows as the run goes)


@dataclass
class Outcome:
    run_id: str
    texts: dict[str, str]
    findings: int
    max_foreign: float
    notes: list[str]  # what the engine ran with a stated consequence, or said once it ran


def model(name: str, device: str = "auto") -> LoadedModel:
    """The model for a name or path; the UI caches it per process."""
    return load_model(name, device=device)


def scenario_workload(name: str, model: LoadedModel) -> dict:
    """A scenario's workload for this model (a tight pool is sized by its tokenizer)."""
    return scenario(name).build(model.tokenizer)


@dataclass(frozen=True, kw_only=True)
class MisuseScenario:
    """A llama.cpp API misuse as the pages show it: its requests, run with the misuse and without."""

    name: str
    title: str
    explanation: str
    pattern: str
    needs: str  # what a workload must hold for it to strike
    workload: dict


def misuse_scenarios() -> dict[str, MisuseScenario]:
    """llama.cpp's API misuses (not kvviz's fault catalogue: mistakes in code that drives llama.cpp)."""
    return {m.name.value: MisuseScenario(name=m.name.value, title=m.title, explanation=m.what, pattern=m.pattern,
                                         needs=m.needs, workload=copy.deepcopy(m.workload)) for m in MISUSES.values()}


def check(model: LoadedModel, workload: dict, fault: str | None = None) -> None:
    """Refuse a workload, fault or model the run would refuse (KvvizError), before anything runs: a page
    that runs several in a row checks them all first."""
    wl = Workload.from_dict(workload)
    check_fault(fault, wl)
    Engine(model, wl.engine).check(wl)
    backend_kind(as_run(wl)).check(model, as_run(wl))


def run(store: RunStore, model: LoadedModel, workload: dict, fault: str | None = None, *,
        scenario_name: str | None = None,
        scope: Scope | None = None, selection: AttentionSelection = DEFAULT_SELECTION,
        on_step: Callable[[LiveStep], None] | None = None, on_wait: WaitCallback | None = None,
        on_reference: ReferenceCallback | None = None) -> Outcome:
    """Validate and run a workload (a dict as in a workload file); raises WorkloadError and friends on
    bad input before anything is recorded. on_wait hears how many runs are ahead on the model;
    on_reference each request as it is compared with itself run alone, after the run."""
    wl = Workload.from_dict(workload)
    total = sum(r.max_new_tokens for r in wl.requests)
    done, metrics = 0, LiveMetrics()
    salts = {r.id: r.cache_salt for r in wl.requests}

    def step(rec: StepRecord, oracle: ProvenanceOracle) -> None:
        nonlocal done
        done += len(rec.sampled)
        metrics.update(rec, oracle)  # running totals: the step's own figures, not a rescan of every step
        if on_step is not None:
            said = cross_reads.sentence(cross_reads.from_findings(oracle.findings, salts))
            on_step(LiveStep(rec.step, done, total, pool_frame(rec), len(oracle.findings), said, metrics.values(),
                             metrics.history))

    checked = record_run(store, model, wl, fault, scenario=scenario_name, scope=scope, selection=selection,
                         on_step=step,
                         on_wait=on_wait, on_reference=on_reference)
    summary = checked.summary()
    return Outcome(checked.result.run_id, {r.id: r.text for r in checked.result.requests}, len(checked.findings),
                   summary["leak"]["max_foreign_mass"], checked.notes)


def comparing_message(done: int, n: int, request: str) -> str:
    """What the reference oracle is doing after the run: seconds per request on a real model."""
    return f"Comparing each request with itself run alone: {request} ({done + 1} of {n})"


def pool_frame(rec: StepRecord) -> pd.DataFrame:
    snap = rec.snapshot
    owners: dict[int, list[str]] = {}
    for req, table in sorted(snap.page_tables.items()):
        for b in table:
            owners.setdefault(b, []).append(req)
    n = len(snap.refcounts)
    return pd.DataFrame({"block": range(n), "state": [snap.state(b) for b in range(n)], "refcount": snap.refcounts,
                         "owners": [",".join(dict.fromkeys(owners.get(b, []))) for b in range(n)]})

