"""A running monitor: its state, the thread that feeds it (live publishers or a replayed capture)
and, when asked, the HTTP server Prometheus scrapes. The command line runs one in the foreground;
the app's Live page keeps one for every session."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import start_http_server

from ..capture.endpoints import parse_sources
from ..capture.zmq_capture import Endpoint
from .metrics import registry
from .sources import run_live, run_replay
from .state import MonitorState, Snapshot

log = logging.getLogger("kvviz.monitor")


@dataclass(frozen=True)
class Feed:
    """What the monitor follows: publishers (`sources`), or a capture file replayed at `speed`."""
    sources: tuple[Endpoint, ...] = ()
    capture: Path | None = None
    speed: float = 1.0
    topic: str = ""


def publishers(endpoints: list[str], replays: list[str], topic: str = "") -> Feed:
    """A feed of publishers given as capture-vllm takes them ([NAME=]URL); a bad list is a CaptureError."""
    return Feed(sources=tuple(parse_sources(endpoints, replays)), topic=topic)


class Monitor:
    def __init__(self, feed: Feed, state: MonitorState):
        self.feed, self.state = feed, state
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.server = None
        self.error: str | None = None  # why the feed ended early, if it did
        self.ended: str | None = None  # "finished" (a capture replayed to its end), "stopped" or "failed"

    def snapshot(self) -> Snapshot:
        return self.state.snapshot

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0: a free port); returns the port."""
        self.server, _ = start_http_server(port, addr=host, registry=registry(self.snapshot))
        return self.server.server_port

    def run(self, duration: float | None = None, progress: Callable = lambda s: None, every: float = 10.0) -> None:
        """Follow the feed on this thread until stop(), the duration or the capture's end."""
        say = log.warning
        try:
            if self.feed.capture is not None:
                run_replay(self.state, self.feed.capture, self.feed.speed, say=say, should_stop=self._stop.is_set,
                           progress=progress, every=every)
            else:
                run_live(self.state, list(self.feed.sources), self.feed.topic, say=say, duration=duration,
                         should_stop=self._stop.is_set, progress=progress, every=every)
        except Exception as e:  # the feed is gone (a capture that stops being readable): said, and the
            self.error, self.ended = str(e), "failed"  # metrics stay served
            log.error("the monitor's feed stopped: %s", e)
            raise
        self.ended = "stopped" if self._stop.is_set() or self.feed.capture is None else "finished"

    def start(self) -> None:
        """Follow the feed on a thread of its own."""
        self.thread = threading.Thread(target=self._quietly, name="kvviz-monitor", daemon=True)
        self.thread.start()

    def _quietly(self) -> None:
        try:
            self.run()
        except Exception:  # logged and kept in self.error
            pass

    def request_stop(self) -> None:
        """Ask the feed to end (from a signal handler: nothing waits)."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(10)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
