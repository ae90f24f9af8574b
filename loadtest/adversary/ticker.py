"""A `/healthz` ticker in its own process: the L promise's witness.

In its own process so nothing the harness does (clients, the scripted replica, counting)
delays it: what it sees late is the gateway's loop, or the machine. Every `TICK_S` it asks
`/healthz` on one kept-alive connection (on a new one each time in front of a pod of workers,
so that the kernel spreads the ticks over them) and, once a second, prints that second's worst
latency and the worst part of a latency the machine does not explain:
`<unix time> <worst seconds> <worst unexplained seconds>`. Runs until its stdin closes.

What the machine explains is time some thread was ready to run and was not given a core: the
kernel counts it per thread (`/proc/<pid>/task/<tid>/schedstat`, its second field). Over each
tick, the longest such wait among the gateway's threads (its loop's, or a tokenizer thread's
holding the GIL the loop waits for) and this ticker's own is taken off the latency: a loop
that was runnable and not scheduled held nothing, a loop busy or blocked on its own work did.
Two busy cores shared with other processes then still give a clean witness.

    python -m loadtest.adversary.ticker http://127.0.0.1:PORT GATEWAY_PID[,PID...]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

import aiohttp

TICK_S = 0.007


def runqueue_waits_of(pids: list[int]) -> dict[int, int]:
    """`runqueue_waits` of every process of a gateway (a pod: its parent and workers)."""
    return {tid: wait for pid in pids for tid, wait in runqueue_waits(pid).items()}


def runqueue_waits(pid: int) -> dict[int, int]:
    """Nanoseconds each thread of `pid` has waited, ready, for a core; {} where the kernel does
    not say (not Linux, a process gone)."""
    waits: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                waits[int(task.name)] = int((task / "schedstat").read_text().split()[1])
    return waits


def longest_wait(before: dict[int, int], after: dict[int, int]) -> float:
    """The longest wait for a core, in seconds, any one thread had between two readings."""
    return max((w - before.get(t, w) for t, w in after.items()), default=0) / 1e9


async def tick(url: str, gateway_pids: list[int]) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    closed = asyncio.ensure_future(reader.read())
    connector = aiohttp.TCPConnector(limit=1, force_close=len(gateway_pids) > 1)
    timeout = aiohttp.ClientTimeout(total=30)
    own = os.getpid()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        second, worst, unexplained = int(time.time()), 0.0, 0.0
        gateway, mine = runqueue_waits_of(gateway_pids), runqueue_waits(own)
        while not closed.done():
            started = time.perf_counter()
            try:
                async with http.get(f"{url}/healthz") as resp:
                    await resp.read()
            except (aiohttp.ClientError, TimeoutError):
                pass  # a gateway stopping: the harness reads the latency, not the status
            latency = time.perf_counter() - started
            now_gateway, now_mine = runqueue_waits_of(gateway_pids), runqueue_waits(own)
            waited = longest_wait(gateway, now_gateway) + longest_wait(mine, now_mine)
            gateway, mine = now_gateway, now_mine
            worst = max(worst, latency)
            unexplained = max(unexplained, latency - waited)
            now = time.time()
            if int(now) != second:
                print(f"{second} {worst:.6f} {unexplained:.6f}", flush=True)
                second, worst, unexplained = int(now), 0.0, 0.0
            await asyncio.sleep(TICK_S)


if __name__ == "__main__":
    asyncio.run(tick(sys.argv[1], [int(pid) for pid in sys.argv[2].split(",")]))
