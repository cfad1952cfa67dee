"""`kvviz monitor`: the fleet's KV-event publishers watched live (or a capture replayed), its state
served to Prometheus on /metrics; bad input is counted, said and survived, never a reason to exit."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from ..errors import CaptureError
from .capture import _Lines, parse_sources
from .common import Subcommands


def parse_capacity(values: list[str] | None, names: list[str]) -> dict[str, int]:
    """--capacity [NAME=]BLOCKS: one replica's KV blocks, or every replica's without a name."""
    out: dict[str, int] = {}
    for v in values or []:
        name, sep, blocks = v.rpartition("=")
        key = name if sep else "*"
        if sep and names and name not in names:
            raise CaptureError(f"--capacity {v!r}: no replica is named {name!r} (known: {', '.join(names)})")
        if not blocks.isdigit() or int(blocks) < 1:
            raise CaptureError(f"--capacity {v!r}: give a whole number of blocks, at least 1")
        out[key] = int(blocks)
    return out


def cmd_monitor(args: argparse.Namespace) -> int:
    """Follow the feed until Ctrl-C, SIGTERM, --duration or the replayed capture's end."""
    from ..capture.capture_file import CaptureWriter
    from ..capture.dataset import DatasetWriter
    from ..monitor.service import Feed, Monitor
    from ..monitor.state import MonitorState

    if bool(args.endpoint) == bool(args.from_capture):
        raise CaptureError("give --endpoint (repeatable) to follow publishers, or --from-capture FILE.jsonl")
    if args.tenants < 1 or args.speed < 0:
        raise CaptureError("--tenants must be at least 1 and --speed at least 0")
    sources = parse_sources(args.endpoint, args.replay) if args.endpoint else []
    capacity = parse_capacity(args.capacity, [s.name for s in sources])
    if args.from_capture and not Path(args.from_capture).is_file():
        raise CaptureError(f"--from-capture {args.from_capture}: no such file")
    logging.basicConfig(format="kvviz: %(message)s", level=logging.INFO, stream=sys.stderr)
    record = None
    if args.out:
        out, replicas = Path(args.out), {s.name: s.endpoint for s in sources}
        if out.suffix.lower() == ".jsonl" and not out.parent.is_dir():
            raise CaptureError(f"--out {out}: no folder {out.parent}")
        record = CaptureWriter(out, replicas) if out.suffix.lower() == ".jsonl" else DatasetWriter(out, replicas)
    state = MonitorState(capacity=capacity, tenants=args.tenants, record=record)
    feed = Feed(sources=tuple(sources), capture=Path(args.from_capture) if args.from_capture else None,
                speed=args.speed, topic=args.topic)
    monitor = Monitor(feed, state)
    port = monitor.serve(args.host, args.port)
    print(f"kvviz: serving metrics on http://{args.host}:{port}/metrics", file=sys.stderr, flush=True)
    lines = _Lines(sys.stderr.isatty())

    def on_term(*_: object) -> None:
        monitor.request_stop()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        monitor.run(duration=args.duration, progress=lines.progress, every=0.5 if lines.tty else 10.0)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, old)
        monitor.stop()
        if record is not None:
            record.close()
    lines.progress(state.streams)
    return 0


def add_monitor(sub: Subcommands) -> None:
    what = "watch a fleet's KV-cache events live and serve them to Prometheus on /metrics"
    p = sub.add_parser("monitor", help=what, description=what[0].upper() + what[1:] + " (docs/monitoring.md).")
    p.add_argument("--endpoint", action="append", metavar="[NAME=]URL",
                   help="a replica's publisher, as capture-vllm takes it; repeat it for every replica")
    p.add_argument("--replay", action="append", metavar="[NAME=]URL",
                   help="a replica's replay endpoint (paired by name, or by order when unnamed)")
    p.add_argument("--topic", default="", help="topic to subscribe to (default: all)")
    p.add_argument("--from-capture", metavar="FILE.jsonl",
                   help="replay a capture-vllm JSONL capture instead of following publishers")
    p.add_argument("--speed", type=float, default=1.0,
                   help="with --from-capture: times as fast as it was published (0: as fast as it goes; default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve /metrics on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9400, help="port to serve /metrics on (default 9400; 0: any free)")
    p.add_argument("--capacity", action="append", metavar="[NAME=]BLOCKS",
                   help="a replica's KV blocks (every replica's without a name), for block utilisation: "
                        "events never say it")
    p.add_argument("--tenants", type=int, default=20,
                   help="tenants labelled on their own, the busiest first; the rest are `other` (default 20)")
    p.add_argument("--out", help="also record the capture: FILE.jsonl or a new folder for a Parquet dataset")
    p.add_argument("--duration", type=float, help="stop after this many seconds (default: Ctrl-C or SIGTERM)")
    p.set_defaults(func=cmd_monitor)
