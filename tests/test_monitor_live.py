"""kvviz monitor on real sockets: publishers over ZMQ (kvviz's publisher, with vLLM 0.33's framing and
replay), one that restarts and sends what is no KV-event batch, one that never answers; the monitor
keeps going, counts each, and says it on /metrics over HTTP."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvviz.capture.publisher import ZmqPublisher
from kvviz.capture.zmq_capture import Endpoint, ReplicaState
from kvviz.monitor.service import Feed, Monitor
from kvviz.monitor.state import MonitorState
from kvviz.serve.local import free_port
from tests.test_capture import batch, stored_map

pytestmark = pytest.mark.slow


def metrics(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(samples: dict, name: str, replica: str) -> float:
    return samples.get((name, (("replica", replica),)), 0.0)


def wait_for(check, seconds: float = 15.0) -> None:
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, "the monitor did not get there in time"
        time.sleep(0.1)


def subscribed(pub: ZmqPublisher, stream: ReplicaState, first: bytes) -> None:
    """Send seq 0 until the capture has it (its count, kept as messages arrive): a PUB socket drops what
    it sends before the subscription reaches it, and a message without a sequence number (sent next
    here) is never replayed."""
    before = stream.count + stream.invalid
    for _ in range(15):
        pub.send(0, b"", first)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            if stream.count + stream.invalid > before:
                return
            time.sleep(0.02)
    raise AssertionError("the monitor never received the first message")


def test_a_restart_undecodable_messages_and_an_unreachable_publisher_are_counted_and_survived():
    pub_port, replay_port, dead_port = free_port(), free_port(), free_port()
    pub = ZmqPublisher(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    state = MonitorState(fold_s=0.1)
    monitor = Monitor(Feed(sources=(Endpoint("a", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"),
                                    Endpoint("dead", f"tcp://127.0.0.1:{dead_port}"))), state)
    port = monitor.serve("127.0.0.1", 0)
    monitor.start()
    try:
        wait_for(lambda: state.streams.get("a") is not None and state.streams["a"].connected)
        subscribed(pub, state.streams["a"], batch(stored_map([100], None, [1, 2], salt="t1")))
        for seq in range(1, 5):
            pub.send(seq, b"", batch(stored_map([100 + seq], None, [1, 2], salt="t1")))
        pub.send(5, b"", b"\xc1 not msgpack")
        pub.pub.send_multipart([b"only one frame"])
        wait_for(lambda: value(metrics(port), "kvviz_kv_event_messages_invalid_total", "a") == 2)
        pub.close()
        pub = ZmqPublisher(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")  # seq from 0 again
        wait_for(lambda: state.streams["a"].connected)
        subscribed(pub, state.streams["a"], batch(stored_map([200], None, [1, 2], salt="t1")))
        for seq in range(1, 3):
            pub.send(seq, b"", batch(stored_map([200 + seq], None, [1, 2], salt="t1")))
        wait_for(lambda: value(metrics(port), "kvviz_kv_event_messages_total", "a") == 8)
        samples = metrics(port)
        assert value(samples, "kvviz_kv_event_publisher_restarts_total", "a") == 1
        assert samples[("kvviz_kv_cache_blocks", (("medium", "GPU"), ("replica", "a")))] == 3  # the first life's: gone
        assert value(samples, "kvviz_kv_event_publisher_connected", "dead") == 0
        assert value(samples, "kvviz_kv_event_publisher_connected", "a") == 1
        assert monitor.thread.is_alive()
    finally:
        monitor.stop()
        pub.close()
