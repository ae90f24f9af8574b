"""The attainment signal as prometheus-adapter serves it to an HPA (deploy/prometheus-adapter):
`llm_pool_slo_miss_ratio`, the share of a pool's objective observations over the last two minutes
that were not met, the refused ones included (docs/operations.md, "SLO attainment"), read from
the gateway's `llm_slo_requests_total` as Prometheus would: the increase between the first and
the last scrape inside the window.

An HPA holds it to a `Value` target, the miss share its objective allows (1 - the attainment
target): at twice the allowed share it asks for twice the ready replicas. Nothing met or missed
in the window reads 0, as the adapter's query does; fewer than two scrapes in it read nothing
(a rate needs two samples), and an HPA that cannot read a metric does not scale down.
"""

from __future__ import annotations

from collections import deque

from prometheus_client.parser import text_string_to_metric_families

SLO_REQUESTS = "llm_slo_requests_total"
SLO_MISS = "llm_pool_slo_miss_ratio"
WINDOW_S = 120.0  # the adapter rule's [2m]

Counts = dict[str, tuple[float, float]]  # pool -> (met, all) so far


def slo_counts(text: str) -> Counts:
    """Per pool, the requests' objective observations met and in all, from an exposition."""
    out: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != SLO_REQUESTS:
                continue
            met, total = out.get(sample.labels["pool"], (0.0, 0.0))
            met += sample.value if sample.labels["outcome"] == "met" else 0.0
            out[sample.labels["pool"]] = (met, total + sample.value)
    return out


class MissRatio:
    """What Prometheus keeps of the counts, scrape by scrape, and the ratio over the window."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._scrapes: deque[tuple[float, Counts]] = deque()

    def scraped(self, t_s: float, counts: Counts) -> None:
        self._scrapes.append((t_s, counts))
        while self._scrapes and self._scrapes[0][0] <= t_s - self.window_s:
            self._scrapes.popleft()

    def value(self, pool: str, now_s: float) -> float | None:
        """The ratio a query at `now_s` returns: over the scrapes in (now - window, now]."""
        since = now_s - self.window_s
        seen = [c[pool] for t_s, c in self._scrapes if since < t_s <= now_s and pool in c]
        if len(seen) < 2:
            return None
        (met_0, all_0), (met_1, all_1) = seen[0], seen[-1]
        observed = all_1 - all_0
        return 0.0 if observed <= 0 else (observed - (met_1 - met_0)) / observed
