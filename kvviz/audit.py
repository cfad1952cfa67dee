"""The detection matrix: each fault on its scenario, the same workload with correct defences, and
the clean controls. A fault must be seen by the oracle that should see it; a control must be clean."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .checked_run import run_checked
from .models import LoadedModel
from .scenarios import SCENARIOS
from .workload import Workload


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
        if "cross_tenant" in self.kinds and self.max_foreign_mass == 0:
            return "cross-tenant"
        if self.kinds:
            return "provenance" + (" + reference" if self.diverged else "")
        return "reference" if self.diverged else "-"


def audit(m: LoadedModel, progress: Callable[[str], None] = lambda s: None) -> list[AuditRow]:
    rows = []
    for sc in SCENARIOS.values():
        wl = Workload.from_dict(sc.build(m.tokenizer))
        for fault in ([sc.fault, None] if sc.fault else [None]):
            run = run_checked(m, wl, fault)
            s = run.summary()
            rows.append(AuditRow(sc.name, fault, sc.expected if fault else (),
                                 tuple(sorted({f.kind for f in run.findings})), s["leak"]["max_foreign_mass"],
                                 s["divergence"]["diverged_requests"], s["divergence"]["max_logit_diff"]))
            progress(f"{sc.name:30} {fault or 'clean':22} {'ok' if rows[-1].ok else 'NOT AS EXPECTED'}")
    return rows


def format_matrix(rows: list[AuditRow]) -> str:
    head = f"{'scenario':30} {'fault':22} {'expected':28} {'raised':40} {'detected by':24} {'mass':>7} {'div':>4}  ok"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.scenario:30} {r.fault or 'clean':22} {','.join(r.expected) or '-':28} "
                     f"{','.join(r.kinds) or '-':40} {r.detected_by:24} {r.max_foreign_mass:7.4f} "
                     f"{r.diverged:4d}  {'yes' if r.ok else 'NO'}")
    return "\n".join(lines)
