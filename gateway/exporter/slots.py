"""Slots and queues: what each replica has in flight, what waits, what was shed or preempted,
and how this gateway's count compares with the replica's own and with the other gateways' leases.

In-flight and queue gauges are read from the admission state at scrape time, so they can never
drift from the truth; a pool a reload removed keeps them until its requests end.
"""

from __future__ import annotations

from itertools import chain

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.config.schema import PRIORITIES
from gateway.exporter.source import Scraped
from gateway.observability.registry import Declared

REPLICA = ("pool", "replica")
REQUESTS = Declared(
    GaugeMetricFamily, "llm_inflight_requests", "Requests in flight per replica.", REPLICA
)
TOKENS = Declared(
    GaugeMetricFamily,
    "llm_inflight_tokens",
    "Input + expected output tokens admitted and in flight per replica.",
    REPLICA,
)
DEPTH = Declared(
    GaugeMetricFamily, "llm_queue_depth", "Requests waiting per pool and tier.", ("pool", "tier")
)
LEASES = Declared(
    GaugeMetricFamily,
    "llm_replica_leases",
    "Slots leased on a replica by all gateways sharing it, as the ledger last said.",
    REPLICA,
)
CAPACITY = Declared(
    GaugeMetricFamily,
    "llm_pool_capacity",
    "Sum of the per-replica concurrency caps in force (with adaptive caps, their limits) of the"
    " replicas in the pool.",
    ("pool",),
)
DRIFT = Declared(
    CounterMetricFamily,
    "llm_slot_drift",
    "Reconciliations that found this gateway counting more in flight than the replica.",
    ("pool", "replica", "kind"),
)
OBSERVED = Declared(
    GaugeMetricFamily,
    "llm_replica_observed_requests",
    "The replica's own running + waiting requests, as last read from its /metrics.",
    REPLICA,
)
SHED = Declared(
    CounterMetricFamily,
    "llm_shed",
    "Requests shed by tier while their pool was saturated.",
    ("pool", "tier"),
)
PREEMPTED = Declared(
    CounterMetricFamily,
    "llm_preemptions",
    "Requests in flight cancelled, by their tier, to make room for critical ones (slo.preempt).",
    ("pool", "tier"),
)
# The latency model's view of what runs on a replica (gateway/admit/latency.py), on a pool with
# `slo`: what its TTFT and TPOT predictions are made from, and each back to 0 when it is idle.
PREFILL = Declared(
    GaugeMetricFamily,
    "llm_replica_prefill_tokens",
    "Uncached prompt tokens of the requests granted on a replica and still before their first"
    " token, as its pool's latency model counts them (pools with slo).",
    REPLICA,
)
DECODING = Declared(
    GaugeMetricFamily,
    "llm_replica_decoding",
    "Requests granted on a replica past their first token, as its pool's latency model counts"
    " them (pools with slo).",
    REPLICA,
)


class SlotsCollector(Scraped):
    declared = (
        REQUESTS, TOKENS, DEPTH, LEASES, CAPACITY, DRIFT, OBSERVED, SHED, PREEMPTED, PREFILL,
        DECODING,
    )  # fmt: skip

    def collect(self) -> list[Metric]:
        source = self.source()
        requests, tokens, depth, leases = REQUESTS(), TOKENS(), DEPTH(), LEASES()
        capacity, drift, observed, shed = CAPACITY(), DRIFT(), OBSERVED(), SHED()
        preempted, prefill, decoding = PREEMPTED(), PREFILL(), DECODING()
        for name, pool in chain(source.slots.items(), source.retiring.items()):
            for replica in pool.replicas:
                requests.add_metric([name, replica.url], replica.inflight)
                tokens.add_metric([name, replica.url], replica.inflight_tokens)
                if pool.latency is not None and (state := replica.latency) is not None:
                    prefill.add_metric([name, replica.url], state.prefill_tokens)
                    decoding.add_metric([name, replica.url], state.decoding)
            for tier, waiting in zip(PRIORITIES, pool.waiting_by_tier, strict=True):
                depth.add_metric([name, tier], waiting)
        for name, pool in source.slots.items():
            for replica in pool.replicas:
                if replica.shared is not None:
                    leases.add_metric([name, replica.url], replica.shared)
                if replica.observed is not None:
                    observed.add_metric([name, replica.url], replica.observed)
            capacity.add_metric([name], pool.capacity)
            for (url, kind), count in pool.drift.items():
                drift.add_metric([name, url, kind], count)
            for tier, count in pool.sheds.items():
                shed.add_metric([name, tier], count)
            for tier, count in pool.preemptions.items():
                preempted.add_metric([name, tier], count)
        return [
            requests, tokens, depth, leases, capacity, drift, observed, shed, preempted, prefill,
            decoding,
        ]  # fmt: skip
