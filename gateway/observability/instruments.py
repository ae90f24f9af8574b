"""The counters and histograms the request path observes into, in base units, with bounded
label values only.

Latency histograms and token counters are labelled {model, pool, class} where `model` is the name
the pool serves (never the client's free text); requests for LoRA adapters are also counted by
adapter, a name the adapter catalog knows. What is read from live state at scrape time instead
(in-flight, queues, replicas, tokenizer threads) is the exporter's: `exporter`.
These import no stage, pool or state, so every stage may import them.
"""

from __future__ import annotations

from prometheus_client import disable_created_metrics

from gateway.observability.fast import Counter, Histogram
from gateway.observability.loop_lag import LAG_BUCKETS
from gateway.observability.registry import Registry

E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90,
               120, 180, 300, 600)  # fmt: skip
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5,
                2, 3, 5, 7.5, 10, 20, 40, 80)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5)  # fmt: skip
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60,
                 120, 300)  # fmt: skip
# (objective - predicted) / objective: 1 is no latency at all, 0 the objective exactly, below 0 a
# miss predicted at the grant (-1: twice the objective). With negative buckets the family has no
# `_sum` and `_count` (prometheus-client leaves them out, as OpenMetrics says): `le="+Inf"` counts.
HEADROOM_BUCKETS = (-2, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.2, 0.3, 0.5, 0.75, 0.9)

# Every counter and histogram would also export a `_created` series (its creation time): a
# series per label set that no rule or dashboard reads. Process-wide, and before any is made.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus-client ships it untyped

NONE = "none"  # label value for requests refused before a pool was chosen
WORKLOAD = ("model", "pool", "class")


MAX_ADAPTER_LABELS = 512
OTHER = "other"  # the adapter label past MAX_ADAPTER_LABELS distinct ones


class Instruments:
    """One registry per gateway app, so tests and several apps in a process stay apart; the
    exporter's collectors join it (`gateway.exporter.export`)."""

    def __init__(self) -> None:
        self.registry = Registry()
        r = self.registry
        self.e2e = Histogram(
            "llm_request_e2e_seconds", "Arrival to last byte.", WORKLOAD, buckets=E2E_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "llm_request_ttft_seconds", "Arrival to first streamed token.", WORKLOAD,
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "llm_request_tpot_seconds", "Time per output token after the first.", WORKLOAD,
            buckets=TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "llm_queue_wait_seconds", "Time waiting for a replica slot, by tier too.",
            (*WORKLOAD, "tier"), buckets=QUEUE_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "llm_requests",
            "Requests by endpoint and outcome.",
            (*WORKLOAD, "endpoint", "code"),
            registry=r,
        )
        # Labelled only with adapters the catalog knows (the policy's and at most
        # adapters.MAX_PER_POOL discovered per pool): a client's unknown name is a 404 first.
        # Replicas that load and unload adapters for ever still end at MAX_ADAPTER_LABELS.
        self._adapter_labels: set[str] = set()
        self.adapter_requests = Counter(
            "llm_adapter_requests", "Requests for a LoRA adapter, by outcome.",
            ("pool", "adapter", "code"), registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "llm_rejections", "Requests refused by the gateway.", ("pool", "reason"), registry=r
        )
        self.input_tokens = Counter(
            "llm_input_tokens", "Prompt tokens of admitted requests.", WORKLOAD, registry=r
        )
        self.output_tokens = Counter(
            "llm_output_tokens", "Generated tokens streamed or returned.", WORKLOAD, registry=r
        )
        self.tenant_tokens = Counter(
            "llm_tenant_tokens", "Tokens of a tenant's served requests.", ("tenant", "direction"),
            registry=r,
        )  # fmt: skip
        self.quota_rejections = Counter(
            "llm_quota_rejections", "Requests refused by a tenant's TPM or RPM window.",
            ("tenant", "kind"), registry=r,
        )  # fmt: skip
        self.untrusted_usage = Counter(
            "llm_untrusted_usage",
            "Answers whose usage was not a count or more than the request could produce, settled"
            " on the gateway's own numbers instead.",
            ("pool", "replica", "field"), registry=r,
        )  # fmt: skip
        # Only for requests with a latency objective (a pool with `slo`), per objective they had
        # (`ttft`, `tpot`): gateway/request/account.py `_attainment`.
        self.slo_requests = Counter(
            "llm_slo_requests",
            "Requests with a latency objective, per objective: met or missed as observed, or"
            " refused for want of room.",
            ("pool", "tier", "objective", "outcome"), registry=r,
        )  # fmt: skip
        self.slo_headroom = Histogram(
            "llm_slo_predicted_headroom",
            "(objective - predicted) / objective on the replica that took the request, when it"
            " was granted.",
            ("pool", "objective"), buckets=HEADROOM_BUCKETS, registry=r,
        )  # fmt: skip
        self.spillover = Counter(
            "llm_spillover", "Requests moved from their route's full pool to a fallback.",
            ("route", "from_pool", "to_pool", "tier"), registry=r,
        )  # fmt: skip
        self.loop_lag = Histogram(
            "llm_event_loop_lag_seconds", "How late a periodic timer woke: the loop was held.",
            (), buckets=LAG_BUCKETS, registry=r,
        ).labels()  # fmt: skip

    def adapter_label(self, adapter: str) -> str:
        """`adapter` itself while fewer than MAX_ADAPTER_LABELS have been seen, else `other`."""
        labels = self._adapter_labels
        if adapter in labels or len(labels) < MAX_ADAPTER_LABELS:
            labels.add(adapter)
            return adapter
        return OTHER
