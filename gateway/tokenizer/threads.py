"""The threads long texts are tokenized on, and what they spent, for `/metrics`.

Counting is most of the gateway's CPU (docs/operations.md, "Sizing the gateway"), and when its
threads are all busy a request waits for one before it is admitted anywhere: latency grows with
no replica to blame. So each pool keeps, per job, the time it waited for a thread, the time a
thread was on it and that thread's CPU: `rate(busy) / threads` is how occupied the pool is (its
CPU can be lower: the threads share the pod's cores with the other pool and the event loop),
`rate(wait) / rate(jobs)` the mean wait. A job is counted when it ends, whether or not anyone
still awaits it (a client that left does not un-spend its thread), and a job dropped before it
started (its request was cancelled) with the wait it had, so the longest waits are not the ones
left out. The totals are plain numbers added under a lock; the scrape reads them without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


class CountingThreads:
    """A pool of `threads` threads for tokenizer work, with what its jobs spent."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        self.jobs = 0
        self.wait_s = 0.0  # from submission to a thread starting the job (or to its drop)
        self.busy_s = 0.0  # a thread on the job, start to end
        self.cpu_s = 0.0  # that thread's CPU meanwhile

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on one of the threads."""
        submitted = time.perf_counter()
        job = self._executor.submit(self._timed, submitted, work, args)
        job.add_done_callback(partial(self._dropped, submitted))
        return await asyncio.wrap_future(job)

    def _timed(self, submitted: float, work: Callable[..., T], args: tuple[Any, ...]) -> T:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return work(*args)
        finally:
            spent, ended = time.thread_time() - cpu, time.perf_counter()
            with self._lock:
                self.jobs += 1
                self.wait_s += started - submitted
                self.busy_s += ended - started
                self.cpu_s += spent

    def each(self, work: Callable[..., object], *args: Any, timeout_s: float = 5.0) -> None:
        """`work(*args)` once on every thread of the pool, waited for (never from the event
        loop). Each job waits at a barrier until every thread holds one, so no thread runs two;
        a thread busy past `timeout_s` breaks the barrier, and the jobs run wherever they are.
        Not counted as jobs: no request waited for them."""
        barrier = threading.Barrier(self.threads)

        def job() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(timeout_s)
            work(*args)

        for done in [self._executor.submit(job) for _ in range(self.threads)]:
            done.result()

    def _dropped(self, submitted: float, job: Future[Any]) -> None:
        if job.cancelled():  # never started: `_timed` counted nothing
            waited = time.perf_counter() - submitted
            with self._lock:
                self.jobs += 1
                self.wait_s += waited

    def shutdown(self) -> None:
        """Stop taking jobs; those not started are dropped, running ones end on their own."""
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class TokenizerThreads:
    """Two pools: `large` for texts of `server.large_tokenize_chars` or more, `small` for the
    rest, so huge prompts queue only behind each other."""

    small: CountingThreads
    large: CountingThreads

    @classmethod
    def start(cls, threads: int) -> TokenizerThreads:
        return cls(CountingThreads(threads, "tokenize"), CountingThreads(threads, "tokenize-large"))

    def shutdown(self) -> None:
        self.small.shutdown()
        self.large.shutdown()
