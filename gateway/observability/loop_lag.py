"""How late the event loop wakes up: the one symptom every loop-blocking bug shares.

A timer sleeps a fixed interval and records by how much it overslept. Anything that holds the loop
(a huge body parsed inline, a tokenizer call that keeps the GIL) shows as lag here, whatever
request caused it; the histogram is `llm_event_loop_lag_seconds`.
"""

from __future__ import annotations

import asyncio
import time

from gateway.observability.fast import HistogramChild

INTERVAL_S = 0.25
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


async def watch_lag(histogram: HistogramChild, interval_s: float = INTERVAL_S) -> None:
    """Observe the loop's lag every `interval_s` until cancelled."""
    while True:
        started = time.perf_counter()
        await asyncio.sleep(interval_s)
        histogram.observe(max(0.0, time.perf_counter() - started - interval_s))
