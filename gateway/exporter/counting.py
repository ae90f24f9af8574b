"""How prompts are counted: each model's counting library, and the tokenizer threads' size,
jobs, CPU and waits.

The threads keep plain ints under their own lock, read here at scrape time: a Prometheus call
per job would race the event loop (`observability.fast` is for the loop's thread only). A gateway
whose models all count by characters has no tokenizer threads and exports none of their series.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.config.schema import COUNT_BY_CHARS
from gateway.exporter.source import Scraped
from gateway.observability.registry import Declared
from gateway.tokenizer.counters import HFCounter

BACKENDS = Declared(
    GaugeMetricFamily,
    "llm_token_counter_info",
    "The library that counts each model's prompts (1): fastokens, tokenizers (both exact:"
    " gateway/tokenizer/backends.py), or estimate (characters per token).",
    ("model", "backend"),
)
THREADS = Declared(
    GaugeMetricFamily,
    "llm_tokenizer_threads",
    "Threads of each tokenizer pool (`size`: `small` texts, or `large` ones of"
    " server.large_tokenize_chars or more); texts up to server.inline_tokenize_max_chars"
    " are counted on the event loop instead.",
    ("size",),
)
JOBS = Declared(
    CounterMetricFamily,
    "llm_tokenizer_jobs",
    "Tokenizer jobs the pool ran, and those dropped before a thread took them (their"
    " request was cancelled).",
    ("size",),
)
WAIT = Declared(
    CounterMetricFamily,
    "llm_tokenizer_wait_seconds",
    "Time jobs waited for one of the pool's threads: over jobs, the mean wait a request"
    " spent before its count could start.",
    ("size",),
)
BUSY = Declared(
    CounterMetricFamily,
    "llm_tokenizer_busy_seconds",
    "Time the pool's threads were on a job: over llm_tokenizer_threads, how occupied the"
    " pool is (1: every thread always on a job).",
    ("size",),
)
CPU = Declared(
    CounterMetricFamily,
    "llm_tokenizer_cpu_seconds",
    "CPU the pool's threads spent on jobs: what counting long texts costs (texts up to"
    " server.inline_tokenize_max_chars are counted on the event loop, not here).",
    ("size",),
)


class CountingCollector(Scraped):
    declared = (BACKENDS, THREADS, JOBS, WAIT, BUSY, CPU)

    def collect(self) -> list[Metric]:
        policy = self.source().policy
        backends = BACKENDS()
        for name, model in policy.models.items():
            counter = model.counter
            backend = counter.backend if isinstance(counter, HFCounter) else COUNT_BY_CHARS
            backends.add_metric([name, backend], 1)
        pools = policy.tokenizer_threads
        if pools is None:
            return [backends]
        threads, jobs, wait, busy, cpu = THREADS(), JOBS(), WAIT(), BUSY(), CPU()
        for size, pool in (("small", pools.small), ("large", pools.large)):
            threads.add_metric([size], pool.threads)
            jobs.add_metric([size], pool.jobs)
            wait.add_metric([size], pool.wait_s)
            busy.add_metric([size], pool.busy_s)
            cpu.add_metric([size], pool.cpu_s)
        return [backends, threads, jobs, wait, busy, cpu]
