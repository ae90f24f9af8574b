"""Counters and histograms written only from the event loop, exported by prometheus-client.

prometheus-client's own `Histogram.observe` takes a lock per value it updates and walks the
buckets in Python, and a request records five or more values. Every write here comes from the
event loop's thread, and `/metrics` collects on that same thread, so no lock is needed: a
child is a list of bucket counts found by `bisect`, or a number. The
exposition is prometheus-client's, from the families built at scrape time, so the names, `_total`
and `_bucket`/`_sum`/`_count` series and `le` values are exactly what its classes export.

Not for threads: a tokenizer thread that counted here would race the loop. Those keep plain ints
under their own lock, read at scrape time (`gateway/exporter/counting.py`).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate
from typing import Any, Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, Exemplar, HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from gateway.observability.registry import Declared, Declaring

Child = TypeVar("Child")
Family = TypeVar("Family", bound=Metric)


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up; asked to add {amount}")
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "exemplars", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        # Per bucket, the last traced value's trace: made on the first (tracing off: never).
        self.exemplars: list[Exemplar | None] | None = None

    def observe(self, value: float, trace_id: str | None = None) -> None:
        # The first bound >= value: Prometheus's `le`.
        bucket = bisect_left(self._bounds, value)
        self.counts[bucket] += 1
        self.sum += value
        if trace_id is not None:
            if self.exemplars is None:
                self.exemplars = [None] * len(self.counts)
            self.exemplars[bucket] = Exemplar({"trace_id": trace_id}, value, time.time())


class _Family(Declaring, Generic[Child, Family]):
    """Children by label values, made on first use; a family of them built at scrape time."""

    kind: type[Family]

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.family = Declared(self.kind, name, documentation, tuple(labelnames))
        self.declared = (self.family,)
        self._children: dict[tuple[str, ...], Child] = {}
        registry.register(self)

    def labels(self, *values: str) -> Child:
        child = self._children.get(values)
        if child is None:
            labelnames = self.family.labels
            if len(values) != len(labelnames):
                raise ValueError(f"{self.family.name} takes labels {labelnames}, got {values}")
            child = self._children[values] = self._new_child()
        return child

    # What a kind of metric says for itself: its child, a child's samples.
    @abstractmethod
    def _new_child(self) -> Child: ...

    @abstractmethod
    def _add(self, family: Family, values: tuple[str, ...], child: Child) -> None: ...

    def collect(self) -> list[Metric]:
        family = self.family()
        for values, child in list(self._children.items()):
            self._add(family, values, child)
        return [family]


class Counter(_Family[CounterChild, CounterMetricFamily]):
    """A labelled counter; `name` without `_total`, as prometheus-client's `Counter` takes it."""

    kind = CounterMetricFamily

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def _add(
        self, family: CounterMetricFamily, values: tuple[str, ...], child: CounterChild
    ) -> None:
        family.add_metric(values, child.value)


class Histogram(_Family[HistogramChild, HistogramMetricFamily]):
    """A labelled histogram with fixed buckets (+Inf added)."""

    kind = HistogramMetricFamily

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        if not buckets or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{name}: buckets must be increasing, got {buckets}")
        super().__init__(name, documentation, labelnames, registry)
        self._bounds = tuple(float(b) for b in buckets)
        go_string = floatToGoString  # prometheus-client ships it untyped
        self._le = [go_string(b) for b in self._bounds] + ["+Inf"]  # type: ignore[no-untyped-call]

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def _add(
        self, family: HistogramMetricFamily, values: tuple[str, ...], child: HistogramChild
    ) -> None:
        buckets: list[Any] = list(zip(self._le, accumulate(child.counts), strict=True))
        if child.exemplars is not None:  # shown by the OpenMetrics exposition only
            buckets = [
                (le, count) if exemplar is None else (le, count, exemplar)
                for (le, count), exemplar in zip(buckets, child.exemplars, strict=True)
            ]
        family.add_metric(values, buckets, child.sum)
