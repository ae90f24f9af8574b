"""The event-loop counters and histograms export exactly what prometheus-client's own classes do."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.observability import fast as loopmetrics
from gateway.observability.instruments import E2E_BUCKETS
from gateway.observability.loop_lag import LAG_BUCKETS

VALUES = (0.0, 0.001, 0.01, 0.0100001, 0.5, 1, 1.0000001, 42.0, 600, 601, 1e9)


def test_a_histogram_scrapes_as_prometheus_clients_own() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = prometheus_client.Histogram(
        "llm_request_e2e_seconds", "Arrival to last byte.", ("model", "pool"),
        buckets=E2E_BUCKETS, registry=theirs,
    )  # fmt: skip
    lean = loopmetrics.Histogram(
        "llm_request_e2e_seconds", "Arrival to last byte.", ("model", "pool"),
        registry=ours, buckets=E2E_BUCKETS,
    )  # fmt: skip
    for labels in (("m", "a"), ('quote"and\\slash', "b")):
        for value in VALUES:
            reference.labels(*labels).observe(value)
            lean.labels(*labels).observe(value)
    reference.labels("only", "made")
    lean.labels("only", "made")
    assert generate_latest(ours) == generate_latest(theirs)


def test_an_unlabelled_histogram_and_a_counter_scrape_as_prometheus_clients_own() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    lag = prometheus_client.Histogram("lag_seconds", "Lag.", buckets=LAG_BUCKETS, registry=theirs)
    lean_lag = loopmetrics.Histogram("lag_seconds", "Lag.", (), ours, LAG_BUCKETS).labels()
    requests = prometheus_client.Counter("llm_requests", "Requests.", ("code",), registry=theirs)
    lean_requests = loopmetrics.Counter("llm_requests", "Requests.", ("code",), ours)
    assert generate_latest(ours) == generate_latest(theirs)  # before anything is recorded
    for value in VALUES:
        lag.observe(value)
        lean_lag.observe(value)
    for code, amount in (("200", 1), ("200", 4096), ("429", 1), ("200", 0.5)):
        requests.labels(code).inc(amount)
        lean_requests.labels(code).inc(amount)
    assert generate_latest(ours) == generate_latest(theirs)


def test_misuse_is_refused_as_prometheus_client_refuses_it() -> None:
    registry = CollectorRegistry()
    counter = loopmetrics.Counter("c", "C.", ("a", "b"), registry)
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("only-one")
    with pytest.raises(ValueError, match="only goes up"):
        counter.labels("x", "y").inc(-1)
    with pytest.raises(ValueError, match="increasing"):
        loopmetrics.Histogram("h", "H.", (), registry, (1, 0.5))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        loopmetrics.Counter("c", "Again.", (), registry)
