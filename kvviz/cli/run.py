"""`kvviz run`, and the helpers that turn its flags into the workload's engine settings, the fault's
scope and the attention the recorder keeps; heavy modules load only when a run starts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from .common import Subcommands, add_db, add_model_device, finding_text

if TYPE_CHECKING:
    from ..capture.emit import KVEventEmitter
    from ..catalogue.faults import Scope
    from ..catalogue.scenarios import Scenario
    from ..engine import StepRecord
    from ..engine.workload import Workload
    from ..models import LoadedModel
    from ..oracle.probe import LastPromptTokenProbe
    from ..store.attention import AttentionSelection


def cmd_run(args: argparse.Namespace) -> int:
    """Run a workload or scenario with both oracles; a table, or JSON as the last line with --json.
    Exit 1 with --fail-on-leak when the run has findings, 2 on bad input."""
    from tqdm import tqdm

    from ..catalogue.scenarios import scenario
    from ..engine import Engine
    from ..engine.workload import Workload, WorkloadError
    from ..models import load_model
    from ..models.queue import waiting_message

    probe, note = None, None
    if (args.workload is None) == (args.scenario is None):
        raise WorkloadError("give exactly one of --workload FILE or --scenario NAME")
    sc = scenario(args.scenario) if args.scenario else None
    fault = args.fault if args.fault is not None else (sc.fault if sc else None)
    as_shipped = _scenario_as_shipped(sc, args)
    if as_shipped is not None and args.fault is None:
        fault = None
    if fault is None and (args.fault_steps or args.fault_requests or args.fault_layers):
        raise WorkloadError("--fault-steps, --fault-requests and --fault-layers confine a fault: give --fault")
    given = Workload.from_file(args.workload) if args.workload else None  # a bad file is refused before loading
    if args.kv_events and not Path(args.kv_events).resolve().parent.is_dir():
        raise WorkloadError(f"--kv-events {args.kv_events}: no folder {Path(args.kv_events).parent}")
    model = load_model(args.model, device=args.device)
    wl = Workload.from_dict(sc.build(model.tokenizer)) if sc else given
    if (as_shipped is not None and args.backend == "transformers" and args.isolation is None
            and wl.engine.isolation != "paged"):
        args = argparse.Namespace(**{**vars(args), "isolation": "paged"})
        as_shipped.append(f"its isolation {wl.engine.isolation!r} is kvviz's engine's; transformers isolates "
                          "requests by its own paged attention")
    wl = _with_overrides(wl, args)
    total = sum(r.max_new_tokens for r in wl.requests)
    with tqdm(total=total, unit="tok", desc="generating", file=sys.stderr, disable=args.quiet) as bar, \
            ExitStack() as stack:
        said: list[int | None] = [None]  # the place in line last printed, while waiting
        emitter = _kv_events(args.kv_events, wl, stack)

        def progress(rec: StepRecord) -> None:
            if said[0] is not None:  # the rate counts from the run's turn on the model, not from the wait
                said[0] = None
                bar.reset(total)
            bar.update(len(rec.sampled))
            if emitter is not None:
                emitter.on_step(rec)

        def waiting(ahead: int) -> None:  # another run (this machine's app, another script) has the model
            if ahead != said[0]:
                bar.write(f"kvviz: {waiting_message(ahead)}", file=sys.stderr)
            said[0] = ahead

        def comparing(done: int, n: int, request: str) -> None:  # the reference oracle: seconds per request
            bar.set_description_str(f"comparing {request} with itself run alone ({done + 1}/{n})")
        if wl.engine.compute == "fast" and fault is None and wl.engine.backend == "kvviz":
            if args.fail_on_leak:
                raise WorkloadError("--fail-on-leak needs the leak oracle, which reads attention weights that "
                                    "--compute fast does not compute; use --compute inspect")
            summary = Engine(model, wl.engine).run(wl, on_step=progress, on_wait=waiting).summary()
            summary.update(fault=None, leak=None, entropy=None, divergence=None, findings=None, cross_tenant=None,
                           db=None)
            note = "--compute fast runs are not judged or recorded (no attention weights); --compute inspect is"
        else:
            if wl.engine.compute == "fast" and wl.engine.backend != "kvviz":
                note = (f"--compute fast is kvviz's engine's; the {wl.engine.backend} backend runs its paged attention "
                        "with weights, judged and recorded")
            elif wl.engine.compute == "fast":
                note = "a run with a fault is judged by the leak oracle, so it runs --compute inspect"
            probe = _seed_probe(model, sc, wl)
            summary = _recorded_run(args, model, wl, fault, progress, waiting, comparing, probe)
    shipped = (f"scenario {sc.name} on {args.backend}: its requests run through {args.backend}'s code as shipped ("
               + "; ".join(as_shipped) + "), as the app's Scenarios page runs them") if as_shipped else None
    for said in [shipped, note, *(summary.get("notes") or [])]:
        if said is not None:
            print(f"kvviz: note: {said}", file=sys.stderr)
    summary = {**summary, "scenario": args.scenario, "model": {"name": model.name, "fingerprint": model.fingerprint}}
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        _print_run(summary)
        if probe is not None and probe.weights:
            print(f"{probe.request}'s last prompt token over the shared buffer (mean of layers and heads):")
            print(probe.table(model.tokenizer))
    return 1 if args.fail_on_leak and summary["findings"] else 0


def _scenario_as_shipped(sc: Scenario | None, args: argparse.Namespace) -> list[str] | None:
    """A catalogue scenario sent to another engine with --backend: what of it is kvviz's engine's and left out
    (its fault; for transformers its masked isolation) so that its requests run through that engine unchanged;
    None for anything else. A --fault given on the command line is kept, and refused by the backend."""
    if sc is None or args.backend not in ("transformers", "llama.cpp"):
        return None
    left = []
    if sc.fault is not None and args.fault is None:
        left.append(f"its fault {sc.fault!r} strikes kvviz's engine only and is left out")
    return left


def _kv_events(path: str | None, wl: Workload, stack: ExitStack) -> KVEventEmitter | None:
    """--kv-events FILE: what a vLLM server would have published for this run, as a capture file."""
    if path is None:
        return None
    from ..capture.capture_file import DEFAULT_REPLICA, CaptureWriter, Message
    from ..capture.emit import KVEventEmitter

    writer = CaptureWriter(path, {DEFAULT_REPLICA: "kvviz run"})
    stack.callback(writer.close)
    return KVEventEmitter(wl.engine.block_size, lambda seq, topic, payload: writer.add(
        Message(DEFAULT_REPLICA, 0, seq, topic.decode(), payload)))


def _recorded_run(args: argparse.Namespace, model: LoadedModel, wl: Workload, fault: str | None,
                  progress: Callable[[StepRecord], None], waiting: Callable[[int], None],
                  comparing: Callable[[int, int, str], None], probe: LastPromptTokenProbe | None) -> dict:
    """A checked run recorded step by step into --db; a run that dies is marked failed there."""
    from ..runners.recorded import record_run

    run = record_run(args.store, model, wl, fault, scenario=args.scenario, scope=_fault_scope(args),
                     selection=_attention_selection(args), on_step=lambda r, _oracle: progress(r),
                     probes=[probe] if probe else [], on_wait=waiting, on_reference=comparing)
    return {**run.summary(), "db": str(args.store.path)}


def _with_overrides(wl: Workload, args: argparse.Namespace) -> Workload:
    """The workload with --backend, --kernel, --isolation, --compute and --no-prefix-caching applied, validated as
    a file would be."""
    from ..engine import EngineConfig

    names = ("backend", "kernel", "isolation", "compute")
    changes = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.no_prefix_caching:
        changes["prefix_caching"] = False
    return dataclasses.replace(wl, engine=EngineConfig.from_dict({**wl.engine.to_dict(), **changes}))


def _fault_scope(args: argparse.Namespace) -> Scope | None:
    """--fault-steps/--fault-requests/--fault-layers as a Scope, or None for the fault's own."""
    from ..catalogue.faults import Scope

    return Scope.parse(args.fault_steps, args.fault_requests, args.fault_layers,
                       names=("--fault-steps", "--fault-layers"))


def _attention_selection(args: argparse.Namespace) -> AttentionSelection:
    """--attention and its filters: which attention rows the recorder keeps (the store's biggest table)."""
    from ..catalogue.faults import int_set, name_set
    from ..store.attention import AttentionSelection

    return AttentionSelection(args.attention, int_set(args.attention_layers, "--attention-layers"),
                              int_set(args.attention_steps, "--attention-steps"), name_set(args.attention_requests))


def _seed_probe(model: LoadedModel, sc: Scenario | None, wl: Workload) -> LastPromptTokenProbe | None:
    """For the seed's scenarios, watch request A's last prompt token (the seed's table)."""
    from ..oracle.probe import LastPromptTokenProbe

    if sc is None or sc.name not in ("passphrase", "boundary", "global"):
        return None
    return LastPromptTokenProbe("A", len(model.tokenizer(wl.requests[0].prompt).input_ids) - 1)


def _print_run(s: dict) -> None:
    """A run summary as a few lines for a person; scripts use --json instead."""
    e, st = s["engine"], s["stats"]
    backend = e["backend"] + (f" ({e['kernel']})" if e["backend"] != "kvviz" else "")
    print(f"run {s['run_id']}  model {s['model']['name']}  backend {backend}  isolation {e['isolation']}  "
          f"compute {e['compute']}  blocks {e['num_blocks']}x{e['block_size']}  fault {s['fault'] or 'none'}")
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
    print("positional entropy, nats (mean over queries, layers and heads): "
          + ", ".join(f"{req} {h:.3f}" for req, h in s["entropy"].items()))
    listed = [f for f in s["findings"] if f["block"] is None]  # cross-tenant reads: one per block, said below
    for f in listed[:20]:
        print(f"  finding {finding_text(**f)}")
    if len(listed) > 20:
        print(f"  ... {len(listed) - 20} more findings (use --json for all)")
    if s["cross_tenant"]:
        n = len(s["findings"]) - len(listed)
        print(f"{s['cross_tenant']}: the same content, so no attention leak, but a trust boundary crossed "
              f"({n} cross_tenant finding{'s' if n != 1 else ''}, one per block and run of steps; --json lists them)")


def add_run(sub: Subcommands) -> None:
    run = sub.add_parser("run", help="run a workload through the engine")
    run.add_argument("--workload", metavar="FILE.json", help="requests, engine settings and seed")
    run.add_argument("--scenario", metavar="NAME", help="a catalogue scenario (python -m kvviz scenarios)")
    run.add_argument("--fault", metavar="NAME", help="inject a fault from the catalogue (docs/faults.md); with "
                     "--backend llama.cpp, one of its API misuses (docs/engines.md)")
    run.add_argument("--fault-steps", metavar="1,2", help="strike only at these steps")
    run.add_argument("--fault-requests", metavar="A,B", help="strike only these requests (page tables, masks)")
    run.add_argument("--fault-layers", metavar="0,3", help="strike only these layers (attention arithmetic)")
    run.add_argument("--fail-on-leak", action="store_true", help="exit 1 when the oracles report findings")
    add_model_device(run)
    run.add_argument("--backend", choices=["kvviz", "transformers", "llama.cpp"],
                     help="whose engine runs the workload: kvviz's own, Hugging Face transformers' continuous "
                          "batching or llama.cpp (a GGUF model: smollm2, tiny-llama or a .gguf path), observed "
                          "(overrides the workload's engine.backend)")
    run.add_argument("--kernel", choices=["eager_paged", "sdpa_paged", "flash_attn"],
                     help="the other engine's attention kernel: eager_paged (both) returns its weights; "
                          "transformers' sdpa_paged and llama.cpp's flash_attn return none, so kvviz recomputes "
                          "them and checks the kernel's output (overrides the workload's engine.kernel)")
    run.add_argument("--isolation", choices=["paged", "masked", "streams"],
                     help="override the workload's isolation mechanism (streams: one KV stream per sequence, "
                          "llama.cpp's kv_unified off)")
    run.add_argument("--compute", choices=["inspect", "fast"], help="override the workload's compute path")
    run.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    run.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    run.add_argument("--kv-events", metavar="FILE.jsonl",
                     help="also write the KV events a vLLM server would publish for this run, as a capture file "
                          "(python -m kvviz import reads it)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    add_db(run, "run store to record into")
    run.add_argument("--attention", choices=["default", "all", "none"], default="default",
                     help="attention rows to record: head mean of every layer plus all heads of the first, middle "
                          "and last layer and of any layer at a step where a leak was seen (default), every head "
                          "of every layer, or none")
    run.add_argument("--attention-layers", metavar="0,15", help="layers recorded with all heads (default mode)")
    run.add_argument("--attention-steps", metavar="0,1", help="record attention at these steps only")
    run.add_argument("--attention-requests", metavar="A,B", help="record attention of these requests only")
    run.set_defaults(func=cmd_run)
