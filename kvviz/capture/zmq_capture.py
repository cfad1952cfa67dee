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
from .events import CaptureError


class EndpointError(CaptureError):
    """An endpoint ZMQ cannot connect to (a malformed address): said before anything is written."""


def open_socket(ctx: zmq.Context, kind: int, endpoint: str, flag: str, bind: bool = False) -> zmq.Socket:
    """A socket connected (or bound) to the endpoint; a malformed one is an EndpointError naming the flag."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(endpoint) if bind else sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close()
        raise EndpointError(f"{flag} {endpoint!r}: {e} (expected e.g. tcp://{'*' if bind else 'host'}:5557)") from None
    return sock


def capture(endpoint: str, out: str, duration: float | None = None, replay: str | None = None, topic: str = "",
            progress: Callable[[CaptureWriter], None] = lambda w: None,
            should_stop: Callable[[], bool] = lambda: False) -> CaptureWriter:
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    try:
        sub = open_socket(ctx, zmq.SUB, endpoint, "--endpoint")
        socks.append(sub)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if replay:
            socks.append(open_socket(ctx, zmq.DEALER, replay, "--replay"))
        writer = CaptureWriter(out, endpoint)
        try:
            replayed = _replay(socks[1], writer) if replay else set()
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
            writer.close()
    finally:
        for sock in socks:
            sock.close()
        ctx.term()
    return writer


def _replay(sock: zmq.Socket, writer: CaptureWriter, timeout_ms: int = 2000) -> set[int]:
    """Write the publisher's buffered history; returns the sequence numbers written. A publisher
    that does not answer within the timeout has no history to give: the live capture goes on."""
    sock.send_multipart([b"", (0).to_bytes(8, "big")])  # the delimiter a REQ socket would add
    written: set[int] = set()
    while sock.poll(timeout_ms):
        frames = sock.recv_multipart()  # [b"", topic, seq, payload] or [b"", seq, payload]
        if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
            continue
        seq = int.from_bytes(frames[-2], "big", signed=True)
        if seq == -1:
            break
        writer.add(seq, frames[1] if len(frames) == 4 else b"", frames[-1])
        written.add(seq)
    return written
