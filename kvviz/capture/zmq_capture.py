"""Subscribe to a vLLM (or SGLang) KV-event publisher over ZMQ and write a capture file.

Messages are three frames: topic, an 8-byte big-endian sequence number, the msgpack payload. With a
replay endpoint, the buffered history is asked for first. Both publishers' ROUTER expects a REQ-style
request (an empty delimiter frame, then the start sequence number as 8 bytes) and answers each
buffered batch with an empty delimiter and then (topic, seq, payload) from vLLM 0.33 or (seq, payload)
from SGLang and older vLLM, ending with seq -1 in the same place.
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
        replayed = _replay(ctx, replay, writer) if replay else set()
        end = None if duration is None else time.monotonic() + duration
        while not should_stop() and (end is None or time.monotonic() < end):
            if sub.poll(200):
                frames = sub.recv_multipart()
                if len(frames) == 3 and len(frames[1]) == 8:
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if seq in replayed:  # published while the replay ran: already written once
                        replayed.discard(seq)
                        continue
                    writer.add(seq, frames[0], frames[2])
                    progress(writer)
    finally:
        sub.close()
        writer.close()
        ctx.term()
    return writer


def _replay(ctx: zmq.Context, endpoint: str, writer: CaptureWriter, timeout_ms: int = 2000) -> set[int]:
    """Write the publisher's buffered history; returns the sequence numbers written."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])  # the delimiter a REQ socket would add
    written: set[int] = set()
    try:
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()  # [b"", topic, seq, payload] or [b"", seq, payload]
            if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                continue
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == -1:
                break
            writer.add(seq, frames[1] if len(frames) == 4 else b"", frames[-1])
            written.add(seq)
    finally:
        sock.close()
    return written
