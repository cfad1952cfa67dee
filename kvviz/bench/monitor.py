"""`python -m kvviz bench --monitor`: kvviz monitor against its targets (docs/benchmarks.md).

- live: two publisher processes at 10,000 step batches a second each (the --capture-live case), one
  monitor in this process with /metrics served and scraped every second: does it drop anything?
- memory: a synthetic capture of `events` block events replayed at full speed through the monitor:
  RSS after the first million events and at the end (its state is bounded, so it should stay flat);
- scrape: a monitor that has seen 1,000 tenants, /metrics fetched over HTTP, with the default 20
  tenant labels and with every tenant labelled."""

from __future__ import annotations

import os
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..capture.capture_file import CaptureWriter
from ..capture.events import decode_batch
from ..capture.synthetic import fleet_messages
from ..monitor.service import Feed, Monitor
from ..monitor.state import MonitorState
from .capture_import import sent_by, start_publishers

Say = Callable[[str], None]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@dataclass(frozen=True)
class LiveResult:
    replicas: int
    rate: int
    seconds: float
    sent: int
    received: int
    lost: int
    invalid: int
    cpu_s: float  # this process's CPU time while it ran (the monitor and its scrapes)
    scrapes: int
    scrape_max_ms: float


def _scrape_ms(port: int) -> float:
    t = time.perf_counter()
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return (time.perf_counter() - t) * 1000


def run_live(replicas: int = 2, rate: int = 10_000, duration: float = 60.0, say: Say = lambda s: None) -> LiveResult:
    sources, pubs = start_publishers(replicas, rate, duration)
    monitor = Monitor(Feed(sources=tuple(sources)), MonitorState())
    port = monitor.serve("127.0.0.1", 0)
    times: list[float] = []
    done = threading.Event()

    def scraper() -> None:
        while not done.wait(1.0):
            times.append(_scrape_ms(port))

    threading.Thread(target=scraper, daemon=True).start()
    say(f"monitoring {replicas} publishers at {rate:,} batches/s each for {duration:g} s, scraped every second")
    cpu = os.times()
    try:
        monitor.run(duration=duration + 4)
    finally:
        used = (os.times().user - cpu.user) + (os.times().system - cpu.system)
        done.set()
        monitor.stop()
    figures = monitor.snapshot().replicas.values()
    return LiveResult(replicas, rate, duration, sent_by(pubs), sum(f.messages for f in figures),
                      sum(f.lost for f in figures), sum(f.invalid for f in figures), used, len(times),
                      max(times, default=0.0))


@dataclass(frozen=True)
class MemoryResult:
    events: int
    messages: int
    seconds: float  # the replay alone
    rss_start_mb: float  # before the replay
    rss_at_million_mb: float  # after the first million block events
    rss_peak_mb: float  # the largest sample after the first million
    rss_end_mb: float


def run_memory(events: int = 10_000_000, say: Say = lambda s: None) -> MemoryResult:
    """Write a synthetic capture (two replicas, shared prefixes, returning conversations, a prompt
    cached across tenants), then replay it at full speed through a monitor, sampling RSS every
    100,000 messages."""
    with tempfile.TemporaryDirectory(prefix="kvviz-bench-monitor-") as tmp:
        path = Path(tmp) / "capture.jsonl"
        writer = CaptureWriter(path, {"replica-0": "synthetic", "replica-1": "synthetic"})
        rows_per_message: list[int] = []
        for m in fleet_messages(events, replicas=2, turns=0.3, unsalted=0.05):
            writer.add(m)
            if len(rows_per_message) < 200_000:
                rows_per_message.append(sum(max(1, len(e.block_hashes)) for e in decode_batch(m.payload, "").events))
            if writer.count % 100_000 == 0:
                say(f"written {writer.count:,} messages")
        writer.close()
        million_at = _messages_for(1_000_000, rows_per_message)
        state = SampledState(every=100_000, say=say)
        start_rss, t = rss_mb(), time.perf_counter()
        Monitor(Feed(capture=path, speed=0), state).run()
        seconds = time.perf_counter() - t
    after = [v for n, v in state.samples.items() if n >= million_at]
    at_million = after[0] if after else rss_mb()
    return MemoryResult(events, writer.count, seconds, start_rss, at_million, max(after, default=at_million), rss_mb())


def _messages_for(events: int, rows_per_message: list[int]) -> int:
    """About how many messages hold `events` block events, from the first messages' sizes."""
    per = sum(rows_per_message) / max(len(rows_per_message), 1)
    return int(events / per) if per else events


class SampledState(MonitorState):
    """A MonitorState that samples this process's RSS every `every` messages (and says how far it is)."""

    def __init__(self, every: int, say: Say):
        super().__init__()
        self.every, self.say, self.seen = every, say, 0
        self.samples: dict[int, float] = {}  # messages so far -> RSS MB

    def add(self, m, batch) -> None:
        super().add(m, batch)
        self.seen += 1
        if self.seen % self.every == 0:
            self.samples[self.seen] = rss_mb()
            self.say(f"replayed {self.seen:,} messages, RSS {self.samples[self.seen]:,.0f} MB")


@dataclass(frozen=True)
class ScrapeResult:
    tenants: int
    labelled: int
    median_ms: float
    max_ms: float
    bytes: int


def run_scrape(tenants: int = 1000, say: Say = lambda s: None) -> list[ScrapeResult]:
    from ..capture.capture_file import Message
    from ..capture.synthetic import BLOCK

    out = []
    for labelled in (20, tenants):
        state = MonitorState(tenants=labelled)
        seq = 0
        for t in range(tenants):
            for _ in range(3):
                seq += 1
                payload = _stored(seq, f"tenant-{t:04d}", BLOCK)
                state.add(Message("replica-0", 0, seq, "", payload, 1.0), decode_batch(payload, ""))
        state.flush()
        monitor = Monitor(Feed(), state)
        port = monitor.serve("127.0.0.1", 0)
        try:
            size = len(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read())
            times = sorted(_scrape_ms(port) for _ in range(30))
        finally:
            monitor.stop()
        out.append(ScrapeResult(tenants, labelled, times[len(times) // 2], times[-1], size))
        say(f"{labelled} labels: median {times[len(times) // 2]:.1f} ms")
    return out


def _stored(block_hash: int, salt: str, size: int) -> bytes:
    import msgpack

    return msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [block_hash], "parent_block_hash": None,
                                 "token_ids": list(range(size)), "block_size": size, "lora_id": None, "medium": "GPU",
                                 "lora_name": None, "extra_keys": [[salt]]}], None])


def report(live: LiveResult | None, memory: MemoryResult | None, scrapes: list[ScrapeResult]) -> str:
    lines = []
    if live is not None:
        lines += ["| publishers | batches/s each | seconds | sent | received | lost | invalid | monitor CPU "
                  "| scrapes | slowest scrape ms |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {live.replicas} | {live.rate:,} | {live.seconds:g} | {live.sent:,} | {live.received:,} "
                  f"| {live.lost:,} | {live.invalid:,} | {live.cpu_s / (live.seconds + 4):.0%} of a core "
                  f"| {live.scrapes} | {live.scrape_max_ms:.1f} |", ""]
    if memory is not None:
        m = memory
        lines += ["| block events | messages | replay s | msgs/s | RSS before MB | RSS at 1M events MB | peak after "
                  "MB | RSS at end MB |", "|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {m.events:,} | {m.messages:,} | {m.seconds:.0f} | {m.messages / m.seconds:,.0f} "
                  f"| {m.rss_start_mb:,.0f} | {m.rss_at_million_mb:,.0f} | {m.rss_peak_mb:,.0f} "
                  f"| {m.rss_end_mb:,.0f} |", ""]
    if scrapes:
        lines += ["| tenants seen | tenant labels | scrape median ms | slowest of 30 ms | bytes |",
                  "|---:|---:|---:|---:|---:|"]
        lines += [f"| {s.tenants:,} | {s.labelled:,} | {s.median_ms:.1f} | {s.max_ms:.1f} | {s.bytes:,} |"
                  for s in scrapes]
    return "\n".join(lines) + "\n"
