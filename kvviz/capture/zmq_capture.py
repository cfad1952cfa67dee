"""Subscribe to a vLLM (or SGLang) KV-event publisher over ZMQ and write a capture file.

Messages are three frames: topic, an 8-byte big-endian sequence number, the msgpack payload. With a
replay endpoint, the buffered history is asked for first (a start sequence number sent as 8 bytes,
answered by (topic, seq, payload) frames and ended by seq -1).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from .capture_file import CaptureWriter


def capture(endpoint: str, out: str, duration: float | None = None, replay: str | None = None, topic: str = "",
            progress: Callable[[CaptureWriter], None] = lambda w: None,
            should_stop: Callable[[], bool] = lambda: False) -> CaptureWriter:
    ctx = zmq.Context()
    writer = CaptureWriter(out, endpoint)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    try:
        if replay:
            _replay(ctx, replay, writer)
        end = None if duration is None else time.monotonic() + duration
        while not should_stop() and (end is None or time.monotonic() < end):
            if sub.poll(200):
                frames = sub.recv_multipart()
                if len(frames) == 3 and len(frames[1]) == 8:
                    writer.add(int.from_bytes(frames[1], "big", signed=True), frames[0], frames[2])
                    progress(writer)
    finally:
        sub.close()
        writer.close()
        ctx.term()
    return writer


def _replay(ctx: zmq.Context, endpoint: str, writer: CaptureWriter, timeout_ms: int = 2000) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send((0).to_bytes(8, "big"))
    try:
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == -1:
                break
            writer.add(seq, frames[0], frames[2])
    finally:
        sock.close()
