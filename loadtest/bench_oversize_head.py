"""Short requests behind one that needs a replica to itself (issue 27, item 4), on loopback.

An in-process gateway in front of two stub replicas (4 slots and 5,000 in-flight tokens each):
two long streams keep each replica busy, then one request asks for `n: 10, max_tokens: 1000`
(10,000 tokens: it runs only on an idle replica), then short requests of its tier arrive every
50 ms. Printed: the short requests' round trips, and the big one's. Bounded: a fixed number of
requests, every one on 127.0.0.1.

    python -m loadtest.bench_oversize_head
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from gateway.policy.compile import load_policy
from gateway.server.app import create_app
from loadtest.stub_backend import StubConfig, create_stub_app
from loadtest.tiny_tokenizer import build

CHUNK_S = 0.005  # the stub's time per streamed token: a 400-token stream runs 2 s
SHORTS = 40
GAP_S = 0.05


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _timed(http: aiohttp.ClientSession, url: str, **fields: object) -> float:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    started = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json={**body, **fields}) as resp:
        await resp.read()
        assert resp.status == 200, resp.status
    return time.perf_counter() - started


async def run(url: str) -> tuple[list[float], float]:
    """(the short requests' round trips, the big one's)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        longs = [asyncio.create_task(_timed(http, url, max_tokens=400)) for _ in range(4)]
        await asyncio.sleep(0.2)  # the long streams are running on both replicas
        big = asyncio.create_task(_timed(http, url, n=10, max_tokens=1000))
        await asyncio.sleep(0.05)
        shorts = []
        for _ in range(SHORTS):
            shorts.append(asyncio.create_task(_timed(http, url, max_tokens=1)))
            await asyncio.sleep(GAP_S)
        short_s = await asyncio.gather(*shorts)
        big_s = await big
        await asyncio.gather(*longs)
    return short_s, big_s


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build(Path(tmp) / "tiny")
        stubs = [await _serve(create_stub_app(StubConfig(chunk_delay_s=CHUNK_S, record=False)))
                 for _ in range(2)]  # fmt: skip
        policy_path = Path(tmp) / "policy.yaml"
        policy_path.write_text(yaml.safe_dump({
            "models": {"tiny": {"tokenizer": str(tokenizer), "max_model_len": 32768}},
            "pools": {"main": {"model": "tiny", "replicas": [url for _, url in stubs],
                               "max_concurrency": 4, "max_inflight_tokens": 5000}},
            "classes": [{"name": "any", "when": {}}],
            "routes": [{"match": {"model": "tiny"}, "pool": "main"}],
        }))  # fmt: skip
        gateway, url = await _serve(create_app(load_policy(policy_path)))
        try:
            short_s, big_s = await run(url)
        finally:
            await gateway.cleanup()
            for runner, _ in stubs:
                await runner.cleanup()
    cuts = statistics.quantiles(short_s, n=10)
    print(
        f"{SHORTS} short requests behind the n=10 one: median {statistics.median(short_s):.3f} s,"
        f" p90 {cuts[-1]:.3f} s, worst {max(short_s):.3f} s; the n=10 one: {big_s:.2f} s"
    )


if __name__ == "__main__":
    asyncio.run(main())
