"""Run the two-sessions-plus-CLI browser test (tests/test_browser.py) many times in a row, each with
its deadline, and say how each went: the check that the model line and the run store never leave two
app sessions and a CLI run waiting on each other. A failed run's output, with the stacks of the app,
the CLI and the test, is kept in the log folder.

    python scripts/stress_sessions.py --runs 20 [--with tests/test_concurrency.py] [--log runs/stress]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/test_browser.py::test_two_sessions_run_scenarios_at_once_while_the_cli_records"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--with", dest="also", action="append", default=[], metavar="TESTS",
                   help="tests to run before it in the same pytest run (e.g. tests/test_concurrency.py)")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds one pytest run may take (default 420)")
    p.add_argument("--log", type=Path, default=ROOT / "runs" / "stress", help="where failed runs' output goes")
    args = p.parse_args()
    args.log.mkdir(parents=True, exist_ok=True)
    failed = 0
    for i in range(1, args.runs + 1):
        t = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n0", "-q", *args.also, TEST]
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.deadline)
            code, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            code, out = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
        seconds = time.monotonic() - t
        if code != 0:
            failed += 1
            (args.log / f"run-{i}.log").write_text(out if isinstance(out, str) else out.decode())
        print(f"run {i:3d}/{args.runs}: {'ok' if code == 0 else f'FAILED ({code})'} in {seconds:.0f} s", flush=True)
    print(f"{args.runs - failed} of {args.runs} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
