"""The commands about the fault and scenario catalogue: list the scenarios, and `audit` every fault
against its scenario and a clean control."""

from __future__ import annotations

import argparse
import sys


def cmd_scenarios(args: argparse.Namespace) -> int:
    """One line a scenario (name, fault or control, title) for picking a --scenario to run."""
    from ..scenarios import SCENARIOS

    for sc in SCENARIOS.values():
        print(f"{sc.name:30} {sc.fault or '(control)':22} {sc.title}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """The detection matrix: every fault against its scenario and the same workload clean."""
    from ..audit import audit, format_matrix
    from ..models import load_model

    m = load_model(args.model, device=args.device)
    rows = audit(m, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_matrix(rows))
    bad = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} rows as expected" + (": " + ", ".join(
        f"{r.scenario}/{r.fault or 'clean'}" for r in bad) + " NOT" if bad else "."))
    return 1 if bad else 0
