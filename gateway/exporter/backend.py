"""`BackendCollector`: the state backend's health and mode as Prometheus gauges, read at each scrape.

Here rather than in gateway/state/ so the state stays free of the metrics library: the collector
asks the state its `mode()`, the state knows nothing of being scraped, and the collector nothing
of which backend runs.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily, Metric

from gateway.exporter.source import Scraped
from gateway.observability.registry import Declared
from gateway.state.base import MODES, SERVING

UP = Declared(
    GaugeMetricFamily,
    "llm_state_backend_up",
    "1: the policy's state backend serves (always with `backend: memory`); 0: the shared"
    " backend failed and limits are local or refused (llm_state_mode says which).",
)
MODE = Declared(
    GaugeMetricFamily,
    "llm_state_mode",
    "1 for the mode in force: memory (one gateway), shared (the shared backend answers),"
    " local (it failed: 1/gateways of every limit and cap) or refusing (it failed: 503).",
    ("mode",),
)


class BackendCollector(Scraped):
    """`llm_state_backend_up`: 1 while the policy's state backend serves (always, in memory),
    0 while a backend failure has the gateway on local limits or 503s; `llm_state_mode` names
    the mode in force, so a dashboard shows which limits apply without reading the policy."""

    declared = (UP, MODE)

    def collect(self) -> list[Metric]:
        current = self.source().state.mode()
        up, mode = UP(), MODE()
        up.add_metric([], 1 if current in SERVING else 0)
        for name in MODES:
            mode.add_metric([name], 1 if name == current else 0)
        return [up, mode]
