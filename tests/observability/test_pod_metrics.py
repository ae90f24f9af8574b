"""A pod's one scrape (gateway/exporter/workers.py): every worker's families, labelled, in either
format a scraper asks for, with histograms and gauges exact per worker."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from gateway.exporter.workers import merged, parent_families
from gateway.server.exposition import Families


def _worker(requests: int, latencies: list[float], leases: float) -> str:
    """A worker's scrape as the parent reads it (OpenMetrics), from a registry of its own."""
    registry = CollectorRegistry()
    counter = Counter("llm_requests", "Requests.", ["code"], registry=registry)
    counter.labels("200").inc(requests)
    histogram = Histogram("llm_e2e_seconds", "E2E.", buckets=(0.1, 1.0), registry=registry)
    for latency in latencies:
        histogram.observe(latency)
    Gauge("llm_replica_leases", "All gateways' leases.", registry=registry).set(leases)
    return openmetrics.generate_latest(registry).decode()  # type: ignore[no-untyped-call]


def _samples(
    text: str, openmetrics_format: bool
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    parse = openmetrics_families if openmetrics_format else text_string_to_metric_families
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parse(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_each_workers_series_is_kept_whole_under_its_worker_label_in_both_formats() -> None:
    scrapes = {"0": _worker(3, [0.05, 0.5, 5.0], 7), "1": _worker(2, [0.05, 0.05], 7)}
    families = Families([*merged(scrapes), *parent_families(running=2, restarts=1)])
    for om in (False, True):
        text = (openmetrics.generate_latest(families) if om else generate_latest(families)).decode()  # type: ignore[no-untyped-call]
        found = _samples(text, om)
        assert found[("llm_requests_total", (("code", "200"), ("worker", "0")))] == 3
        assert found[("llm_requests_total", (("code", "200"), ("worker", "1")))] == 2
        # A histogram is exact per worker: its buckets, count and sum as that worker had them.
        assert found[("llm_e2e_seconds_bucket", (("le", "0.1"), ("worker", "0")))] == 1
        assert found[("llm_e2e_seconds_bucket", (("le", "1.0"), ("worker", "0")))] == 2
        assert found[("llm_e2e_seconds_bucket", (("le", "+Inf"), ("worker", "0")))] == 3
        assert found[("llm_e2e_seconds_bucket", (("le", "0.1"), ("worker", "1")))] == 2
        assert found[("llm_e2e_seconds_count", (("worker", "1"),))] == 2
        assert found[("llm_e2e_seconds_sum", (("worker", "0"),))] == 5.55
        # The ledger's view, the same figure in both: labelled, never summed to twice the leases.
        assert found[("llm_replica_leases", (("worker", "0"),))] == 7
        assert found[("llm_replica_leases", (("worker", "1"),))] == 7
        assert found[("llm_gateway_workers", ())] == 2
        assert found[("llm_gateway_worker_restarts_total", ())] == 1
        # Each family once, its samples together, as both formats require.
        heads = [line for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(heads) == len(set(heads))


def test_a_worker_missing_from_a_scrape_leaves_only_its_own_series_out() -> None:
    families = Families(merged({"1": _worker(2, [0.05], 7)}))
    found = _samples(generate_latest(families).decode(), False)
    assert {labels for name, labels in found if name == "llm_requests_total"} == {
        (("code", "200"), ("worker", "1"))
    }
