"""`kvviz capture-vllm`: the one command that talks to live servers (the ZMQ KV-event publishers of
a fleet), kept apart so zmq loads only when a capture starts."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..capture.endpoints import parse_sources
from ..errors import CaptureError
from .common import Subcommands

if TYPE_CHECKING:
    from ..capture.zmq_capture import ReplicaState


def progress_lines(states: dict[str, ReplicaState]) -> list[str]:
    lines = []
    for name, st in states.items():
        said = [f"{st.count} message{'' if st.count == 1 else 's'}"]
        if st.last is not None:
            said.append(f"last seq {st.last}")
        if st.restarts:
            said.append(f"{st.restarts} restart{'' if st.restarts == 1 else 's'}")
        if st.gaps:
            said.append(f"{st.lost} lost in {len(st.gaps)} gap{'' if len(st.gaps) == 1 else 's'}")
        if st.invalid:
            said.append(f"{st.invalid} not KV-event batches")
        if not st.connected:
            said.append("not connected")
        lines.append(f"kvviz: {name}: " + ", ".join(said))
    return lines


class _Lines:
    """Notes and the per-replica progress block on stderr: on a terminal the block is redrawn in place
    and a note starts a new one below it; elsewhere each block is printed in turn."""

    def __init__(self, tty: bool):
        self.tty, self.drawn = tty, 0

    def say(self, line: str) -> None:
        print(f"kvviz: {line}", file=sys.stderr, flush=True)
        self.drawn = 0

    def progress(self, states: dict[str, ReplicaState]) -> None:
        lines = progress_lines(states)
        if self.tty:
            print("\033[F" * self.drawn + "\n".join(f"\033[K{line}" for line in lines), file=sys.stderr, flush=True)
            self.drawn = len(lines)
        else:
            print("\n".join(lines), file=sys.stderr, flush=True)


def cmd_capture_vllm(args: argparse.Namespace) -> int:
    """Subscribe to every publisher and write one capture; stop on Ctrl-C, SIGTERM or --duration."""
    from pathlib import Path

    from ..capture.capture_file import CaptureWriter
    from ..capture.dataset import DatasetWriter
    from ..capture.zmq_capture import FleetCapture

    sources = parse_sources(args.endpoint, args.replay)
    if args.rotate_rows < 1:
        raise CaptureError("--rotate-rows must be at least 1")
    out = Path(args.out)
    if out.suffix.lower() == ".jsonl" and not out.parent.is_dir():
        raise CaptureError(f"--out {out}: no folder {out.parent}")
    lines = _Lines(sys.stderr.isatty())
    fleet = FleetCapture(sources, topic=args.topic, say=lines.say)  # a bad address: said before a file is made
    replicas = {s.name: s.endpoint for s in sources}
    try:
        sink = (CaptureWriter(out, replicas) if out.suffix.lower() == ".jsonl" else
                DatasetWriter(out, replicas, rotate_rows=args.rotate_rows))
    except BaseException:
        fleet.close()
        raise
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        fleet.run(sink, duration=args.duration, should_stop=lambda: stop, progress=lines.progress,
                  every=0.5 if lines.tty else 10.0)
    except KeyboardInterrupt:
        pass
    finally:
        fleet.close()
        signal.signal(signal.SIGTERM, old)
        sink.close()
    for line in progress_lines(fleet.states):
        print(line, file=sys.stderr)
    for st in fleet.states.values():
        for lo, hi in st.gaps:
            print(f"kvviz: {st.source.name}: lost messages {lo}..{hi} (a gap in sequence numbers)", file=sys.stderr)
    print(f"{args.out}: {sink.count} messages from {len(sources)} replica{'' if len(sources) == 1 else 's'}")
    return 0


def add_capture_vllm(sub: Subcommands) -> None:
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


def cmd_capture_example(args: argparse.Namespace) -> int:
    from ..capture.synthetic import write_example

    out = Path(args.out)
    if args.events < 1:
        raise CaptureError(f"--events must be at least 1, got {args.events}")
    if not 1 <= args.replicas <= 64:
        raise CaptureError(f"--replicas must be 1 to 64, got {args.replicas}")
    if out.suffix and out.suffix.lower() != ".jsonl":
        raise CaptureError(f"{out}: give FILE.jsonl for a JSONL capture, or a folder name without an extension "
                           "for a Parquet dataset")
    if out.suffix.lower() == ".jsonl":
        if not out.parent.is_dir():
            raise CaptureError(f"{out}: no folder {out.parent}")
        if out.exists():
            raise CaptureError(f"{out}: already exists; give a new file")
    count = write_example(out, args.events, args.replicas, args.seed)
    print(f"{out}: {count} messages of a synthetic {args.replicas}-replica fleet (not from a server); "
          f"import it with: python -m kvviz import {out}")
    return 0


def add_capture_example(sub: Subcommands) -> None:
    what = "write a synthetic fleet's KV-event capture to try the capture views"
    ex = sub.add_parser("capture-example", help=what, description=what[0].upper() + what[1:] + " (generated by "
                        "kvviz, not recorded from a server); import it with `python -m kvviz import OUT`.")
    ex.add_argument("out", metavar="OUT", help="FILE.jsonl (as capture-vllm writes it), or a new folder for a Parquet "
                    "dataset")
    ex.add_argument("--events", type=int, default=200_000, help="block events to write, about (default 200,000)")
    ex.add_argument("--replicas", type=int, default=3, help="replicas in the fleet (default 3); the last of two or "
                    "more offloads to a CPU tier that drops the salt (a cross_tier_salt finding)")
    ex.add_argument("--seed", type=int, default=0, help="the same seed writes the same capture (default 0)")
    ex.set_defaults(func=cmd_capture_example)
