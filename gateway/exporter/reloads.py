"""The running policy, and the reloads refused while it stayed: the policy's and the listener
certificate's."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.exporter.source import Scraped
from gateway.observability.registry import Declared

INFO = Declared(
    GaugeMetricFamily, "llm_policy_info", "The running policy, by the hash of its file.", ("hash",)
)
ERRORS = Declared(
    CounterMetricFamily,
    "llm_policy_reload_errors",
    "Policy reloads refused (the running policy stayed).",
)
TLS = Declared(
    CounterMetricFamily,
    "llm_tls_reload_errors",
    "Renewed listener certificates that did not load (the running one stayed).",
)


class ReloadsCollector(Scraped):
    declared = (INFO, ERRORS, TLS)

    def collect(self) -> list[Metric]:
        source = self.source()
        info, errors, tls = INFO(), ERRORS(), TLS()
        info.add_metric([source.policy.digest], 1)
        errors.add_metric([], source.reload_errors)
        tls.add_metric([], source.tls_reload_errors)
        return [info, errors, tls]
