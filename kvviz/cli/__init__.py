"""`python -m kvviz`: the command line for scripts and CI."""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..errors import KvvizError
from .audit_timing import add_audit_timing
from .capture import cmd_capture_vllm
from .catalogue import cmd_audit, cmd_scenarios
from .common import fail
from .models import cmd_bench, cmd_fetch_model
from .run import cmd_run
from .serve import add_serve
from .store import cmd_explain, cmd_export, cmd_import, cmd_replay, cmd_runs, cmd_sql

MODEL_HELP = "smollm2 (default), tiny-llama, tiny-gpt2 or a path"
DEVICE_HELP = "auto (default), cpu, cuda or cuda:N"


def _add_model_device(p: argparse.ArgumentParser) -> None:
    """--model and --device, the same for every command that loads a model."""
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--device", default="auto", help=DEVICE_HELP)


def _add_db(p: argparse.ArgumentParser, what: str = "run store") -> None:
    """--db, the run store every command that reads or writes runs shares with the UI."""
    p.add_argument("--db", help=f"{what} (default $KVVIZ_DB, else runs/kvviz.duckdb)")


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its flags in one place, in the order `--help` lists them; each dispatches
    to a cmd_* function, whose heavy imports wait until it runs so `--help` stays fast."""
    p = argparse.ArgumentParser(prog="python -m kvviz", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvviz {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-model", help="download and convert a model into the kvviz cache")
    fetch.add_argument("model", nargs="?", default="smollm2", help=MODEL_HELP)
    fetch.set_defaults(func=cmd_fetch_model)

    run = sub.add_parser("run", help="run a workload through the engine")
    run.add_argument("--workload", metavar="FILE.json", help="requests, engine settings and seed")
    run.add_argument("--scenario", metavar="NAME", help="a catalogue scenario (python -m kvviz scenarios)")
    run.add_argument("--fault", metavar="NAME", help="inject a fault from the catalogue (docs/faults.md)")
    run.add_argument("--fault-steps", metavar="1,2", help="strike only at these steps")
    run.add_argument("--fault-requests", metavar="A,B", help="strike only these requests (page tables, masks)")
    run.add_argument("--fault-layers", metavar="0,3", help="strike only these layers (attention arithmetic)")
    run.add_argument("--fail-on-leak", action="store_true", help="exit 1 when the oracles report findings")
    _add_model_device(run)
    run.add_argument("--backend", choices=["kvviz", "transformers"],
                     help="whose engine runs the workload: kvviz's own, or Hugging Face transformers' continuous "
                          "batching, observed (overrides the workload's engine.backend)")
    run.add_argument("--kernel", choices=["eager_paged", "sdpa_paged"],
                     help="the transformers backend's paged attention kernel: eager_paged returns its weights; "
                          "sdpa_paged returns none, so kvviz recomputes them and checks the kernel's output "
                          "(overrides the workload's engine.kernel)")
    run.add_argument("--isolation", choices=["paged", "masked"], help="override the workload's isolation mechanism")
    run.add_argument("--compute", choices=["inspect", "fast"], help="override the workload's compute path")
    run.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    run.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    run.add_argument("--kv-events", metavar="FILE.jsonl",
                     help="also write the KV events a vLLM server would publish for this run, as a capture file "
                          "(python -m kvviz import reads it)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_db(run, "run store to record into")
    run.add_argument("--attention", choices=["default", "all", "none"], default="default",
                     help="attention rows to record: head mean of every layer plus all heads of the first, middle "
                          "and last layer and of any layer at a step where a leak was seen (default), every head "
                          "of every layer, or none")
    run.add_argument("--attention-layers", metavar="0,15", help="layers recorded with all heads (default mode)")
    run.add_argument("--attention-steps", metavar="0,1", help="record attention at these steps only")
    run.add_argument("--attention-requests", metavar="A,B", help="record attention of these requests only")
    run.set_defaults(func=cmd_run)

    runs = sub.add_parser("runs", help="the runs in the run store, newest first")
    _add_db(runs)
    runs.add_argument("--format", choices=["table", "csv", "json"], default="table")
    runs.add_argument("--limit", type=int, default=20, help="most runs listed (default 20)")
    runs.set_defaults(func=cmd_runs)

    sql = sub.add_parser("sql", help="a read-only SQL query over the run store")
    sql.add_argument("query", help='e.g. "SELECT run_id, status, fault, max_foreign_mass FROM runs"')
    _add_db(sql)
    sql.add_argument("--format", choices=["table", "csv", "json"], default="table")
    sql.add_argument("--limit", type=int, default=10_000, help="most rows returned (default 10000)")
    sql.set_defaults(func=cmd_sql)

    rep = sub.add_parser("replay", help="a recorded run at one step, or re-executed and verified")
    rep.add_argument("run_id")
    rep.add_argument("--step", type=int, default=0, help="the step to show (default 0)")
    rep.add_argument("--verify", action="store_true", help="re-execute and compare tokens and leak metrics")
    _add_db(rep)
    rep.add_argument("--device", default="auto", help=DEVICE_HELP)
    rep.set_defaults(func=cmd_replay)

    exp = sub.add_parser("export", help="a recorded run as a kvviz trace or Chrome trace JSON (Perfetto)")
    exp.add_argument("run_id")
    exp.add_argument("--format", choices=["kvviz", "chrome"], default="kvviz")
    exp.add_argument("--out", help="output file (default RUN_ID.zip or RUN_ID.json)")
    _add_db(exp)
    exp.set_defaults(func=cmd_export)

    cap = sub.add_parser("capture-vllm", help="record vLLM/SGLang KV-cache events from the ZMQ publishers of a fleet")
    cap.add_argument("--endpoint", required=True, action="append", metavar="[NAME=]URL",
                     help="a replica's publisher, e.g. pod-a=tcp://HOST:5557; repeat it for every replica "
                          "(default names replica-0, replica-1, ...)")
    cap.add_argument("--replay", action="append", metavar="[NAME=]URL",
                     help="a replica's replay endpoint, e.g. pod-a=tcp://HOST:5558 (paired by name, or by order "
                          "when unnamed): its buffered history is fetched first and again after a restart")
    cap.add_argument("--topic", default="", help="topic to subscribe to (default: all)")
    cap.add_argument("--duration", type=float, help="stop after this many seconds (default: Ctrl-C or SIGTERM)")
    cap.add_argument("--out", required=True,
                     help="a new folder for the Parquet dataset (DIR/replica=NAME/part-NNNNN.parquet), or FILE.jsonl")
    cap.add_argument("--rotate-rows", type=int, default=1_000_000,
                     help="rows per Parquet part before the next one starts (default 1,000,000)")
    cap.set_defaults(func=cmd_capture_vllm)

    imp = sub.add_parser("import", help="import a kvviz trace or a vLLM/SGLang KV-event capture into the run store")
    imp.add_argument("file", metavar="PATH", help="a kvviz trace (.zip), a capture (.jsonl), a capture dataset "
                                                 "folder or one of its .parquet parts")
    imp.add_argument("--in-place", action="store_true",
                     help="a capture dataset folder: register it where it lies (kv_events reads its files; nothing "
                          "is copied, and moving it later marks the run failed)")
    _add_db(imp)
    imp.set_defaults(func=cmd_import)

    expl = sub.add_parser("explain", help="why each prefix-cache lookup of a run (or capture) stopped where it did")
    expl.add_argument("run_id")
    expl.add_argument("--request", metavar="ID", help="only this request (a capture's: its session id, or chain-HASH)")
    expl.add_argument("--json", action="store_true", help="one JSON object as the last line")
    expl.add_argument("--summary", action="store_true", help="only how many lookups stopped for each reason")
    _add_db(expl)
    expl.set_defaults(func=cmd_explain)

    scen = sub.add_parser("scenarios", help="list the replayable scenarios")
    scen.set_defaults(func=cmd_scenarios)

    aud = sub.add_parser("audit", help="the detection matrix: every fault x its workload, plus clean controls")
    aud.add_argument("--model", default="all", help="all (default: tiny-llama, tiny-gpt2 and smollm2), or models "
                     "separated by commas: " + MODEL_HELP.replace(" (default)", ""))
    aud.add_argument("--device", default="auto", help=DEVICE_HELP)
    aud.set_defaults(func=cmd_audit)

    bench = sub.add_parser("bench", help="throughput against transformers generate and generate_batch")
    _add_model_device(bench)
    bench.add_argument("--sizes", help="numbers of requests, comma-separated (default 8,32; --memory and --serve "
                                       "32; --sharing-sweep 8)")
    bench.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    bench.add_argument("--repeat", type=int, default=1,
                       help="run every peer this many times, interleaved, and report medians (default 1)")
    bench.add_argument("--cases", help="only these cases, comma-separated: uniform, mixed, shared-system")
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
    what.add_argument("--capture-live", action="store_true",
                      help="instead: can one capture-vllm process keep up with two publishers at 10,000 batches/s "
                           "each (for --duration seconds)?")
    what.add_argument("--tiers", action="store_true",
                      help="instead: the engine with an unused host tier and disaggregated against plain")
    what.add_argument("--serve", action="store_true",
                      help="instead: kvviz serve under one streaming client per request against the fast path")
    bench.add_argument("--lengths", default="128,512,2048",
                       help="sequence lengths of --sharing-sweep, comma-separated (default 128,512,2048)")
    bench.add_argument("--duration", type=float, default=60.0, help="seconds of --capture-live (default 60)")
    bench.add_argument("--out", metavar="FILE.md", help="also write the markdown table to this file")
    bench.set_defaults(func=cmd_bench)

    add_serve(sub, _add_model_device)
    add_audit_timing(sub, _add_db)
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
