"""The engine's statistics and their Prometheus exposition under vLLM's own names.

Names, types, label names and bucket boundaries follow vLLM V1's Prometheus stat logger
(`vllm/v1/metrics/loggers.py`, buckets in `vllm/v1/metrics/buckets.py`): every series carries
`model_name` (the first served name) and `engine` ("0": one engine core per server), and
`vllm:request_success` also `finished_reason`. Counters are exposed with vLLM's `_total` suffix.

Every time is in simulated seconds (wall seconds x time scale). The engine updates plain
integers and bucket arrays; a collector renders them only when /metrics is scraped, so a step
costs no Prometheus calls, and a decode step of B sequences adds B inter-token observations
with one bucket increment.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM's `FINISH_REASON_STRINGS`: every `finished_reason` series exists from the start."""


class Histogram:
    """Cumulative-bucket histogram that takes a count with each observation."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.count = 0
        self.total = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.count += n
        self.total += value * n

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


class EngineStats:
    """What vLLM's IterationStats and finished-request stats accumulate, kept as totals."""

    __slots__ = (
        "e2e",
        "faults",
        "generation_tokens",
        "itl",
        "packed_chunks",
        "preemptions",
        "prefill_tokens_computed",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "prompt_tokens",
        "prompt_tokens_cached",
        "queue",
        "steps",
        "stream_chunks",
        "success",
        "ttft",
    )

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0  # of those, found in the prefix cache at first admission
        self.generation_tokens = 0
        # vLLM's PrefixCacheStats, recorded at each first admission: tokens looked up, found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefill_tokens_computed = 0  # every prefill chunk's tokens, recomputes included
        self.preemptions = 0
        self.steps = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.stream_chunks = 0
        self.packed_chunks = 0
        self.faults: dict[str, int] = {}


class EngineView(Protocol):
    """What the collector reads from a running engine."""

    @property
    def stats(self) -> EngineStats: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def time_scale(self) -> float: ...
    @property
    def slip_s(self) -> float: ...


class VllmCollector(Collector):
    """Renders one replica's engine as vLLM's /metrics would, plus a few `sim_` series."""

    def __init__(self, engine: EngineView, model_name: str) -> None:
        self.engine = engine
        self.labels = [model_name, "0"]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
        family.add_metric(self.labels, value)
        return family

    def _histogram(self, name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=["model_name", "engine"])
        family.add_metric(self.labels, hist.cumulative(), hist.total)
        return family

    def collect(self) -> Iterator[Metric]:
        engine, stats = self.engine, self.engine.stats
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            engine.num_running,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            engine.num_waiting,
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            engine.kv_cache_usage,
        )
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            stats.preemptions,
        )
        for name, help_text, value in (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
             stats.prompt_tokens_cached),
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             stats.prefix_cache_hits),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             stats.generation_tokens),
        ):  # fmt: skip
            yield self._counter(name, help_text, value)
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=["model_name", "engine", "source"],
        )
        cached = stats.prompt_tokens_cached
        for source, n in (
            ("local_compute", stats.prompt_tokens - cached),
            ("local_cache_hit", cached),
            ("external_kv_transfer", 0),
        ):
            by_source.add_metric([*self.labels, source], n)
        yield by_source
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["model_name", "engine", "finished_reason"],
        )
        for reason, n in stats.success.items():
            success.add_metric([*self.labels, reason], n)
        yield success
        yield self._histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            stats.ttft,
        )
        yield self._histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            stats.itl,
        )
        yield self._histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            stats.e2e,
        )
        yield self._histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            stats.queue,
        )
        yield from self._sim()

    def _sim(self) -> Iterator[Metric]:
        """The simulator's own series: what a report must say about how it was produced."""
        engine, stats = self.engine, self.engine.stats
        yield self._gauge("sim_time_scale", "Simulated seconds per wall second.", engine.time_scale)
        yield self._counter(
            "sim_clock_slip_seconds",
            "Simulated seconds lost because the engine fell behind the wall clock.",
            engine.slip_s,
        )
        yield self._counter("sim_engine_steps", "Engine steps simulated.", stats.steps)
        yield self._counter(
            "sim_prefill_tokens_computed",
            "Prompt tokens prefilled (not found in the prefix cache), recomputes included.",
            stats.prefill_tokens_computed,
        )
        yield self._counter("sim_stream_chunks", "SSE token chunks written.", stats.stream_chunks)
        yield self._counter(
            "sim_stream_packed_chunks",
            "SSE chunks that carried more than one token (stream interval under time scaling).",
            stats.packed_chunks,
        )
        faults = CounterMetricFamily(
            "sim_faults_injected",
            "Injected faults that fired, by kind.",
            labels=["model_name", "engine", "fault"],
        )
        for kind, n in sorted(stats.faults.items()):
            faults.add_metric([*self.labels, kind], n)
        yield faults
