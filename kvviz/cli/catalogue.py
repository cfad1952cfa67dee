"""The commands about the fault and scenario catalogue: list the scenarios, and `audit` every fault
against its scenario and a clean control."""

from __future__ import annotations

import argparse
import sys

from .common import DEVICE_HELP, MODEL_HELP, Subcommands


def cmd_scenarios(args: argparse.Namespace) -> int:
    """One line a scenario (name, fault or control, title) for picking a --scenario to run."""
    from ..catalogue.scenarios import SCENARIOS

    name = max(len(sc.name) for sc in SCENARIOS.values())
    fault = max(len(sc.fault or "(control)") for sc in SCENARIOS.values())
    for sc in SCENARIOS.values():
        print(f"{sc.name:{name}}  {sc.fault or '(control)':{fault}}  {sc.title}")
    return 0


AUDIT_MODELS = ("tiny-llama", "tiny-gpt2", "smollm2")


def cmd_audit(args: argparse.Namespace) -> int:
    """The detection matrix of each model: every fault against its scenario and the same workload clean."""
    from ..models import load_model
    from ..runners.detection_matrix import audit, format_matrix

    names = AUDIT_MODELS if args.model == "all" else [n.strip() for n in args.model.split(",") if n.strip()]
    bad, total = [], 0
    for name in names:
        model = load_model(name, device=args.device)
        print(f"== {name}", file=sys.stderr, flush=True)
        rows = audit(model, progress=lambda s: print(s, file=sys.stderr, flush=True))
        print(f"\n{name}\n{format_matrix(rows)}")
        total += len(rows)
        bad += [f"{name}: {r.scenario}/{r.fault or 'clean'}" for r in rows if not r.ok]
    print(f"\n{total - len(bad)} of {total} rows as expected on {', '.join(names)}" +
          (": " + ", ".join(bad) + " NOT" if bad else "."))
    return 1 if bad else 0


def add_scenarios(sub: Subcommands) -> None:
    scen = sub.add_parser("scenarios", help="list the replayable scenarios")
    scen.set_defaults(func=cmd_scenarios)


def add_audit(sub: Subcommands) -> None:
    aud = sub.add_parser("audit", help="the detection matrix: every fault x its workload, plus clean controls")
    aud.add_argument("--model", default="all", help="all (default: tiny-llama, tiny-gpt2 and smollm2), or models "
                     "separated by commas: " + MODEL_HELP.replace(" (default)", ""))
    aud.add_argument("--device", default="auto", help=DEVICE_HELP)
    aud.set_defaults(func=cmd_audit)
