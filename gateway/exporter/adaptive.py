"""Adaptive caps (`gateway/admit/limiter.py`): each replica's limit in force, and why they moved."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.exporter.source import Scraped
from gateway.observability.registry import Declared

CAP = Declared(
    GaugeMetricFamily,
    "llm_replica_adaptive_cap",
    "A replica's concurrency cap in force, moved by its pool's adaptive caps (slo.adaptive)"
    " between their floor and max_concurrency to hold its latency target.",
    ("pool", "replica"),
)
MOVES = Declared(
    CounterMetricFamily,
    "llm_adaptive_cap_moves",
    "Moves of a pool's adaptive caps, by reason: grow (under the target by the margin, the"
    " replica at its cap), ttft_over or tpot_over (the window's quantile over its target).",
    ("pool", "reason"),
)


class AdaptiveCollector(Scraped):
    declared = (CAP, MOVES)

    def collect(self) -> list[Metric]:
        cap, moves = CAP(), MOVES()
        for name, pool in self.source().slots.items():
            if pool.limiter is None:
                continue
            for url, limit in pool.limiter.limits().items():
                cap.add_metric([name, url], limit)
            for reason, count in pool.limiter.moves.items():
                moves.add_metric([name, reason], count)
        return [cap, moves]
