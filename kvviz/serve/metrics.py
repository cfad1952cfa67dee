"""The metrics to watch, in Prometheus text format for any Prometheus or Grafana to scrape and alert
on (the seed's section 6.3: leak rate, cache hit rate, block utilisation). Read from the worker at
scrape time; the ratios come with the counters they are made of, so PromQL can rate them too."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .worker import EngineWorker


class _WorkerCollector(Collector):
    def __init__(self, worker: EngineWorker):
        self.worker = worker

    def collect(self):
        w, m, s = self.worker, self.worker.metrics, self.worker.stats
        values = m.values()

        def gauge(name: str, doc: str, value: float | None):
            if value is not None:
                yield GaugeMetricFamily(f"kvviz_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float):
            yield CounterMetricFamily(f"kvviz_{name}", doc, value=value)

        yield from gauge("prefix_cache_hit_ratio", "Prompt tokens the prefix cache served, of those looked up "
                         "at admission, since the server started.", values["hit_rate"])
        yield from gauge("kv_block_utilisation", "KV blocks held by requests, of the pool, after the last step.",
                         values["block_utilisation"])
        yield from gauge("kv_slot_utilisation", "Held KV slots that hold a token, after the last step (absent "
                         "while no block is held).",
                         values["slot_utilisation"])
        yield from gauge("requests_in_flight", "Requests queued or running.", w.in_flight())
        yield from counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m.looked_up)
        yield from counter("prefix_cache_hits", "Prompt tokens the prefix cache served.", m.served)
        yield from counter("requests", "Requests finished.", s.requests)
        yield from counter("prompt_tokens", "Prompt tokens of finished requests.", s.prompt_tokens)
        yield from counter("generation_tokens", "Tokens generated for finished requests.", s.generated_tokens)
        yield from counter("engine_steps", "Engine steps run.", s.steps)
        if w.oracle is not None:  # the leak oracle runs: the isolation metrics
            yield from gauge("leak_rate", "Queries whose foreign and stale attention passed the oracle's "
                             "threshold, of every query judged.", values["leak_rate"] or 0.0)
            yield from gauge("foreign_attention_mass_max", "The largest share of one query's attention on keys "
                             "not its own.", values["max_foreign"] or 0.0)
            findings = CounterMetricFamily("kvviz_leak_findings", "Findings of the leak oracle, by kind (foreign, "
                                           "stale, cross_tenant, duplicate, normalisation, non_finite); cross_tenant "
                                           "counts blocks another tenant wrote that a request read (a read of the "
                                           "same content, counted once it has ended).", labels=["kind"])
            for kind, n in sorted(w.findings.items()):
                findings.add_metric([kind], n)
            yield findings


def exposition(worker: EngineWorker) -> tuple[bytes, str]:
    """The worker's metrics now, and the content type to serve them with."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_WorkerCollector(worker))
    return generate_latest(registry), CONTENT_TYPE_LATEST
