"""`python -m kvviz`: the command line for scripts and CI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from tqdm import tqdm

from . import __version__


def cmd_fetch_model(args: argparse.Namespace) -> int:
    """Fetch and convert a model now (e.g. at image build time) so later loads are fast."""
    from .models import ModelError, load_model

    try:
        m = load_model(args.model, device="cpu")
    except ModelError as e:
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 2
    cfg = m.config
    print(f"{m.name}: {cfg.model_type}, {cfg.num_hidden_layers} layers, "
          f"{sum(p.numel() for p in m.model.parameters()):,} parameters, weights sha256 {m.fingerprint[:16]}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run a workload through the engine; print a table, or JSON as the last line with --json."""
    from .engine import ConfigError, Engine, EngineError
    from .models import ModelError, load_model
    from .workload import Workload, WorkloadError

    try:
        wl = Workload.from_file(args.workload)
        wl = _with_overrides(wl, args)
        m = load_model(args.model, device=args.device)
        total = sum(r.max_new_tokens for r in wl.requests)
        with tqdm(total=total, unit="tok", desc="generating", file=sys.stderr, disable=args.quiet) as bar:
            result = Engine(m, wl.engine).run(wl, on_step=lambda rec: bar.update(len(rec.sampled)))
    except (WorkloadError, ConfigError, ModelError, EngineError) as e:
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 2
    summary = {**result.summary(), "model": {"name": m.name, "fingerprint": m.fingerprint}}
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        _print_run(summary)
    return 0


def _with_overrides(wl, args):
    from .engine import EngineConfig

    changes = {k: getattr(args, k) for k in ("isolation", "compute") if getattr(args, k) is not None}
    if args.no_prefix_caching:
        changes["prefix_caching"] = False
    return dataclasses.replace(wl, engine=EngineConfig.from_dict({**wl.engine.to_dict(), **changes}))


def _print_run(s: dict) -> None:
    e, st = s["engine"], s["stats"]
    print(f"run {s['run_id']}  model {s['model']['name']}  isolation {e['isolation']}  compute {e['compute']}  "
          f"blocks {e['num_blocks']}x{e['block_size']}")
    for r in s["requests"]:
        print(f"  {r['id']:>10}  {len(r['output_ids']):3d} tok  cached {r['cached_tokens']:4d}  "
              f"{r['finish_reason']:6}  {r['text']!r}")
    print(f"{st['steps']} steps, {st['generated_tokens']} tokens in {st['seconds']:.2f} s "
          f"({st['tokens_per_second']:.1f} tok/s), prefill computed {st['prefill_tokens_computed']} "
          f"of {st['prompt_tokens']} prompt tokens, {st['preemptions']} preemptions")


def cmd_bench(args: argparse.Namespace) -> int:
    """Throughput against transformers' generate and generate_batch, as a markdown table."""
    from .bench import report, run_bench
    from .models import ModelError, load_model

    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        if not sizes or min(sizes) < 1 or args.new_tokens < 1:
            raise ValueError
    except ValueError:
        print(f"kvviz: error: --sizes takes positive integers separated by commas, got {args.sizes!r}; "
              "--new-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        m = load_model(args.model, device=args.device)
    except ModelError as e:
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 2
    results = run_bench(m, sizes, args.new_tokens, progress=lambda s: print(s, file=sys.stderr, flush=True))
    text = report(m, results, sizes, args.new_tokens)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvviz", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvviz {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-model", help="download and convert a model into the kvviz cache")
    fetch.add_argument("model", nargs="?", default="smollm2", help="smollm2 (default), tiny-llama, tiny-gpt2 or a path")
    fetch.set_defaults(func=cmd_fetch_model)

    run = sub.add_parser("run", help="run a workload through the engine")
    run.add_argument("--workload", required=True, metavar="FILE.json", help="requests, engine settings and seed")
    run.add_argument("--model", default="smollm2", help="smollm2 (default), tiny-llama, tiny-gpt2 or a path")
    run.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    run.add_argument("--isolation", choices=["paged", "masked"], help="override the workload's isolation mechanism")
    run.add_argument("--compute", choices=["inspect", "fast"], help="override the workload's compute path")
    run.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    run.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser("bench", help="throughput against transformers generate and generate_batch")
    bench.add_argument("--model", default="smollm2", help="smollm2 (default), tiny-llama, tiny-gpt2 or a path")
    bench.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    bench.add_argument("--sizes", default="8,32", help="numbers of requests, comma-separated (default 8,32)")
    bench.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    bench.add_argument("--out", metavar="FILE.md", help="also write the markdown table to this file")
    bench.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
