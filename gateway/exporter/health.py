"""Replica health: which replicas serve, which fail but stay, and why replicas were ejected."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.exporter.source import Scraped
from gateway.observability.registry import Declared

UP = Declared(
    GaugeMetricFamily,
    "llm_replica_up",
    "1 while a replica is in its pool, 0 while ejected.",
    ("pool", "replica"),
)
FAILING = Declared(
    GaugeMetricFamily,
    "llm_replica_failing",
    "1 while a replica stays in its pool though its last health.consecutive_failures"
    " requests or probes failed (a pool ejects at most max_ejection_percent of its"
    " replicas, never its last one), 0 otherwise.",
    ("pool", "replica"),
)
EJECTIONS = Declared(
    CounterMetricFamily,
    "llm_replica_ejections",
    "Replicas taken out of their pool.",
    ("pool", "replica", "reason"),
)


class HealthCollector(Scraped):
    declared = (UP, FAILING, EJECTIONS)

    def collect(self) -> list[Metric]:
        up, failing, ejections = UP(), FAILING(), EJECTIONS()
        for name, pool in self.source().slots.items():
            for replica in pool.replicas:
                up.add_metric([name, replica.url], 1 if replica.up else 0)
                failing.add_metric(
                    [name, replica.url], 1 if replica.failing(pool.spec.health) else 0
                )
            for (url, reason), count in pool.ejections.items():
                ejections.add_metric([name, url, reason], count)
        return [up, failing, ejections]
