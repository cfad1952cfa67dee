"""`python -m kvviz`: the command line for scripts and CI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from tqdm import tqdm

from . import __version__

DEFAULT_DB = "runs/kvviz.duckdb"


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
    """Run a workload or scenario with both oracles; a table, or JSON as the last line with --json.
    Exit 1 with --fail-on-leak when the run has findings, 2 on bad input."""
    from .checked_run import FaultMismatch
    from .engine import ConfigError, Engine, EngineError
    from .faults import UnknownFault
    from .models import ModelError, load_model
    from .scenarios import UnknownScenario, scenario
    from .store import StoreError
    from .workload import Workload, WorkloadError

    probe = None
    try:
        if (args.workload is None) == (args.scenario is None):
            raise WorkloadError("give exactly one of --workload FILE or --scenario NAME")
        sc = scenario(args.scenario) if args.scenario else None
        fault = args.fault if args.fault is not None else (sc.fault if sc else None)
        m = load_model(args.model, device=args.device)
        wl = Workload.from_dict(sc.build(m.tokenizer)) if sc else Workload.from_file(args.workload)
        wl = _with_overrides(wl, args)
        total = sum(r.max_new_tokens for r in wl.requests)
        with tqdm(total=total, unit="tok", desc="generating", file=sys.stderr, disable=args.quiet) as bar:
            def progress(rec):
                bar.update(len(rec.sampled))
            if wl.engine.compute == "fast" and fault is None:
                summary = Engine(m, wl.engine).run(wl, on_step=progress).summary()
                summary.update(fault=None, leak=None, divergence=None, findings=None)
            else:
                probe = _seed_probe(m, sc, wl)
                summary = _recorded_run(args, m, wl, fault, progress, probe)
    except (WorkloadError, ConfigError, ModelError, EngineError, UnknownFault, UnknownScenario, FaultMismatch,
            StoreError) as e:
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 2
    summary = {**summary, "scenario": args.scenario, "model": {"name": m.name, "fingerprint": m.fingerprint}}
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        _print_run(summary)
        if probe is not None and probe.weights:
            print(f"{probe.request}'s last prompt token over the shared buffer (mean of layers and heads):")
            print(probe.table(m.tokenizer))
    return 1 if args.fail_on_leak and summary["findings"] else 0


def _recorded_run(args, m, wl, fault, progress, probe) -> dict:
    """A checked run recorded step by step into --db; a run that dies is marked failed there."""
    from .recorded import record_run

    run = record_run(args.db, m, wl, fault, scenario=args.scenario, scope=_fault_scope(args),
                     selection=_attention_selection(args), on_step=lambda r, _oracle: progress(r),
                     probes=[probe] if probe else [])
    return {**run.summary(), "db": str(args.db)}


def _int_set(text: str | None, flag: str) -> frozenset[int] | None:
    """A comma-separated list of integers from the command line (None when the flag is absent)."""
    from .faults import int_set
    from .workload import WorkloadError

    try:
        return int_set(text, flag)
    except ValueError as e:
        raise WorkloadError(str(e)) from None


def _name_set(text: str | None) -> frozenset[str] | None:
    from .faults import name_set

    return name_set(text)


def _fault_scope(args):
    """--fault-steps/--fault-requests/--fault-layers as a Scope, or None for the fault's own."""
    from .faults import Scope
    from .workload import WorkloadError

    try:
        return Scope.parse(args.fault_steps, args.fault_requests, args.fault_layers,
                           names=("--fault-steps", "--fault-layers"))
    except ValueError as e:
        raise WorkloadError(str(e)) from None


def cmd_replay(args: argparse.Namespace) -> int:
    """Show a recorded run at one step, or re-execute it and verify it (exit 1 on a mismatch)."""
    import duckdb

    from .store import StoreError
    from .store.replay import load_run, state_at, verify

    try:
        con = duckdb.connect(args.db, read_only=True)
    except duckdb.Error as e:
        print(f"kvviz: error: cannot open {args.db}: {e}", file=sys.stderr)
        return 2
    try:
        rec = load_run(con, args.run_id)
        if args.verify:
            problems = verify(con, args.run_id, device=args.device)
            for p in problems:
                print(f"MISMATCH {p}")
            print(f"run {args.run_id}: " + ("replays identically" if not problems else f"{len(problems)} mismatches"))
            return 1 if problems else 0
        st = state_at(con, args.run_id, args.step)
    except StoreError as e:
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 2
    print(f"run {rec.run_id} ({rec.status}), model {rec.model}, fault {rec.fault or 'none'}: step {st.step}")
    for req, start, n, tok in st.work:
        sampled = f", sampled {tok}" if tok is not None else ""
        print(f"  {req:>10} computed positions {start}..{start + n - 1}{sampled}")
    for req, table in st.page_tables.items():
        print(f"  page table {req:>10}: {table}")
    used = sum(1 for b in st.blocks if b[2] == "used")
    cached = sum(1 for b in st.blocks if b[2] == "cached")
    print(f"  blocks: {used} used, {cached} cached, {len(st.blocks) - used - cached} free; "
          f"refcounts {[b[1] for b in st.blocks if b[1]]}")
    for req, mass in st.leak.items():
        print(f"  {req:>10} max foreign mass {mass:.4f}")
    for kind, req, layer, head, pos, src, mass in st.findings:
        print(f"  finding {kind} {req} layer {layer} head {head} pos {pos}" + (f" from {src}" if src else "") +
              f" mass {mass:.4f}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A recorded run as a kvviz trace (zip of Parquet) or Chrome trace JSON for Perfetto."""
    import duckdb

    from .store import StoreError
    from .store.chrome import export_chrome
    from .store.trace import export_run

    out = args.out or f"{args.run_id}.{'zip' if args.format == 'kvviz' else 'json'}"
    try:
        con = duckdb.connect(args.db, read_only=True)
        (export_run if args.format == "kvviz" else export_chrome)(con, args.run_id, out)
    except (duckdb.Error, StoreError) as e:
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Validate and import a kvviz trace or a vLLM/SGLang KV-event capture into --db; a bad file is
    refused whole, with the reason."""
    from .analysis.uploads import REFUSALS, import_file

    try:
        run_id = import_file(args.file, args.db)
    except REFUSALS as e:
        print(f"kvviz: import: {e}", file=sys.stderr)
        return 2
    print(run_id)
    return 0


def cmd_capture_vllm(args: argparse.Namespace) -> int:
    """Subscribe to vLLM's KV-event publisher and write a capture; stop on Ctrl-C or --duration."""
    from .capture.zmq_capture import capture

    def progress(w):
        gaps = f", {len(w.gaps)} gaps in sequence numbers" if w.gaps else ""
        print(f"\rkvviz: {w.count} messages, last seq {w.last}{gaps}", end="", file=sys.stderr, flush=True)

    try:
        w = capture(args.endpoint, args.out, duration=args.duration, replay=args.replay, topic=args.topic,
                    progress=progress)
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        print(f"kvviz: stopped; capture written to {args.out}", file=sys.stderr)
        return 0
    print("", file=sys.stderr)
    for lo, hi in w.gaps:
        print(f"kvviz: lost messages {lo}..{hi} (a gap in sequence numbers)", file=sys.stderr)
    print(f"{args.out}: {w.count} messages")
    return 0


def _attention_selection(args):
    from .store.attention import AttentionSelection

    return AttentionSelection(args.attention, _int_set(args.attention_layers, "--attention-layers"),
                              _int_set(args.attention_steps, "--attention-steps"), _name_set(args.attention_requests))


def cmd_sql(args: argparse.Namespace) -> int:
    """A read-only query over the run store; exit 2 with the reason when it is refused."""
    from .store import SqlError, open_sandbox, run_query

    try:
        con = open_sandbox(args.db)
        res = run_query(con, args.query, max_rows=args.limit)
    except SqlError as e:
        print(f"kvviz: sql: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps([dict(zip(res.columns, r, strict=True)) for r in res.rows], default=str, ensure_ascii=False))
    elif args.format == "csv":
        import csv

        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(res.columns)
        w.writerows(res.rows)
    else:
        widths = [max([len(c)] + [len(str(r[i])) for r in res.rows]) for i, c in enumerate(res.columns)]
        print("  ".join(c.ljust(w) for c, w in zip(res.columns, widths, strict=True)))
        for r in res.rows:
            print("  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)))
    if res.truncated:
        print(f"kvviz: sql: showing the first {args.limit} rows", file=sys.stderr)
    return 0


def _seed_probe(m, sc, wl):
    """For the seed's scenarios, watch request A's last prompt token (the seed's table)."""
    from .oracle.probe import LastPromptTokenProbe

    if sc is None or sc.name not in ("passphrase", "boundary", "global"):
        return None
    return LastPromptTokenProbe("A", len(m.tokenizer(wl.requests[0].prompt).input_ids) - 1)


def cmd_scenarios(args: argparse.Namespace) -> int:
    from .scenarios import SCENARIOS

    for sc in SCENARIOS.values():
        print(f"{sc.name:30} {sc.fault or '(control)':22} {sc.title}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """The detection matrix: every fault against its scenario and the same workload clean."""
    from .audit import audit, format_matrix
    from .models import ModelError, load_model

    try:
        m = load_model(args.model, device=args.device)
    except ModelError as e:
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 2
    rows = audit(m, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_matrix(rows))
    bad = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} rows as expected" + (": " + ", ".join(
        f"{r.scenario}/{r.fault or 'clean'}" for r in bad) + " NOT" if bad else "."))
    return 1 if bad else 0


def _with_overrides(wl, args):
    from .engine import EngineConfig

    changes = {k: getattr(args, k) for k in ("isolation", "compute") if getattr(args, k) is not None}
    if args.no_prefix_caching:
        changes["prefix_caching"] = False
    return dataclasses.replace(wl, engine=EngineConfig.from_dict({**wl.engine.to_dict(), **changes}))


def _print_run(s: dict) -> None:
    e, st = s["engine"], s["stats"]
    print(f"run {s['run_id']}  model {s['model']['name']}  isolation {e['isolation']}  compute {e['compute']}  "
          f"blocks {e['num_blocks']}x{e['block_size']}  fault {s['fault'] or 'none'}")
    for r in s["requests"]:
        print(f"  {r['id']:>10}  {len(r['output_ids']):3d} tok  cached {r['cached_tokens']:4d}  "
              f"{r['finish_reason']:6}  {r['text']!r}")
    print(f"{st['steps']} steps, {st['generated_tokens']} tokens in {st['seconds']:.2f} s "
          f"({st['tokens_per_second']:.1f} tok/s), prefill computed {st['prefill_tokens_computed']} "
          f"of {st['prompt_tokens']} prompt tokens, {st['preemptions']} preemptions")
    if s["leak"] is None:
        print("oracles off (compute fast)")
        return
    lk, dv = s["leak"], s["divergence"]
    print(f"leak: max foreign mass {lk['max_foreign_mass']:.4f}, leak rate {lk['leak_rate']:.4f}, "
          f"weights own/foreign/stale {lk['counts']['own']}/{lk['counts']['foreign']}/{lk['counts']['stale']}; "
          f"{dv['diverged_requests']} requests diverge from running alone (max |logit diff| "
          f"{dv['max_logit_diff']:.2e})")
    for f in s["findings"][:20]:
        src = f" from {f['source_request']}" if f["source_request"] else ""
        print(f"  finding {f['kind']:13} {f['request']:>8} step {f['step']:3d} layer {f['layer']:2d} "
              f"head {f['head']:2d} pos {f['position']:4d}{src}  mass {f['mass']:.4f}")
    if len(s["findings"]) > 20:
        print(f"  ... {len(s['findings']) - 20} more findings (use --json for all)")


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
    run.add_argument("--workload", metavar="FILE.json", help="requests, engine settings and seed")
    run.add_argument("--scenario", metavar="NAME", help="a catalogue scenario (python -m kvviz scenarios)")
    run.add_argument("--fault", metavar="NAME", help="inject a fault from the catalogue (docs/faults.md)")
    run.add_argument("--fault-steps", metavar="1,2", help="strike only at these steps")
    run.add_argument("--fault-requests", metavar="A,B", help="strike only these requests (page tables, masks)")
    run.add_argument("--fault-layers", metavar="0,3", help="strike only these layers (attention arithmetic)")
    run.add_argument("--fail-on-leak", action="store_true", help="exit 1 when the oracles report findings")
    run.add_argument("--model", default="smollm2", help="smollm2 (default), tiny-llama, tiny-gpt2 or a path")
    run.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    run.add_argument("--isolation", choices=["paged", "masked"], help="override the workload's isolation mechanism")
    run.add_argument("--compute", choices=["inspect", "fast"], help="override the workload's compute path")
    run.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    run.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--db", default=str(DEFAULT_DB), help=f"run store to record into (default {DEFAULT_DB})")
    run.add_argument("--attention", choices=["default", "all", "none"], default="default",
                     help="attention rows to record: head mean of every layer plus all heads of the first, middle "
                          "and last layer (default), every head of every layer, or none")
    run.add_argument("--attention-layers", metavar="0,15", help="layers recorded with all heads (default mode)")
    run.add_argument("--attention-steps", metavar="0,1", help="record attention at these steps only")
    run.add_argument("--attention-requests", metavar="A,B", help="record attention of these requests only")
    run.set_defaults(func=cmd_run)

    sql = sub.add_parser("sql", help="a read-only SQL query over the run store")
    sql.add_argument("query", help='e.g. "SELECT run_id, status, fault, max_foreign_mass FROM runs"')
    sql.add_argument("--db", default=str(DEFAULT_DB), help=f"run store (default {DEFAULT_DB})")
    sql.add_argument("--format", choices=["table", "csv", "json"], default="table")
    sql.add_argument("--limit", type=int, default=10_000, help="most rows returned (default 10000)")
    sql.set_defaults(func=cmd_sql)

    rep = sub.add_parser("replay", help="a recorded run at one step, or re-executed and verified")
    rep.add_argument("run_id")
    rep.add_argument("--step", type=int, default=0, help="the step to show (default 0)")
    rep.add_argument("--verify", action="store_true", help="re-execute and compare tokens and leak metrics")
    rep.add_argument("--db", default=str(DEFAULT_DB), help=f"run store (default {DEFAULT_DB})")
    rep.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    rep.set_defaults(func=cmd_replay)

    exp = sub.add_parser("export", help="a recorded run as a kvviz trace or Chrome trace JSON (Perfetto)")
    exp.add_argument("run_id")
    exp.add_argument("--format", choices=["kvviz", "chrome"], default="kvviz")
    exp.add_argument("--out", help="output file (default RUN_ID.zip or RUN_ID.json)")
    exp.add_argument("--db", default=str(DEFAULT_DB), help=f"run store (default {DEFAULT_DB})")
    exp.set_defaults(func=cmd_export)

    cap = sub.add_parser("capture-vllm", help="record vLLM/SGLang KV-cache events from a ZMQ publisher")
    cap.add_argument("--endpoint", required=True, help="the publisher, e.g. tcp://HOST:5557")
    cap.add_argument("--replay", help="the replay endpoint, e.g. tcp://HOST:5558, to fetch buffered history first")
    cap.add_argument("--topic", default="", help="topic to subscribe to (default: all)")
    cap.add_argument("--duration", type=float, help="stop after this many seconds (default: Ctrl-C)")
    cap.add_argument("--out", required=True, help="capture file to write")
    cap.set_defaults(func=cmd_capture_vllm)

    imp = sub.add_parser("import", help="import a kvviz trace or a vLLM KV-event capture into the run store")
    imp.add_argument("file")
    imp.add_argument("--db", default=str(DEFAULT_DB), help=f"run store (default {DEFAULT_DB})")
    imp.set_defaults(func=cmd_import)

    scen = sub.add_parser("scenarios", help="list the replayable scenarios")
    scen.set_defaults(func=cmd_scenarios)

    aud = sub.add_parser("audit", help="the detection matrix: every fault x its workload, plus clean controls")
    aud.add_argument("--model", default="smollm2", help="smollm2 (default), tiny-llama, tiny-gpt2 or a path")
    aud.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    aud.set_defaults(func=cmd_audit)

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
