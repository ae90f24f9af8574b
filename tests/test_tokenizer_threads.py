"""The tokenizer's thread pools keep what their jobs spent: CPU, and the wait for a thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.tokenizer_threads import CountingThreads


async def test_a_job_that_waits_for_the_only_thread_is_counted_with_its_wait() -> None:
    pool = CountingThreads(1, "tokenize-test")
    release = threading.Event()
    try:
        first = asyncio.ensure_future(pool.run(release.wait, 5.0))
        second = asyncio.ensure_future(pool.run(sum, range(100_000)))
        await asyncio.sleep(0.05)  # the second job is queued behind the first all this time
        release.set()
        assert await first is True
        assert await second == sum(range(100_000))
    finally:
        pool.shutdown()
    assert pool.threads == 1 and pool.jobs == 2
    assert pool.wait_s >= 0.05  # the second job could not start before the first ended
    assert pool.cpu_s > 0


async def test_a_job_that_fails_still_spent_its_thread() -> None:
    pool = CountingThreads(1, "tokenize-test")
    try:
        with pytest.raises(ZeroDivisionError):
            await pool.run(lambda: 1 / 0)
    finally:
        pool.shutdown()
    assert pool.jobs == 1
