"""One scrape for a pod of worker processes (`llm-gateway serve --workers N`): every worker's
families with a `worker` label added, and the parent's own two.

Each worker keeps its own registry. Summing them into one series would be wrong for some families
whatever the type says: a gauge that is the shared ledger's view (every worker reports the same
all-gateway figure) would count N times, and a counter of a worker that was restarted starts at
zero again, so the pod's sum would drop and Prometheus would read a reset of the whole. Labelled,
every family stays exact, and a query sums `without (worker)` where a pod's figure is meant.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families

WORKER_LABEL = "worker"


def merged(scrapes: Mapping[str, str]) -> list[Metric]:
    """The families of every worker's OpenMetrics scrape (`worker` name -> text), each sample
    labelled with its worker; a family keeps the order of its first appearance."""
    families: dict[str, Metric] = {}
    for worker, text in scrapes.items():
        for family in text_string_to_metric_families(text):  # type: ignore[no-untyped-call]
            into = families.get(family.name)
            if into is None:
                into = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = into
            into.samples.extend(
                s._replace(labels={**s.labels, WORKER_LABEL: worker}) for s in family.samples
            )
    return list(families.values())


def parent_families(running: int, restarts: int) -> list[Metric]:
    """The parent's own: how many workers serve, and how many it restarted after they died."""
    return [
        GaugeMetricFamily("llm_gateway_workers", "Worker processes serving.", value=running),
        CounterMetricFamily(
            "llm_gateway_worker_restarts",
            "Worker processes that died and were started again.",
            value=restarts,
        ),
    ]
