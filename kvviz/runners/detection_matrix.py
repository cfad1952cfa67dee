"""The detection matrix: each fault on its scenario, the same workload with correct defences, and
the clean controls. A fault must be seen by the oracle that should see it; a control must be clean."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..catalogue.scenarios import SCENARIOS
from ..engine.workload import Workload
from ..models import LoadedModel
from .checked import run_checked


@dataclass
class AuditRow:
    scenario: str
    fault: str | None
    expected: tuple[str, ...]
    kinds: tuple[str, ...]  # finding kinds raised
    max_foreign_mass: float
    diverged: int
    max_logit_diff: float

    @property
    def ok(self) -> bool:
        if self.fault is None:
            return not self.kinds and self.max_foreign_mass == 0 and self.diverged == 0
        return bool(set(self.kinds) & set(self.expected))

    @property
    def detected_by(self) -> str:
        if set(self.kinds) == {"telemetry_mismatch"}:
            return "telemetry"
        if "cross_tenant" in self.kinds and self.max_foreign_mass == 0:
            return "cross-tenant"
        if self.kinds:
            return "provenance" + (" + reference" if self.diverged else "")
        return "reference" if self.diverged else "-"


def audit(model: LoadedModel, progress: Callable[[str], None] = lambda s: None,
          scenarios: Iterable[str] | None = None) -> list[AuditRow]:
    """The matrix's rows for every scenario (or the named ones), in the catalogue's order."""
    rows, names = [], set(SCENARIOS if scenarios is None else scenarios)
    for sc in (s for s in SCENARIOS.values() if s.name in names):
        wl = Workload.from_dict(sc.build(model.tokenizer))
        for fault in ([sc.fault, None] if sc.fault else [None]):
            run = run_checked(model, wl, fault)
            s = run.summary()
            rows.append(AuditRow(sc.name, fault, sc.expected if fault else (),
                                 tuple(sorted({f.kind for f in run.findings})), s["leak"]["max_foreign_mass"],
                                 s["divergence"]["diverged_requests"], s["divergence"]["max_logit_diff"]))
            progress(f"{sc.name:30} {fault or 'clean':22} {'ok' if rows[-1].ok else 'NOT AS EXPECTED'}")
    return rows


def format_matrix(rows: list[AuditRow]) -> str:
    ws = max(len("scenario"), *(len(r.scenario) for r in rows))
    wf = max(len("fault"), *(len(r.fault or "clean") for r in rows))
    we = max(len("expected"), *(len(",".join(r.expected)) for r in rows))
    wr = max(len("raised"), *(len(",".join(r.kinds)) for r in rows))
    head = (f"{'scenario':{ws}} {'fault':{wf}} {'expected':{we}} {'raised':{wr}} {'detected by':24} "
            f"{'mass':>7} {'div':>4}  ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.scenario:{ws}} {r.fault or 'clean':{wf}} {','.join(r.expected) or '-':{we}} "
                     f"{','.join(r.kinds) or '-':{wr}} {r.detected_by:24} {r.max_foreign_mass:7.4f} "
                     f"{r.diverged:4d}  {'yes' if r.ok else 'NO'}")
    return "\n".join(lines)
