"""kvviz monitor scraped by a real Prometheus server (Debian's, started here on a free port with the
shipped rules, stopped after): two of vLLM's own publishers (`vllm.distributed.kv_events`:
ZmqEventPublisher with its replay socket, sending vLLM's KVEventBatch of its BlockStored,
BlockRemoved and AllBlocksCleared) publish one stream with a prompt cached across tenants and one
without; Prometheus's own query API returns what was published, and the cross-tenant alert fires for
the first replica and stays quiet for the second. vLLM is installed without its dependencies
(.ci/run; requirements.txt lists the few its event module imports)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import msgspec
import pytest

from kvviz.capture.synthetic import fleet_messages
from kvviz.capture.zmq_capture import Endpoint
from kvviz.monitor.service import Feed, Monitor
from kvviz.monitor.state import MonitorState
from kvviz.serve.local import free_port
from tests.test_monitor import feed, scrape, total
from tests.test_monitor_rules import RULES

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="prometheus is not installed (Debian's prometheus package: apt-get install prometheus, as .ci/run does)")]


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    return json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]


def until(check, seconds: float, what: str):
    end = time.monotonic() + seconds
    while True:
        try:
            if found := check():
                return found
        except OSError:  # Prometheus not listening yet
            pass
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {seconds:g} s")
        time.sleep(0.25)


@pytest.fixture
def prometheus(tmp_path):
    """Yields start(target): a Prometheus scraping the port `target` every second with the shipped rules,
    evaluated every second; returns its port. Stopped after the test."""
    procs = []

    def start(target: int) -> int:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "kvviz-monitor",
                                "static_configs": [{"targets": [f"127.0.0.1:{target}"]}]}]}))
        db = tmp_path / "db"
        procs.append(subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={db}",
                                       f"--web.listen-address=127.0.0.1:{port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return port

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def publish(pub, batches: list) -> None:
    for i, batch in enumerate(batches):
        pub.publish(batch)
        if i % 200 == 199:
            time.sleep(0.02)  # within the subscriber's receive queue


def test_prometheus_scrapes_what_was_published_and_the_cross_tenant_alert_fires_only_where_it_should(prometheus):
    vllm_events = pytest.importorskip(  # here, not at collection: importing vLLM takes seconds
        "vllm.distributed.kv_events",
        reason="vLLM is not installed (pip install --no-deps vllm==0.34.0, as .ci/run does)")
    messages = {name: list(fleet_messages(6_000, replicas=1, unsalted=share, capacity=256))
                for name, share in (("cross", 0.05), ("clean", 0.0))}
    # the same streams as vLLM's own classes: its decoder builds its BlockStored etc. from the bytes
    streams = {name: [msgspec.msgpack.decode(m.payload, type=vllm_events.KVEventBatch) for m in ms]
               for name, ms in messages.items()}
    assert {type(e).__name__ for b in streams["cross"] for e in b.events} == {"BlockStored", "BlockRemoved"}
    ports = {name: (free_port(), free_port()) for name in streams}
    pubs = {name: vllm_events.ZmqEventPublisher(0, f"tcp://*:{port}", f"tcp://*:{replay}")  # "*": it binds
            for name, (port, replay) in ports.items()}
    monitor = Monitor(Feed(sources=tuple(Endpoint(n, f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}")
                                         for n, (p, r) in ports.items())), MonitorState(fold_s=0.2))
    try:
        prom = prometheus(monitor.serve("127.0.0.1", 0))
        monitor.start()
        until(lambda: len(query(prom, "kvviz_kv_cross_tenant_blocks_total")) == 2, 30,
              "Prometheus scraping the monitor")  # both counters seen at 0 before anything is published
        for name, payloads in streams.items():
            publish(pubs[name], payloads)
        for name, payloads in streams.items():
            got = f'kvviz_kv_event_messages_total{{replica="{name}"}} == {len(payloads)}'
            until(lambda got=got: query(prom, got), 30, f"all of {name}'s messages in Prometheus")
        until(lambda: query(prom, 'ALERTS{alertname="KvvizCrossTenantSharing",alertstate="firing"}'), 20,
              "the cross-tenant alert")
        time.sleep(2)  # two more rule evaluations: the clean replica must still be quiet
        alerts = query(prom, 'ALERTS{alertname="KvvizCrossTenantSharing"}')
        assert [a["metric"]["replica"] for a in alerts] == ["cross"]
        for name, ms in messages.items():  # what was published, as a state fed it directly counts it
            truth = total(scrape(feed(MonitorState(), ms)), "kvviz_kv_blocks_stored_total")
            stored = query(prom, f'sum(kvviz_kv_blocks_stored_total{{replica="{name}"}})')
            assert float(stored[0]["value"][1]) == truth > 0
        shared = query(prom, 'kvviz_kv_cross_tenant_blocks_total{replica="clean"}')
        assert float(shared[0]["value"][1]) == 0
    finally:
        monitor.stop()
        for pub in pubs.values():
            pub.shutdown()
