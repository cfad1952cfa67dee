"""A run with both oracles attached: what `run`, `audit`, the scenarios and the UI all use."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..analysis import cross_reads
from ..catalogue.faults import FAULTS, Scope, UnknownFault
from ..engine import RunResult, StepRecord
from ..engine.observer import AttentionObserver
from ..engine.workload import Workload
from ..errors import WorkloadError
from ..models import LoadedModel
from ..models.queue import WaitCallback
from ..oracle import Finding, OracleConfig, ProvenanceOracle
from ..oracle.reference import Divergence, ReferenceCallback, compare_with_isolated, divergence_summary
from ..util.ids import new_run_id
from .backends import as_run, backend_kind, refuse_fault, run_backend


class FaultMismatch(WorkloadError):
    """The fault needs the other isolation mechanism."""


@dataclass
class CheckedRun:
    workload: Workload
    fault: str | None
    result: RunResult
    oracle: ProvenanceOracle
    divergences: list[Divergence]
    notes: list[str] = field(default_factory=list)  # workload fields the backend runs with a stated consequence

    @property
    def findings(self) -> list[Finding]:
        return self.oracle.findings

    def summary(self) -> dict:
        """The run's JSON summary with the keys scripts gate on: leak, divergence, findings; and the
        cross-tenant reads in one sentence (no leak figure moves for them), or None."""
        salts = {r.id: r.cache_salt for r in self.workload.requests}
        return {**self.result.summary(), "backend": self.workload.engine.backend, "notes": self.notes,
                "fault": self.fault, "leak": self.oracle.summary(),
                "entropy": self.oracle.mean_entropy(),
                "divergence": divergence_summary(self.divergences),
                "findings": [f.to_dict() for f in self.findings],
                "cross_tenant": cross_reads.sentence(cross_reads.from_findings(self.findings, salts))}


def check_fault(fault: str | None, workload: Workload) -> None:
    """Refuse an unknown fault, or one for the other isolation mechanism, before anything runs."""
    if fault is None:
        return
    refuse_fault(fault, workload)
    if workload.engine.backend != "kvviz":  # another engine's own faults (llama.cpp's API misuses)
        return
    if fault not in FAULTS:
        raise UnknownFault(f"unknown fault {fault!r}; the catalogue: {', '.join(FAULTS)}")
    if FAULTS[fault].isolation not in (None, workload.engine.isolation):
        raise FaultMismatch(f"fault {fault!r} breaks the {FAULTS[fault].isolation} mechanism; this workload uses "
                            f"isolation {workload.engine.isolation!r}")


def run_checked(model: LoadedModel, workload: Workload, fault: str | None = None,
                on_step: Callable[[StepRecord], None] | None = None, config: OracleConfig | None = None,
                reference: bool = True, probes: Sequence[AttentionObserver] = (), run_id: str | None = None,
                oracle: ProvenanceOracle | None = None, scope: Scope | None = None,
                on_wait: WaitCallback | None = None, on_reference: ReferenceCallback | None = None) -> CheckedRun:
    """Run with the provenance oracle on every layer (inspect path) and compare each request with
    itself run alone (on_reference hears each), in one turn on the model (on_wait hears how many runs
    are ahead). The workload's engine.backend says whose engine runs it (runners.backends)."""
    check_fault(fault, workload)
    wl = as_run(workload)  # the oracle needs the probabilities
    kind = backend_kind(wl)
    notes = kind.check(model, workload)  # as asked: what the backend changes of it is a note
    oracle = oracle or ProvenanceOracle(config or OracleConfig())
    with model.queue.turn(on_wait):
        result = run_backend(model, wl, fault=fault, scope=scope, observers=[oracle, *probes], keep_logits=reference,
                             on_step=on_step, run_id=run_id or new_run_id())
        for r in result.requests:
            oracle.check_telemetry(r.id, r.cached_tokens)
        leaked: dict[str, float] = {}
        for s in oracle.steps:
            for r, name in enumerate(s.requests):
                leaked[name] = max(leaked.get(name, 0.0), float(s.max_foreign[r].max()))
        divs = compare_with_isolated(model, result, leaked, kind.alone(wl), kind.tolerance,
                                     on_request=on_reference) if reference else []
    return CheckedRun(workload, fault, result, oracle, divs, notes + result.notes)
