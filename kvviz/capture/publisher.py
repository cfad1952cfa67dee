"""A ZMQ KV-event publisher as vLLM 0.33 runs one: a PUB socket sending (topic, 8-byte big-endian
sequence number, msgpack batch) and, optionally, a ROUTER replay socket that answers a start
sequence number with the buffered batches from there on, each as (topic, seq, payload) after an
empty delimiter, then (b"", -1, b""). `kvviz capture-vllm` and any vLLM consumer can follow it."""

from __future__ import annotations

import threading
from collections import deque

import zmq

from .zmq_capture import EndpointError, open_socket

END = (-1).to_bytes(8, "big", signed=True)


class ZmqPublisher:
    """send() from one thread (the engine's); replay runs on its own thread. close() stops both."""

    def __init__(self, endpoint: str, replay: str | None = None, buffer: int = 10_000):
        self.ctx = zmq.Context()
        self.pub = open_socket(self.ctx, zmq.PUB, endpoint, "--kv-events", bind=True)
        self.buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer)
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._replay = None
        if replay is not None:
            try:
                router = open_socket(self.ctx, zmq.ROUTER, replay, "--kv-replay", bind=True)
            except EndpointError:
                self.pub.close()
                self.ctx.term()
                raise
            self._replay = threading.Thread(target=self._serve_replay, args=(router,), name="kvviz-kv-replay",
                                            daemon=True)
            self._replay.start()

    def send(self, seq: int, topic: bytes, payload: bytes) -> None:
        with self._lock:
            self.buffer.append((seq, topic, payload))
        self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()  # [identity, b"", start]
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue
                start = int.from_bytes(frames[2], "big")
                with self._lock:
                    history = [b for b in self.buffer if b[0] >= start]
                for seq, topic, payload in history:
                    router.send_multipart([frames[0], b"", topic, seq.to_bytes(8, "big"), payload])
                router.send_multipart([frames[0], b"", b"", END, b""])
        finally:
            router.close()

    def close(self) -> None:
        self._stop.set()
        if self._replay is not None:
            self._replay.join(5)
        self.pub.close()
        self.ctx.term()
