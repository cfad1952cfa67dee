"""One monitor for every session of the app, with the course of its figures: a point a second, the
last hour of them, for the Live page to draw as they come (the app keeps one of these with
st.cache_resource; nothing here knows Streamlit)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from .service import Feed, Monitor
from .state import MEDIA_FIELDS, MonitorState, Snapshot

HISTORY = 3600


@dataclass(frozen=True)
class Point:
    """The fleet's figures at one moment; rates and the hit ratio over the second before it."""
    t: float
    hit_ratio: float | None  # hit tokens of stored tokens in the interval (None: nothing stored, or no hit
    # ever reported: vLLM reports hits only under kv_cache_report_mode="full")
    hits_reported: bool  # has any hit been published so far
    utilisation: float | None  # GPU blocks cached of the capacity given (None: no capacity)
    messages_per_s: float
    blocks_cached: int
    cross_tenant_blocks: int  # so far
    breaches: int
    lost: int
    invalid: int


def point(now: Snapshot, before: Snapshot | None, t: float, dt: float) -> Point:
    def media(s: Snapshot | None, field: str, gpu: bool = False) -> int:
        i = MEDIA_FIELDS.index(field)
        return sum(v[i] for (_, medium), v in s.media.items() if not gpu or medium in ("GPU", "none")) if s else 0

    hit = media(now, "hit_tokens") - media(before, "hit_tokens")
    miss = media(now, "miss_tokens") - media(before, "miss_tokens")
    capacity = sum(r.capacity_blocks or 0 for r in now.replicas.values())
    messages = sum(r.messages for r in now.replicas.values())
    messages_before = sum(r.messages for r in before.replicas.values()) if before else 0
    reported = media(now, "hits") > 0  # no hit ever: the server does not report them, and 0 would say nothing
    return Point(t=t, hit_ratio=hit / (hit + miss) if reported and hit + miss else None, hits_reported=reported,
                 utilisation=media(now, "held", gpu=True) / capacity if capacity else None,
                 messages_per_s=(messages - messages_before) / dt if dt > 0 else 0.0,
                 blocks_cached=media(now, "held"),
                 cross_tenant_blocks=sum(r.cross_tenant_blocks for r in now.replicas.values()),
                 breaches=sum(now.breaches.values()), lost=sum(r.lost for r in now.replicas.values()),
                 invalid=sum(r.invalid for r in now.replicas.values()))


class SharedMonitor:
    """The app's one monitor: started, replaced and stopped by any session, read by all."""

    def __init__(self, every: float = 1.0):
        self.every = every
        self.monitor: Monitor | None = None
        self.feed: Feed | None = None
        self.course: deque[Point] = deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, feed: Feed, capacity: dict[str, int] | None = None) -> None:
        """Follow a feed, in place of whatever was followed before."""
        with self._lock:
            self._halt()
            self.feed, self.course = feed, deque(maxlen=HISTORY)
            self.monitor = Monitor(feed, MonitorState(capacity=capacity, fold_s=min(0.5, self.every)))
            self.monitor.start()
            self._stop = threading.Event()
            self._sampler = threading.Thread(target=self._sample, args=(self.monitor, self._stop),
                                             name="kvviz-live-course", daemon=True)
            self._sampler.start()

    def stop(self) -> None:
        with self._lock:
            self._halt()

    def running(self) -> bool:
        return self.monitor is not None and self.monitor.thread is not None and self.monitor.thread.is_alive()

    def settled(self) -> bool:
        """The feed has ended and its last figures are in the course, which grows no more."""
        return not self.running() and (self._sampler is None or not self._sampler.is_alive())

    def _halt(self) -> None:
        self._stop.set()
        if self.monitor is not None:
            self.monitor.stop()
        if self._sampler is not None:
            self._sampler.join(5)

    def _sample(self, monitor: Monitor, stop: threading.Event) -> None:
        """A point a second while the feed goes on, and one more once it has ended (then the course stays
        as the feed left it: a flat point a second would push what it showed out of the hour kept)."""
        before, last = None, time.monotonic()
        while not stop.wait(self.every):
            ended = not monitor.thread.is_alive()
            monitor.state.flush()
            snap, now = monitor.snapshot(), time.monotonic()
            self.course.append(point(snap, before, time.time(), now - last))
            before, last = snap, now
            if ended:
                return
