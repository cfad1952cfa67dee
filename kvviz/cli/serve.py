"""`kvviz serve`: the engine behind an OpenAI-compatible HTTP server (FastAPI on uvicorn), so real
clients, load generators and timing audits can use it; the web stack loads only when it starts."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from .common import Subcommands, add_model_device, fail


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; requests in flight finish first."""
    import uvicorn

    from ..catalogue.faults import FAULTS
    from ..engine import ConfigError, EngineConfig
    from ..engine.workload import Workload
    from ..errors import WorkloadError
    from ..models import load_model
    from ..runners.checked import check_fault
    from ..serve.app import ServeOptions, create_app
    from ..serve.worker import EngineWorker

    if not 0 < args.port < 65536:
        return fail(f"--port must be 1-65535, got {args.port}")
    if args.max_in_flight < 1:
        return fail(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    oracle = args.oracle or args.record or args.fault is not None  # a fault is served to be seen, a recording judged
    template = None
    if args.chat_template:
        path = Path(args.chat_template)
        if not path.is_file():
            return fail(f"--chat-template {path}: no such file")
        template = path.read_text(encoding="utf-8")
    needs = FAULTS[args.fault].isolation if args.fault in FAULTS else None
    isolation = args.isolation or needs or "paged"  # a fault of the mask is served on the masked mechanism
    try:
        config = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                              max_batch_tokens=args.max_batch_tokens, isolation=isolation,
                              compute="inspect" if oracle else "fast", prefix_caching=args.cache_sharing != "off",
                              schedule=args.schedule)
    except ConfigError as e:  # "num_blocks: must be ..." said as the flag that set it
        field, _, why = str(e).partition(":")
        return fail(f"--{field.replace('_', '-')}:{why}")
    try:
        check_fault(args.fault, Workload([], config))
    except WorkloadError as e:
        return fail(f"--fault {args.fault}: {e}".replace("this workload uses isolation", "--isolation is"))
    publisher = None
    if args.kv_events:  # bound before the model loads, like the port: a bad endpoint is said at once
        from ..capture.publisher import ZmqPublisher

        publisher = ZmqPublisher(args.kv_events, args.kv_replay)
    elif args.kv_replay:
        return fail("--kv-replay needs --kv-events (the replay serves what the publisher sent)")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # bound now, before the model loads: a taken port is one sentence, not a traceback later
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        if publisher is not None:
            publisher.close()
        return fail(f"--host {args.host} --port {args.port}: {e.strerror or e}")
    model = load_model(args.model, device=args.device)
    emitter = None
    if publisher is not None:
        from ..capture.emit import KVEventEmitter

        emitter = KVEventEmitter(config.block_size, publisher.send, args.kv_topic)
    worker = EngineWorker(model, config, args.max_in_flight, oracle, args.fault, args.store if args.record else None,
                          emitter.on_step if emitter else None)
    options = ServeOptions(args.served_model_name or model.name, args.cache_sharing, chat_template=template)
    app = create_app(worker, options, on_stop=lambda w: print(
        f"kvviz: stopped after {w.stats.requests} request{'' if w.stats.requests == 1 else 's'}, "
        f"{w.stats.generated_tokens} tokens generated",
        file=sys.stderr, flush=True))
    print(f"kvviz: serving {options.model_name} on http://{args.host}:{args.port}/v1 (cache sharing "
          f"{args.cache_sharing}, {config.num_blocks} blocks of {config.block_size}"
          + (f", schedule {args.schedule}" if args.schedule != "fcfs" else "")
          + (f", fault {args.fault} injected" if args.fault else "") + (", leak oracle on" if oracle else "") + ")"
          + (f"; recording into {args.store.path} as run {worker.recording.run_id}" if worker.recording else "")
          + (f"; KV events on {args.kv_events}" + (f", replay on {args.kv_replay}" if args.kv_replay else "")
             if publisher else ""),
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=30))
    try:  # SIGTERM or Ctrl-C: uvicorn stops listening, drains the requests in flight, then the app stops
        server.run(sockets=[sock])
    finally:
        worker.close()
        sock.close()
        if publisher is not None:
            publisher.close()
    return 0


def add_serve(sub: Subcommands) -> None:
    """The serve subcommand's flags."""
    from ..serve import SHARING

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine")
    add_model_device(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", help="the name clients give as `model` (default: the model's name)")
    p.add_argument("--cache-sharing", choices=SHARING, default="global",
                   help="global: one prefix cache for everyone; per-user: namespaced by the request's `user` or "
                        "API key (a request's cache_salt always wins); off: no prefix caching (default global)")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks in the pool (default 2048)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="token budget per step (default 2048)")
    p.add_argument("--schedule", choices=["fcfs", "lpm"], default="fcfs",
                   help="the order waiting requests are admitted in: fcfs, first come first served (default); lpm, "
                        "longest cached prefix first, as SGLang's policy (which the audit's order channel can see)")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="requests queued or running at once; more get HTTP 429 (default 256)")
    p.add_argument("--isolation", choices=["paged", "masked"],
                   help="paged: each request reads its own slots through its page table; masked: every live slot on "
                        "one key axis, isolated by the mask (default paged, or what --fault breaks)")
    p.add_argument("--fault", metavar="NAME", help="serve with a fault from the catalogue injected (docs/faults.md); "
                                                   "turns the leak oracle on")
    p.add_argument("--oracle", action="store_true",
                   help="run the leak oracle on every step (the inspect path: slower) and export its metrics")
    p.add_argument("--kv-events", metavar="ENDPOINT",
                   help="publish vLLM 0.33 KV-cache events over ZMQ here, e.g. tcp://*:5557 (capture-vllm follows it)")
    p.add_argument("--kv-replay", metavar="ENDPOINT", help="and answer replay requests here, e.g. tcp://*:5558")
    p.add_argument("--kv-topic", default="", help="the events' ZMQ topic (default empty, as vLLM's)")
    p.add_argument("--record", action="store_true",
                   help="record the served traffic into the run store as one run (turns the leak oracle on; every "
                        "step writes the whole pool: for a session, not for days)")
    p.add_argument("--db", help="run store for --record (default $KVVIZ_DB, else runs/kvviz.duckdb)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template, for a model without one")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
