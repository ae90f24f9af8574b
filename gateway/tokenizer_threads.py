"""The threads long texts are tokenized on, and what they spent, for `/metrics`.

Counting is most of the gateway's CPU (docs/operations.md, "Sizing the gateway"), and when its
threads are all busy a request waits for one before it is admitted anywhere: latency grows with
no replica to blame. So each pool keeps the thread CPU its jobs spent and how long they waited
for a thread; `rate(cpu) / threads` is how busy the pool is, `rate(wait) / rate(jobs)` the mean
wait. The totals are plain numbers the worker threads add to under a lock, at the end of every
job, whether or not anyone still awaits its result (a client that left does not un-spend its
thread's CPU); the scrape reads them without the lock.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


class CountingThreads:
    """A pool of `threads` threads for tokenizer work, with what its jobs spent."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        self.jobs = 0
        self.cpu_s = 0.0  # thread CPU the jobs ran for
        self.wait_s = 0.0  # from submission to a thread starting the job

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on one of the threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._timed, time.perf_counter(), work, args
        )

    def _timed(self, submitted: float, work: Callable[..., T], args: tuple[Any, ...]) -> T:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return work(*args)
        finally:
            spent = time.thread_time() - cpu
            with self._lock:
                self.jobs += 1
                self.cpu_s += spent
                self.wait_s += started - submitted

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
