"""`python -m kvviz bench --monitor` at small sizes: each case measures what it says (the replay feeds
every message and samples memory after its first million events; the scrape sees its tenants), and a
case that does not exist is refused."""

from __future__ import annotations

import pytest

from kvviz.bench import monitor as bench_monitor
from tests.cli import kvviz


def test_an_unknown_monitor_case_is_refused():
    p = kvviz("bench", "--monitor", "--cases", "live,nope")
    assert p.returncode == 2 and "'nope' is no monitor case" in p.stderr


@pytest.mark.slow
def test_the_replay_and_scrape_cases_measure_what_they_say():
    memory = bench_monitor.run_memory(events=250_000)
    assert memory.messages > 20_000 and memory.seconds > 0
    assert memory.rss_start_mb > 0 and memory.rss_at_million_mb <= memory.rss_peak_mb
    [few, every] = bench_monitor.run_scrape(tenants=50)
    assert (few.labelled, every.labelled) == (20, 50) and every.bytes > few.bytes
    assert every.median_ms < 1000
    text = bench_monitor.report(None, memory, [few, every])
    assert f"| {memory.events:,} | {memory.messages:,} |" in text and "| 50 | 50 |" in text
