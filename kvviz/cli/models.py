"""The commands about the model itself rather than a workload: `fetch-model` to fill the cache ahead
of time, and `bench` to measure throughput against transformers, memory utilisation and the sharing
sweep."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import MODEL_HELP, Subcommands, add_model_device, fail


def cmd_fetch_model(args: argparse.Namespace) -> int:
    """Fetch and convert a model now (e.g. at image build time) so later loads are fast."""
    from ..models import load_model

    model = load_model(args.model, device="cpu")
    cfg = model.config
    print(f"{model.name}: {cfg.model_type}, {cfg.num_hidden_layers} layers, "
          f"{sum(p.numel() for p in model.model.parameters()):,} parameters, weights sha256 {model.fingerprint[:16]}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Throughput against transformers' generate and generate_batch (or memory utilisation, the sharing
    sweep, many sessions), as a markdown table."""
    from ..bench.throughput import CASES, PEER_NAMES, report, run_bench
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
    if args.monitor:
        from ..bench import monitor as bench_monitor

        cases = set((args.cases or "live,memory,scrape").split(","))
        if unknown := cases - {"live", "memory", "scrape"}:
            return fail(f"--cases: {sorted(unknown)[0]!r} is no monitor case; they are live, memory, scrape")
        events = _positive_ints(args.sizes or "10000000", "--sizes")
        if events is None:
            return 2
        live = bench_monitor.run_live(duration=args.duration, say=say) if "live" in cases else None
        memory = bench_monitor.run_memory(events[0], say=say) if "memory" in cases else None
        scrapes = bench_monitor.run_scrape(say=say) if "scrape" in cases else []
        return _write(bench_monitor.report(live, memory, scrapes), args.out)
    if args.repeat < 1:
        return fail(f"--repeat must be >= 1, got {args.repeat}")
    if args.sessions is not None and args.sessions < 1:
        return fail(f"--sessions must be >= 1, got {args.sessions}")
    only = {c.strip() for c in args.cases.split(",") if c.strip()} if args.cases else None
    if only and not any(case.startswith(o) for o in only for case in CASES):
        return fail(f"--cases {args.cases!r} matches no case; the cases are {', '.join(CASES)}")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()] if args.peers else None
    unknown = [p for p in peers or () if p not in PEER_NAMES]
    if unknown:
        return fail(f"--peers: no peer {unknown[0]!r}; the peers are {', '.join(PEER_NAMES)}")
    if args.sharing_sweep:
        from ..bench.sharing import NEW, PRIVATE

        if min(lengths) <= PRIVATE + NEW:
            return fail(f"--lengths: a sequence holds a shared prefix, {PRIVATE} private and {NEW} generated "
                        f"tokens, so every length must exceed {PRIVATE + NEW}, got {args.lengths!r}")
    if args.whatif is not None:
        from ..bench.whatif import default_traces, run_whatif_bench, whatif_report

        paths = [Path(p) for p in args.whatif] or default_traces()
        missing = [p for p in paths if not p.is_file()]
        if not paths or missing:
            return fail(f"--whatif: no trace {missing[0] if missing else 'given'} (name Mooncake trace files; the "
                        "default reads ../shared/traces/*.jsonl beside the repository)")
        return _write(whatif_report(run_whatif_bench(paths, progress=say)), args.out)
    if args.capture_live:
        from ..bench.capture_import import live_report, run_live_bench

        return _write(live_report(run_live_bench(duration=args.duration, progress=say)), args.out)
    if args.capture_explain:
        from ..bench.capture_import import explain_report, run_explain_bench

        events = _positive_ints(args.sizes or "10000000", "--sizes")
        if events is None:
            return 2
        return _write(explain_report(run_explain_bench(events, progress=say)), args.out)
    if args.capture_import:
        from ..bench.capture_import import capture_report, run_capture_bench

        events = _positive_ints(args.sizes or "1000000", "--sizes")
        if events is None:
            return 2
        return _write(capture_report(run_capture_bench(events, progress=say)), args.out)
    model = load_model(args.model, device=args.device)
    if args.memory:
        from ..bench.memory import memory_report, run_memory_bench

        return _write(memory_report(model, run_memory_bench(model, sizes, progress=say)), args.out)
    if args.serve:
        from ..bench.serve import run_serve_bench, serve_report

        results = run_serve_bench(model, args.model, args.device, sizes, args.new_tokens, only, progress=say)
        return _write(serve_report(model, results, args.new_tokens), args.out)
    if args.sharing_sweep:
        from ..bench.sharing import sweep, sweep_report

        points = [p for n in sizes for p in sweep(model, tuple(lengths), n, args.repeat, progress=say)]
        return _write(sweep_report(model, points, args.repeat), args.out)
    if args.tiers:
        from ..bench.tiers import run_tiers_bench, tiers_report

        results = run_tiers_bench(model, sizes, args.new_tokens, args.repeat, progress=say)
        return _write(tiers_report(model, results, args.repeat), args.out)
    if args.sessions:
        from ..bench.sessions import run_sessions, sessions_report

        return _write(sessions_report(model, run_sessions(model, args.sessions, args.repeat, progress=say)), args.out)
    results = run_bench(model, sizes, args.new_tokens, progress=say, repeat=args.repeat, only=only,
                        peers=[PEER_NAMES[p] for p in peers] if peers else None)
    return _write(report(model, results, sizes, args.new_tokens, args.repeat), args.out)


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


def add_fetch_model(sub: Subcommands) -> None:
    fetch = sub.add_parser("fetch-model", help="download and convert a model into the kvviz cache")
    fetch.add_argument("model", nargs="?", default="smollm2", help=MODEL_HELP)
    fetch.set_defaults(func=cmd_fetch_model)


def add_bench(sub: Subcommands) -> None:
    bench = sub.add_parser("bench", help="throughput against transformers generate and generate_batch")
    add_model_device(bench)
    bench.add_argument("--sizes", help="numbers of requests, comma-separated (default 8,32; --memory and --serve "
                                       "32; --sharing-sweep 8)")
    bench.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    bench.add_argument("--repeat", type=int, default=1,
                       help="run every peer this many times, interleaved, and report medians (default 1)")
    bench.add_argument("--cases", help="only these cases, comma-separated: uniform, mixed, shared-system")
    bench.add_argument("--peers", help="only these peers, comma-separated: fast, fast-one-step, inspect, oracle, "
                                       "recorder, generate, generate_batch, transformers, llama-cpp-python, "
                                       "llama.cpp, llama.cpp-oracle (default: all)")
    what = bench.add_mutually_exclusive_group()
    what.add_argument("--sessions", type=int, metavar="N",
                      help="instead: N sessions recording scenarios at once vs one after another (many users)")
    what.add_argument("--memory", action="store_true",
                      help="instead: memory utilisation, the paged pool against a contiguous allocator")
    what.add_argument("--sharing-sweep", action="store_true",
                      help="instead: prefix caching on and off at each of --lengths tokens")
    what.add_argument("--capture-import", action="store_true",
                      help="instead: import speed and peak memory of synthetic captures of --sizes block events "
                           "(default 1000000), JSONL and Parquet dataset")
    what.add_argument("--capture-explain", action="store_true",
                      help="instead: explain's speed and peak memory over synthetic captures of --sizes block events "
                           "(default 10000000), each imported first")
    what.add_argument("--capture-live", action="store_true",
                      help="instead: can one capture-vllm process keep up with two publishers at 10,000 batches/s "
                           "each (for --duration seconds)?")
    what.add_argument("--monitor", action="store_true",
                      help="instead: kvviz monitor against its targets (--cases live,memory,scrape): two publishers at "
                           "10,000 batches/s each for --duration s, a capture of --sizes block events (default "
                           "10,000,000) replayed at full speed, and a scrape after 1,000 tenants")
    what.add_argument("--whatif", nargs="*", metavar="TRACE.jsonl",
                      help="replaying Mooncake traces under other caches: the one-pass LRU curve, each policy's "
                           "exact replays (default traces: ../shared/traces/*.jsonl)")
    what.add_argument("--tiers", action="store_true",
                      help="instead: the engine with an unused host tier and disaggregated against plain")
    what.add_argument("--serve", action="store_true",
                      help="instead: kvviz serve under one streaming client per request against the fast path")
    bench.add_argument("--lengths", default="128,512,2048",
                       help="sequence lengths of --sharing-sweep, comma-separated (default 128,512,2048)")
    bench.add_argument("--duration", type=float, default=60.0, help="seconds of --capture-live (default 60)")
    bench.add_argument("--out", metavar="FILE.md", help="also write the markdown table to this file")
    bench.set_defaults(func=cmd_bench)
