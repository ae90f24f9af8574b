"""`Backend`: the state backend's health and mode as Prometheus gauges, read at each scrape.

Here rather than in gateway/state/ so the state stays free of the metrics library: the collector
reads what the state exposes (`up`, `on_failure`), the state knows nothing of being scraped.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily, Metric

from gateway.observability.collectors.source import Scraped
from gateway.observability.registry import Declared
from gateway.state.failover import FailoverState

UP = Declared(
    GaugeMetricFamily,
    "llm_state_backend_up",
    "1: the policy's state backend serves (always with `backend: memory`); 0: Redis"
    " failed and limits are local or refused (llm_state_mode says which).",
)
MODE = Declared(
    GaugeMetricFamily,
    "llm_state_mode",
    "1 for the mode in force: memory (one gateway), shared (Redis), local (Redis failed:"
    " 1/gateways of every limit and cap) or refusing (Redis failed: 503).",
    ("mode",),
)


class Backend(Scraped):
    """`llm_state_backend_up`: 1 while the policy's state backend serves (always, in memory),
    0 while a Redis failure has the gateway on local limits or 503s; `llm_state_mode` names the
    mode in force, so a dashboard shows which limits apply without reading the policy."""

    declared = (UP, MODE)

    def collect(self) -> list[Metric]:
        state = self.source().state
        up, mode = UP(), MODE()
        up.add_metric([], 1 if getattr(state, "up", True) else 0)
        if not isinstance(state, FailoverState):
            current = "memory"
        elif state.up:
            current = "shared"
        else:
            current = "local" if state.on_failure == "open" else "refusing"
        for name in ("memory", "shared", "local", "refusing"):
            mode.add_metric([name], 1 if name == current else 0)
        return [up, mode]
