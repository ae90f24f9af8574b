"""Each pool's demand in replicas: the HPA's target, now and forecast for when a replica started
now could serve."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily, Metric

from gateway.exporter.source import Scraped
from gateway.observability.registry import Declared

DESIRED = Declared(
    GaugeMetricFamily,
    "llm_pool_desired_replicas",
    "Replicas the pool's demand needs at its per-replica cap in force (busy + waiting + refused"
    " slot-seconds per second, smoothed): a target for the HPA.",
    ("pool",),
)
FORECAST = Declared(
    GaugeMetricFamily,
    "llm_pool_desired_replicas_forecast",
    "Replicas the pool's demand is forecast to need `startup_s` from now, when a replica"
    " started now could serve (Holt's trend on the same slot-seconds per second, damped,"
    " at most the pool's forecast.ceiling x the current level); it may be below"
    " llm_pool_desired_replicas, which stays the HPA's floor.",
    ("pool",),
)


class DemandCollector(Scraped):
    declared = (DESIRED, FORECAST)

    def collect(self) -> list[Metric]:
        desired, forecast = DESIRED(), FORECAST()
        for name, pool in self.source().slots.items():
            desired.add_metric([name], round(pool.demand.desired_replicas, 3))
            forecast.add_metric([name], round(pool.demand.desired_replicas_forecast, 3))
        return [desired, forecast]
