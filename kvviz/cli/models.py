"""The commands about the model itself rather than a workload: `fetch-model` to fill the cache ahead
of time, and `bench` to measure throughput against transformers."""

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
    """Throughput against transformers' generate and generate_batch, as a markdown table."""
    from ..bench import CASES, report, run_bench
    from ..models import load_model

    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        return fail(f"--sizes takes positive integers separated by commas, got {args.sizes!r}")
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
    m = load_model(args.model, device=args.device)
    if args.sessions:
        from ..bench_sessions import run_sessions, sessions_report

        text = sessions_report(m, run_sessions(m, args.sessions, args.repeat,
                                               progress=lambda s: print(s, file=sys.stderr, flush=True)))
        return _write(text, args.out)
    results = run_bench(m, sizes, args.new_tokens, progress=lambda s: print(s, file=sys.stderr, flush=True),
                        repeat=args.repeat, only=only)
    return _write(report(m, results, sizes, args.new_tokens, args.repeat), args.out)


def _write(text: str, out: str | None) -> int:
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0
