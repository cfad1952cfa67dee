"""The commands about the model itself rather than a workload: `fetch-model` to fill the cache ahead
of time, and `bench` to measure throughput against transformers, memory utilisation and the sharing
sweep."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import fail


def cmd_fetch_model(args: argparse.Namespace) -> int:
    """Fetch and convert a model now (e.g. at image build time) so later loads are fast."""
    from ..models import load_model

    m = load_model(args.model, device="cpu")
    cfg = m.config
    print(f"{m.name}: {cfg.model_type}, {cfg.num_hidden_layers} layers, "
          f"{sum(p.numel() for p in m.model.parameters()):,} parameters, weights sha256 {m.fingerprint[:16]}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Throughput against transformers' generate and generate_batch (or memory utilisation, the sharing
    sweep, many sessions), as a markdown table."""
    from ..bench.throughput import CASES, report, run_bench
    from ..models import load_model

    given = args.sizes or ("32" if args.memory or args.serve else "8" if args.sharing_sweep else "8,32")
    sizes = _positive_ints(given, "--sizes")
    lengths = _positive_ints(args.lengths, "--lengths")
    if sizes is None or lengths is None:
        return 2
    if args.new_tokens < 1:
        return fail(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.out and not Path(args.out).parent.is_dir():  # say so now, not after the whole benchmark
        return fail(f"--out {args.out}: no folder {Path(args.out).parent}")
    if args.repeat < 1:
        return fail(f"--repeat must be >= 1, got {args.repeat}")
    if args.sessions is not None and args.sessions < 1:
        return fail(f"--sessions must be >= 1, got {args.sessions}")
    only = {c.strip() for c in args.cases.split(",") if c.strip()} if args.cases else None
    if only and not any(case.startswith(o) for o in only for case in CASES):
        return fail(f"--cases {args.cases!r} matches no case; the cases are {', '.join(CASES)}")
    if args.sharing_sweep:
        from ..bench.sharing import NEW, PRIVATE

        if min(lengths) <= PRIVATE + NEW:
            return fail(f"--lengths: a sequence holds a shared prefix, {PRIVATE} private and {NEW} generated "
                        f"tokens, so every length must exceed {PRIVATE + NEW}, got {args.lengths!r}")
    if args.capture_live:
        from ..bench.capture_import import live_report, run_live_bench

        return _write(live_report(run_live_bench(duration=args.duration, progress=say)), args.out)
    if args.capture_import:
        from ..bench.capture_import import capture_report, run_capture_bench

        events = _positive_ints(args.sizes or "1000000", "--sizes")
        if events is None:
            return 2
        return _write(capture_report(run_capture_bench(events, progress=say)), args.out)
    m = load_model(args.model, device=args.device)
    if args.memory:
        from ..bench.memory import memory_report, run_memory_bench

        return _write(memory_report(m, run_memory_bench(m, sizes, progress=say)), args.out)
    if args.serve:
        from ..bench.serve import run_serve_bench, serve_report

        results = run_serve_bench(m, args.model, args.device, sizes, args.new_tokens, only, progress=say)
        return _write(serve_report(m, results, args.new_tokens), args.out)
    if args.sharing_sweep:
        from ..bench.sharing import sweep, sweep_report

        points = [p for n in sizes for p in sweep(m, tuple(lengths), n, args.repeat, progress=say)]
        return _write(sweep_report(m, points, args.repeat), args.out)
    if args.tiers:
        from ..bench.tiers import run_tiers_bench, tiers_report

        results = run_tiers_bench(m, sizes, args.new_tokens, args.repeat, progress=say)
        return _write(tiers_report(m, results, args.repeat), args.out)
    if args.sessions:
        from ..bench.sessions import run_sessions, sessions_report

        return _write(sessions_report(m, run_sessions(m, args.sessions, args.repeat, progress=say)), args.out)
    results = run_bench(m, sizes, args.new_tokens, progress=say, repeat=args.repeat, only=only)
    return _write(report(m, results, sizes, args.new_tokens, args.repeat), args.out)


def say(line: str) -> None:
    """Progress on stderr, so stdout holds only the table."""
    print(line, file=sys.stderr, flush=True)


def _positive_ints(text: str, flag: str) -> list[int] | None:
    """Comma-separated positive integers, or None after saying what is wrong."""
    try:
        values = [int(s) for s in text.split(",")]
        if values and min(values) >= 1:
            return values
    except ValueError:
        pass
    fail(f"{flag} takes positive integers separated by commas, got {text!r}")
    return None


def _write(text: str, out: str | None) -> int:
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0
