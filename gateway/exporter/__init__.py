"""The exporter: collectors that read the running gateway's live state at each scrape, one module
per concern, all registered from `COLLECTORS`.

They sit above admission (they read live pools, replicas, scorers, the state backend); the
instruments the request path observes into (`observability.instruments`) sit below every stage.
A new signal is a `Declared` family filled by one of these, or a new module and its line here.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.exporter.adaptive import AdaptiveCollector
from gateway.exporter.backend import BackendCollector
from gateway.exporter.counting import CountingCollector
from gateway.exporter.demand import DemandCollector
from gateway.exporter.health import HealthCollector
from gateway.exporter.prefix import PrefixCollector
from gateway.exporter.reloads import ReloadsCollector
from gateway.exporter.slots import SlotsCollector
from gateway.exporter.source import Scraped, Source
from gateway.observability.registry import Registry

# In the order a scrape exports them (after the instruments).
COLLECTORS: tuple[type[Scraped], ...] = (
    SlotsCollector, AdaptiveCollector, HealthCollector, PrefixCollector, DemandCollector,
    CountingCollector, ReloadsCollector, BackendCollector,
)  # fmt: skip


def export(registry: Registry, source: Callable[[], Source]) -> None:
    """Every collector in `registry`, reading `source()` when scraped."""
    for collector in COLLECTORS:
        registry.register(collector(source))
