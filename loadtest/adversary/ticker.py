"""A `/healthz` ticker in its own process: the L promise's witness.

In its own process so nothing the harness does (clients, the scripted replica, counting)
delays it: what it sees late is the gateway's loop, or the machine. Every `TICK_S` it asks
`/healthz` on one kept-alive connection and, once a second, prints that second's worst
latency: `<unix time> <worst seconds>`. Runs until its stdin closes.

    python -m loadtest.adversary.ticker http://127.0.0.1:PORT
"""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp

TICK_S = 0.007


async def tick(url: str) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    closed = asyncio.ensure_future(reader.read())
    connector = aiohttp.TCPConnector(limit=1)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        second, worst = int(time.time()), 0.0
        while not closed.done():
            started = time.perf_counter()
            try:
                async with http.get(f"{url}/healthz") as resp:
                    await resp.read()
            except (aiohttp.ClientError, TimeoutError):
                pass  # a gateway stopping: the harness reads the latency, not the status
            worst = max(worst, time.perf_counter() - started)
            now = time.time()
            if int(now) != second:
                print(f"{second} {worst:.6f}", flush=True)
                second, worst = int(now), 0.0
            await asyncio.sleep(TICK_S)


if __name__ == "__main__":
    asyncio.run(tick(sys.argv[1]))
