"""`kvviz capture-vllm`: the one command that talks to a live server (a ZMQ KV-event publisher),
kept apart so zmq loads only when a capture starts."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..capture.capture_file import CaptureWriter


def cmd_capture_vllm(args: argparse.Namespace) -> int:
    """Subscribe to vLLM's KV-event publisher and write a capture; stop on Ctrl-C or --duration."""
    from ..capture.zmq_capture import capture

    def progress(w: CaptureWriter) -> None:
        gaps = f", {len(w.gaps)} gaps in sequence numbers" if w.gaps else ""
        said = f"{w.count} message{'' if w.count == 1 else 's'}"
        print(f"\rkvviz: {said}, last seq {w.last}{gaps}", end="", file=sys.stderr, flush=True)

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
