"""The gateway's metrics registry, in which every collector declares its families up front.

prometheus-client asks a collector for its names when it is registered: from `describe` if it has
one, else by scraping it. A collector of live state scraped while the gateway is still being built
would read what is not there yet; a declared one answers with its families' names, types, help
and labels and reads nothing. The declarations are also what docs/metrics-reference.md lists
(`gateway.exporter.reference`), so the reference is this registry's content, not a second
list kept by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

Family = TypeVar("Family", bound=Metric)


@dataclass(frozen=True)
class Declared(Generic[Family]):
    """A family said once: called, an empty one for a scrape to fill."""

    kind: Callable[..., Family]  # GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily
    name: str  # as prometheus-client takes it: a counter's without `_total`
    help: str
    labels: tuple[str, ...] = ()

    def __call__(self) -> Family:
        return self.kind(self.name, self.help, labels=self.labels)


class Declaring(Collector):
    """A collector whose families are known before its first scrape."""

    declared: Sequence[Declared[Any]]

    def describe(self) -> list[Metric]:
        return [declared() for declared in self.declared]


class Registry(CollectorRegistry):
    """prometheus-client's registry, taking only declaring collectors and keeping their order."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self.collectors: list[Declaring] = []

    def register(self, collector: Collector) -> None:
        if not isinstance(collector, Declaring):
            raise TypeError(f"{type(collector).__name__} declares no families: see Declaring")
        super().register(collector)
        self.collectors.append(collector)

    def declared(self) -> Iterator[Declared[Any]]:
        """Every family registered, in the order a scrape exports them."""
        for collector in self.collectors:
            yield from collector.declared
