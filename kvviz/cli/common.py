"""What every command shares: the one way a command refuses bad input, so scripts see the same
`kvviz: TOPIC: reason` line on stderr and exit status 2 whichever command they ran."""

from __future__ import annotations

import argparse
import json
import sys

Subcommands = argparse._SubParsersAction  # what each command module's add_* registers its parser on
MODEL_HELP = "smollm2 (default), tiny-llama, tiny-gpt2 or a path"
DEVICE_HELP = "auto (default), cpu, cuda or cuda:N"


def add_model_device(p: argparse.ArgumentParser) -> None:
    """--model and --device, the same for every command that loads a model."""
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--device", default="auto", help=DEVICE_HELP)


def add_db(p: argparse.ArgumentParser, what: str = "run store") -> None:
    """--db, the run store every command that reads or writes runs shares with the UI."""
    p.add_argument("--db", help=f"{what} (default $KVVIZ_DB, else runs/kvviz.duckdb)")


def fail(reason: object, topic: str = "error") -> int:
    """Print the reason (no traceback) and return the exit status for bad input."""
    print(f"kvviz: {topic}: {reason}", file=sys.stderr)
    return 2


def finding_text(kind: str, request: str, step: int, layer: int | None, head: int | None, position: int | None,
                 source_request: str | None, mass: float | None, block: int | None = None,
                 last_step: int | None = None) -> str:
    """One finding on one line; a cross-tenant read names its block and steps (every layer, no mass)."""
    src = f" from {source_request}" if source_request else ""
    steps = f"step {step:3d}" if last_step in (None, step) else f"steps {step}-{last_step}"
    where = (f"block {block}, every layer" if block is not None else
             f"layer {layer:2d} head {head:2d}" if layer is not None and head is not None else "")
    pos = f" pos {position:4d}" if position is not None else ""
    return f"{kind:13} {request:>8} {steps} {where}{pos}{src}" + (f"  mass {mass:.4f}" if mass is not None else "")


def print_rows(columns: list[str], rows: list[tuple], fmt: str) -> None:
    """Rows on stdout as JSON, CSV or an aligned table: every listing command's output."""
    if fmt == "json":
        print(json.dumps([dict(zip(columns, r, strict=True)) for r in rows], default=str, ensure_ascii=False))
    elif fmt == "csv":
        import csv

        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(columns)
        w.writerows(rows)
    else:
        text = [["" if v is None else str(v) for v in r] for r in rows]
        widths = [max([len(c)] + [len(r[i]) for r in text]) for i, c in enumerate(columns)]
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
        for r in text:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
