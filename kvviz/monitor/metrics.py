"""The monitor's Snapshot as Prometheus metrics, named as Prometheus's conventions ask (a `kvviz_`
prefix, base units in the name, `_total` on counters) and labelled by replica, medium and tenant
(the busiest tenants and `other`: monitor/tenants.py). docs/monitoring.md says what each can and
cannot tell from events alone. Built from the last snapshot at scrape time: a scrape never waits
for a fold."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from .state import MEDIA_FIELDS, Snapshot
from .tenants import FIELDS as TENANT_FIELDS

# name (without kvviz_ and _total), help, the snapshot field: per (replica, medium)
MEDIA = (("kv_blocks_stored", "Blocks newly stored (cached) in the prefix cache: BlockStored of a hash not cached "
          "on the replica, KV group and medium.", "stored"),
         ("kv_block_hits", "Stores of a block already cached: the hits vLLM reports under "
          "kv_cache_report_mode=\"full\" (none under the default mode).", "hits"),
         ("kv_blocks_removed", "Cached blocks removed (evicted): BlockRemoved of a hash that was cached.", "removed"),
         ("prefix_cache_hit_tokens", "Tokens of stores that repeated a cached block (served by the cache).",
          "hit_tokens"),
         ("prefix_cache_miss_tokens", "Tokens of stores of new blocks (computed: nothing cached them).",
          "miss_tokens"))
REPLICA = (("kv_event_messages", "KV-event batches received and decoded.", "messages"),
           ("kv_event_messages_invalid", "Messages that were not KV-event batches (not decoded, left out).",
            "invalid"),
           ("kv_event_messages_lost", "Messages lost for good: sequence numbers never received once no replay "
            "was pending.", "lost"),
           ("kv_event_publisher_restarts", "Times the publisher's sequence numbers went back (a restart).",
            "restarts"),
           ("kv_cache_clears", "AllBlocksCleared events (a reset of the prefix cache).", "clears"),
           ("kv_cross_tenant_blocks", "Block hashes stored or hit by a second tenant the stream names, on one "
            "replica and KV group: one cache entry serving two tenants (the capture views' cross-tenant findings).",
            "cross_tenant_blocks"),
           ("kv_salt_shared_blocks", "Block hashes stored or hit under a second salt, named or only inferred from "
            "the chain a store continues (the capture views' named and inferred shared blocks).",
            "salt_shared_blocks"),
           ("kv_untold_segments", "Stored segments continuing a salted chain whose event names no salt: the "
            "chain's tenant is known, the storing tenant is not.", "untold_segments"),
           ("kv_blocks_salted", "New blocks stored under a tenant salt (salts in use when it grows).",
            "salted_stores"))


class SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        held = GaugeMetricFamily("kvviz_kv_cache_blocks", "Blocks cached now, as the events tell (stores less "
                                 "removals since the monitor started, reset by clears and restarts).",
                                 labels=["replica", "medium"])
        for (replica, medium), values in sorted(s.media.items()):
            held.add_metric([replica, medium], values[MEDIA_FIELDS.index("held")])
        yield held
        for name, doc, field in MEDIA:
            c = CounterMetricFamily(f"kvviz_{name}", doc, labels=["replica", "medium"])
            for (replica, medium), values in sorted(s.media.items()):
                c.add_metric([replica, medium], values[MEDIA_FIELDS.index(field)])
            yield c
        for name, doc, field in REPLICA:
            c = CounterMetricFamily(f"kvviz_{name}", doc, labels=["replica"])
            for replica, fig in s.replicas.items():
                c.add_metric([replica], getattr(fig, field))
            yield c
        yield from _replica_gauges(s)
        yield from _tenants(s)
        breaches = CounterMetricFamily("kvviz_kv_event_contract_breaches", "Breaches of the KV-event contract "
                                       "(kvviz lint's kinds but never_removes), linted as the stream arrives.",
                                       labels=["replica", "kind"])
        for (replica, kind), n in sorted(s.breaches.items()):
            breaches.add_metric([replica, kind], n)
        yield breaches
        yield CounterMetricFamily("kvviz_monitor_hashes_forgotten", "Block hashes whose first tenant the monitor "
                                  "no longer remembers (a later second tenant of one is not seen).",
                                  value=s.hashes_forgotten)
        yield CounterMetricFamily("kvviz_monitor_waiting_children_forgotten", "Stores whose parent was not "
                                  "cached, dropped from the monitor's bounded wait for that parent (a later store "
                                  "of it is not counted as parent_after_child).", value=s.children_forgotten)
        yield CounterMetricFamily("kvviz_monitor_dropped_slices", "Slices of the stream the monitor could not "
                                  "aggregate (logged).", value=s.dropped_slices)
        yield GaugeMetricFamily("kvviz_monitor_last_fold_timestamp_seconds", "When the figures were last brought "
                                "up to date.", value=s.taken)


def _replica_gauges(s: Snapshot) -> Iterator[Metric]:
    up = GaugeMetricFamily("kvviz_kv_event_publisher_connected", "1 while the publisher's socket is connected.",
                           labels=["replica"])
    lag = SummaryMetricFamily("kvviz_kv_event_lag_seconds", "From a batch's publisher timestamp to its arrival "
                              "(clock skew between the hosts included).", labels=["replica"])
    last = GaugeMetricFamily("kvviz_kv_event_last_timestamp_seconds", "The publisher's clock on its latest batch.",
                             labels=["replica"])
    capacity = GaugeMetricFamily("kvviz_kv_cache_capacity_blocks", "The replica's KV blocks, as given to the monitor "
                                 "(--capacity): events never say it.", labels=["replica"])
    for replica, fig in s.replicas.items():
        up.add_metric([replica], 1.0 if fig.connected else 0.0)
        lag.add_metric([replica], count_value=fig.lag_count, sum_value=fig.lag_sum_s)
        if fig.last_ts is not None:
            last.add_metric([replica], fig.last_ts)
        if fig.capacity_blocks is not None:
            capacity.add_metric([replica], fig.capacity_blocks)
    yield from (up, lag, last, capacity)


def _tenants(s: Snapshot) -> Iterator[Metric]:
    docs = {"stored_blocks": ("kv_tenant_blocks_stored", "New blocks stored under the tenant's salt."),
            "hit_blocks": ("kv_tenant_block_hits", "Hits (stores of cached blocks) under the tenant's salt."),
            "hit_tokens": ("prefix_cache_tenant_hit_tokens", "Hit tokens under the tenant's salt."),
            "miss_tokens": ("prefix_cache_tenant_miss_tokens", "Miss tokens under the tenant's salt.")}
    for i, field in enumerate(TENANT_FIELDS):
        name, doc = docs[field]
        c = CounterMetricFamily(f"kvviz_{name}", doc + " The busiest tenants are labelled (from when they were "
                                "labelled on); `other` holds the rest.", labels=["tenant"])
        for tenant, values in s.tenants.items():
            c.add_metric([tenant], values[i])
        yield c
    yield GaugeMetricFamily("kvviz_tenants_seen", "Distinct tenant salts tallied so far (bounded).",
                            value=s.tenants_seen)
    yield CounterMetricFamily("kvviz_tenant_untracked_blocks", "Stores and hits of tenants past the monitor's tenant "
                              "table (counted only in `other`).", value=s.tenants_untracked_stores)


def registry(snapshot: Callable[[], Snapshot]) -> CollectorRegistry:
    """A registry holding only the monitor's metrics."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector(snapshot))
    return reg
