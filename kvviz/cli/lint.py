"""`kvviz lint CAPTURE`: the KV-event contract linter for CI. A capture file or dataset is imported
into a store of its own that is thrown away afterwards (the user's store is not touched); a run id
reads the breaches its import kept. Exit status: 0 clean (or only advisory kinds, which a healthy short
capture shows too), 1 breaches found, 2 unreadable."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ..errors import CaptureError
from .common import Subcommands, print_rows

SHOWN = ["kind", "replica", "count", "first_step", "first_seq", "detail"]


def cmd_lint(args: argparse.Namespace) -> int:
    from ..analysis.breaches import breaches, counted, linted
    from ..capture.lint import ADVISORY
    from ..store import RunStore

    path = Path(args.capture)
    if path.exists():
        with tempfile.TemporaryDirectory(prefix="kvviz-lint-") as tmp:
            store = RunStore.open(Path(tmp) / "lint.duckdb")
            run_id = _import(path, store)
            with store.read() as con:
                ok, found = linted(con, run_id), breaches(con, run_id)
    else:
        store = RunStore.open(args.lint_db)
        if not store.exists():
            raise CaptureError(f"{path}: no such file or folder (nor a run: no store at {store.path})")
        with store.read() as con:
            if not RunStore.has_run(con, args.capture):
                raise CaptureError(f"{path}: no such file or folder, nor a run in {store.path}")
            run_id = args.capture
            ok, found = linted(con, run_id), breaches(con, run_id)
    if not ok:
        raise CaptureError(f"{args.capture}: not a KV-event capture linted on import (a request trace, or a "
                           "capture imported before kvviz linted them: lint its file)")
    if len(found) or args.format != "table":
        print_rows(SHOWN, [tuple(r) for r in found[SHOWN].itertuples(index=False)], args.format)
    advisory = found.kind.isin(ADVISORY)
    print(f"kvviz: lint: {args.capture}: " + (
        "clean: no breach of the KV-event contract" if found.empty else
        f"{counted(found)} (docs/capture-format.md says what each distorts)"
        + (f"; {int(advisory.sum())} advisory ({', '.join(sorted(set(found.kind[advisory])))}: a healthy short "
           "capture shows it too, so it fails no check)" if advisory.any() else "")), file=sys.stderr)
    return 1 if (~advisory).any() else 0


def _import(path: Path, store) -> str:
    """The capture imported for linting; anything but a KV-event capture is refused."""
    from ..runners.uploads import import_file

    if path.is_file() and path.suffix.lower() == ".zip":
        raise CaptureError(f"{path}: a kvviz trace, not a KV-event capture")
    return import_file(path, store)


def add_lint(sub: Subcommands) -> None:
    what = "check a KV-event capture against the contract its consumers trust"
    p = sub.add_parser("lint", help=what, description=what[0].upper() + what[1:] + ": each breach with its count, "
                       "first occurrence and replica. Exit status 0 clean, 1 breaches found, 2 unreadable.")
    p.add_argument("capture", metavar="CAPTURE", help="a JSONL capture, a capture dataset folder or Parquet part "
                   "(imported into a throw-away store), or the id of a capture run in --db")
    p.add_argument("--db", dest="lint_db", metavar="DB", help="the run store a run id is looked up in (default "
                   "$KVVIZ_DB, else runs/kvviz.duckdb)")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table")
    p.set_defaults(func=cmd_lint)
