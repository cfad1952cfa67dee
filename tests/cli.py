"""The command line as tests call it: in this process (`kvviz`), or as a new Python (`kvviz_process`).

Not a test module. A test that is not about the process itself (its exit on a signal, a pipe that
closes, another process reading while it writes) calls `kvviz`: the same `main()` that
`python -m kvviz` runs, with stdout, stderr and the exit status captured, and none of the 5-8 s a new
Python spends importing torch and transformers and loading the model again. Each command keeps at
least one end-to-end test through `kvviz_process`.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def _environ(env: Mapping[str, str] | None) -> Iterator[None]:
    """os.environ with `env` laid over it, restored afterwards."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def kvviz(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m kvviz ARGS` run by this process: what it printed and its exit status."""
    from kvviz.cli import main

    out, err = io.StringIO(), io.StringIO()
    with _environ(env), redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse: --help (0) and a bad flag (2)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return subprocess.CompletedProcess(["python", "-m", "kvviz", *args], code, out.getvalue(), err.getvalue())


def kvviz_process(*args: str, env: Mapping[str, str] | None = None,
                  timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m kvviz ARGS` as a new process, from the repository's root; past `timeout` it fails
    with the stacks of the process's threads."""
    proc = subprocess.Popen([sys.executable, "-m", "kvviz", *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """proc's output once it ends; at the deadline its stacks and a failure instead of a stall."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{' '.join(map(str, proc.args))} still ran after {timeout:g} s; its stacks and "
                             f"output:\n{_stacks(proc)}") from None


@contextmanager
def stacks_on_failure(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Where the block fails while proc still runs, proc's stacks are printed with the failure."""
    try:
        yield proc
    except BaseException:
        if proc.poll() is None:
            print(f"{' '.join(map(str, proc.args))} was still running; its stacks and output:\n{_stacks(proc)}",
                  file=sys.stderr)
        raise


def _stacks(proc: subprocess.Popen) -> str:
    """A running child's threads' stacks (PYTHONFAULTHANDLER, set by conftest.py for every child,
    prints them on SIGABRT, which ends it) and what it printed."""
    proc.send_signal(signal.SIGABRT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return f"{err or ''}\n{out or ''}"
