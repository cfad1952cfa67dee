"""`python -m kvviz`: the command line for scripts and CI."""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..errors import KvvizError
from .audit_timing import add_audit_timing
from .capture import add_capture_example, add_capture_vllm
from .catalogue import add_audit, add_scenarios
from .common import fail
from .lint import add_lint
from .models import add_bench, add_fetch_model
from .monitor import add_monitor
from .run import add_run
from .serve import add_serve
from .store import add_explain, add_export, add_import, add_replay, add_runs, add_sql
from .whatif import add_whatif

COMMANDS = (add_fetch_model, add_run, add_runs, add_sql, add_replay, add_export, add_capture_vllm, add_capture_example,
            add_monitor, add_import, add_lint, add_explain, add_whatif, add_scenarios, add_audit, add_bench, add_serve,
            add_audit_timing)  # --help's order


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand, registered by the module that runs it (its flags beside its cmd_* function,
    whose heavy imports wait until it runs so `--help` stays fast)."""
    p = argparse.ArgumentParser(prog="python -m kvviz", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvviz {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse argv (sys.argv when None) and run the chosen command; its return value is the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if "db" in args:  # the one RunStore of this process, for every command that reads or writes runs
            from ..store import RunStore

            args.store = RunStore.open(args.db)
        return args.func(args)
    except KvvizError as e:  # bad input of any command: one line, exit 2, no traceback
        return fail(e, args.command)
    except KeyboardInterrupt:  # a recording run has marked itself failed on the way out
        print("\nkvviz: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # an output path that cannot be written: a directory, a missing folder
        where = f"{e.filename}: " if e.filename else ""
        return fail(f"{where}{e.strerror or e}")
