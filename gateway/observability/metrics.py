"""What `/metrics` exports, in base units, with bounded label values only.

Latency histograms and token counters are labelled {model, pool, class} where `model` is the name
the pool serves (never the client's free text); requests for LoRA adapters are also counted by
adapter, a name the adapter catalog knows. In-flight and queue gauges are read from the
admission state at scrape time, so they can never drift from the truth. So are the token
counters' prefix-cache lookups: plain ints the tokenizer threads add to under the cache's lock,
read here, never a Prometheus call per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import chain
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.admit import LivePool
from gateway.config.schema import COUNT_BY_CHARS, PRIORITIES
from gateway.observability.fast import Counter, Histogram
from gateway.observability.loop_lag import LAG_BUCKETS
from gateway.tokenizer.counters import HFCounter

if TYPE_CHECKING:
    from gateway.policy.compile import Policy

E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90,
               120, 180, 300, 600)  # fmt: skip
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5,
                2, 3, 5, 7.5, 10, 20, 40, 80)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5)  # fmt: skip
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60,
                 120, 300)  # fmt: skip

# Every counter and histogram would also export a `_created` series (its creation time): a
# series per label set that no rule or dashboard reads. Process-wide, and before any is made.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus-client ships it untyped

NONE = "none"  # label value for requests refused before a pool was chosen
WORKLOAD = ("model", "pool", "class")


class Source(Protocol):
    """What the scrape-time collector reads: the gateway's current state."""

    @property
    def slots(self) -> Mapping[str, LivePool]: ...

    @property
    def retiring(self) -> Mapping[str, LivePool]: ...

    @property
    def policy(self) -> Policy: ...

    reload_errors: int

    @property
    def tls_reload_errors(self) -> int: ...


class _Gauges(Collector):
    def __init__(self, source: Source) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        requests = GaugeMetricFamily(
            "llm_inflight_requests", "Requests in flight per replica.", labels=["pool", "replica"]
        )
        tokens = GaugeMetricFamily(
            "llm_inflight_tokens",
            "Input + expected output tokens admitted and in flight per replica.",
            labels=["pool", "replica"],
        )
        depth = GaugeMetricFamily(
            "llm_queue_depth", "Requests waiting per pool and tier.", labels=["pool", "tier"]
        )
        leases = GaugeMetricFamily(
            "llm_replica_leases",
            "Slots leased on a replica by all gateways sharing it, as the ledger last said.",
            labels=["pool", "replica"],
        )
        capacity = GaugeMetricFamily(
            "llm_pool_capacity",
            "Sum of the per-replica concurrency caps of the replicas in the pool.",
            labels=["pool"],
        )
        up = GaugeMetricFamily(
            "llm_replica_up", "1 while a replica is in its pool, 0 while ejected.",
            labels=["pool", "replica"],
        )  # fmt: skip
        failing = GaugeMetricFamily(
            "llm_replica_failing",
            "1 while a replica stays in its pool though its last health.consecutive_failures"
            " requests or probes failed (a pool ejects at most max_ejection_percent of its"
            " replicas, never its last one), 0 otherwise.",
            labels=["pool", "replica"],
        )
        ejections = CounterMetricFamily(
            "llm_replica_ejections", "Replicas taken out of their pool.",
            labels=["pool", "replica", "reason"],
        )  # fmt: skip
        # A pool a reload removed keeps its in-flight and queue gauges until its requests end.
        for name, pool in chain(self.source.slots.items(), self.source.retiring.items()):
            for replica in pool.replicas:
                requests.add_metric([name, replica.url], replica.inflight)
                tokens.add_metric([name, replica.url], replica.inflight_tokens)
            for tier, waiting in zip(PRIORITIES, pool.waiting_by_tier, strict=True):
                depth.add_metric([name, tier], waiting)
        for name, pool in self.source.slots.items():
            for replica in pool.replicas:
                up.add_metric([name, replica.url], 1 if replica.up else 0)
                failing.add_metric(
                    [name, replica.url], 1 if replica.failing(pool.spec.health) else 0
                )
            for (url, reason), count in pool.ejections.items():
                ejections.add_metric([name, url, reason], count)
            for replica in pool.replicas:
                if replica.shared is not None:
                    leases.add_metric([name, replica.url], replica.shared)
            capacity.add_metric([name], pool.capacity)
        drift = CounterMetricFamily(
            "llm_slot_drift",
            "Reconciliations that found this gateway counting more in flight than the replica.",
            labels=["pool", "replica", "kind"],
        )
        observed = GaugeMetricFamily(
            "llm_replica_observed_requests",
            "The replica's own running + waiting requests, as last read from its /metrics.",
            labels=["pool", "replica"],
        )
        for name, pool in self.source.slots.items():
            for (url, kind), count in pool.drift.items():
                drift.add_metric([name, url, kind], count)
            for replica in pool.replicas:
                if replica.observed is not None:
                    observed.add_metric([name, replica.url], replica.observed)
        shed = CounterMetricFamily(
            "llm_shed", "Requests shed by tier while their pool was saturated.",
            labels=["pool", "tier"],
        )  # fmt: skip
        for name, pool in self.source.slots.items():
            for tier, count in pool.sheds.items():
                shed.add_metric([name, tier], count)
        index = GaugeMetricFamily(
            "llm_prefix_index_blocks",
            "Prompt blocks the prefix scorer remembers sending to a replica (bounded per replica).",
            labels=["pool", "replica"],
        )
        blocks = CounterMetricFamily(
            "llm_prefix_blocks",
            "Prompt blocks of the requests sent with a prefix scorer (`sent`), and those the"
            " chosen replica had been sent before (`matched`): the gateway's estimate of the"
            " prefix-cache hit rate.",
            labels=["pool", "outcome"],
        )
        for name, pool in self.source.slots.items():
            prefix = getattr(pool.picker, "prefix", None)
            if prefix is None:
                continue
            for replica in pool.replicas:
                index.add_metric([name, replica.url], prefix.index.size(replica.url))
            blocks.add_metric([name, "sent"], prefix.blocks_sent)
            blocks.add_metric([name, "matched"], prefix.blocks_matched)
        held = GaugeMetricFamily(
            "llm_kv_event_blocks",
            "Token blocks a replica's vLLM says its prefix cache holds, from its KV-cache events.",
            labels=["pool", "replica"],
        )
        events = CounterMetricFamily(
            "llm_kv_events",
            "KV-cache events read per replica by kind (BlockStored, BlockRemoved,"
            " AllBlocksCleared; `gap`: sequence numbers skipped, the replica's blocks dropped;"
            " `unavailable`: no endpoint to follow yet; `disconnected`: the connection lost,"
            " the replica's blocks dropped; refused: `undecodable` batches or messages,"
            " `oversize` events (by bytes or blocks) or message parts, `oversize_batch` batches"
            " of too many events (the replica's blocks dropped), `invalid` events; `unknown`).",
            labels=["pool", "replica", "kind"],
        )
        precise_blocks = CounterMetricFamily(
            "llm_precise_prefix_blocks",
            "Token blocks of the requests sent with a `precise_prefix` scorer (`sent`), and those"
            " the chosen replica's engine held when it was picked (`matched`).",
            labels=["pool", "outcome"],
        )
        for name, pool in self.source.slots.items():
            precise = getattr(pool.picker, "precise", None)
            if precise is None:
                continue
            for url, engine in list(precise.blocks.items()):
                held.add_metric([name, url], len(engine))
            for (url, kind), count in list(precise.events.items()):
                events.add_metric([name, url, kind], count)
            precise_blocks.add_metric([name, "sent"], precise.blocks_sent)
            precise_blocks.add_metric([name, "matched"], precise.blocks_matched)
        desired = GaugeMetricFamily(
            "llm_pool_desired_replicas",
            "Replicas the pool's demand needs at its per-replica cap (busy + waiting + refused"
            " slot-seconds per second, smoothed): a target for the HPA.",
            labels=["pool"],
        )
        forecast = GaugeMetricFamily(
            "llm_pool_desired_replicas_forecast",
            "Replicas the pool's demand is forecast to need `startup_s` from now, when a replica"
            " started now could serve (Holt's trend on the same slot-seconds per second, damped,"
            " at most the pool's forecast.ceiling x the current level); it may be below"
            " llm_pool_desired_replicas, which stays the HPA's floor.",
            labels=["pool"],
        )
        for name, pool in self.source.slots.items():
            desired.add_metric([name], round(pool.demand.desired_replicas, 3))
            forecast.add_metric([name], round(pool.demand.desired_replicas_forecast, 3))
        backends = GaugeMetricFamily(
            "llm_token_counter_info",
            "The library that counts each model's prompts (1): fastokens, tokenizers (both exact:"
            " gateway/tokenizer/backends.py), or estimate (characters per token).",
            labels=["model", "backend"],
        )
        for name, model in self.source.policy.models.items():
            counter = model.counter
            backend = counter.backend if isinstance(counter, HFCounter) else COUNT_BY_CHARS
            backends.add_metric([name, backend], 1)
        tokenizer = self._tokenizer_threads()
        info = GaugeMetricFamily(
            "llm_policy_info", "The running policy, by the hash of its file.", labels=["hash"]
        )
        info.add_metric([self.source.policy.digest], 1)
        errors = CounterMetricFamily(
            "llm_policy_reload_errors", "Policy reloads refused (the running policy stayed)."
        )
        errors.add_metric([], self.source.reload_errors)
        tls = CounterMetricFamily(
            "llm_tls_reload_errors",
            "Renewed listener certificates that did not load (the running one stayed).",
        )
        tls.add_metric([], self.source.tls_reload_errors)
        return [requests, tokens, depth, leases, capacity, up, failing, ejections, drift, observed,
                shed, index, blocks, held, events, precise_blocks, desired, forecast, backends,
                *tokenizer, info, errors, tls]  # fmt: skip

    def _tokenizer_threads(self) -> list[Metric]:
        """The tokenizer pools' size, jobs, CPU and waits; none while no model tokenizes."""
        pools = self.source.policy.tokenizer_threads
        if pools is None:
            return []
        threads = GaugeMetricFamily(
            "llm_tokenizer_threads",
            "Threads of each tokenizer pool (`size`: `small` texts, or `large` ones of"
            " server.large_tokenize_chars or more); texts up to server.inline_tokenize_max_chars"
            " are counted on the event loop instead.",
            labels=["size"],
        )
        jobs = CounterMetricFamily(
            "llm_tokenizer_jobs",
            "Tokenizer jobs the pool ran, and those dropped before a thread took them (their"
            " request was cancelled).",
            labels=["size"],
        )
        wait = CounterMetricFamily(
            "llm_tokenizer_wait_seconds",
            "Time jobs waited for one of the pool's threads: over jobs, the mean wait a request"
            " spent before its count could start.",
            labels=["size"],
        )
        busy = CounterMetricFamily(
            "llm_tokenizer_busy_seconds",
            "Time the pool's threads were on a job: over llm_tokenizer_threads, how occupied the"
            " pool is (1: every thread always on a job).",
            labels=["size"],
        )
        cpu = CounterMetricFamily(
            "llm_tokenizer_cpu_seconds",
            "CPU the pool's threads spent on jobs: what counting long texts costs (texts up to"
            " server.inline_tokenize_max_chars are counted on the event loop, not here).",
            labels=["size"],
        )
        for size, pool in (("small", pools.small), ("large", pools.large)):
            threads.add_metric([size], pool.threads)
            jobs.add_metric([size], pool.jobs)
            wait.add_metric([size], pool.wait_s)
            busy.add_metric([size], pool.busy_s)
            cpu.add_metric([size], pool.cpu_s)
        return [threads, jobs, wait, busy, cpu]


MAX_ADAPTER_LABELS = 512
OTHER = "other"  # the adapter label past MAX_ADAPTER_LABELS distinct ones


class Metrics:
    """One registry per gateway app, so tests and several apps in a process stay apart."""

    def __init__(self, source: Source) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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
        self.spillover = Counter(
            "llm_spillover", "Requests moved from their route's full pool to a fallback.",
            ("route", "from_pool", "to_pool", "tier"), registry=r,
        )  # fmt: skip
        self.loop_lag = Histogram(
            "llm_event_loop_lag_seconds", "How late a periodic timer woke: the loop was held.",
            (), buckets=LAG_BUCKETS, registry=r,
        ).labels()  # fmt: skip
        r.register(_Gauges(source))

    def adapter_label(self, adapter: str) -> str:
        """`adapter` itself while fewer than MAX_ADAPTER_LABELS have been seen, else `other`."""
        labels = self._adapter_labels
        if adapter in labels or len(labels) < MAX_ADAPTER_LABELS:
            labels.add(adapter)
            return adapter
        return OTHER
