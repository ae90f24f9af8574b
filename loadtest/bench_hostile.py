"""How long one hostile request holds the gateway's event loop, seen from a concurrent client.

Two measurements against an in-process gateway (stub replica, the tiny test tokenizer), on
127.0.0.1 only, each bounded in requests:
- (a) a JSON bomb (4.5 MB: 1.5 million `[]`) while `/healthz` is probed every 10 ms: the slowest
  probe answer is the time the loop was held;
- (b) a 3,400-character chat request while four 1,000,000-character prompts that fit are being
  tokenized: its round trip is how long small requests wait behind huge ones;
- (c) a 4 MB prompt of emoji (4 million tokens) to a model of 8,192: how long its 400 takes.

    python -m loadtest.bench_hostile
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
import yaml
from aiohttp import web

from gateway.policy.compile import load_policy
from gateway.server.app import create_app
from loadtest.stub_backend import StubConfig, create_stub_app
from loadtest.tiny_tokenizer import build

BOMB = (
    b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"x":['
    + b",".join([b"[]"] * 1_500_000)
    + b"]}"
)
WORDS = "product rules prohibit weapons drugs review listing seller brand price ".split()


def _text(chars: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(chars // 6))[:chars]


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _bomb_lag(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(slowest /healthz answer while one bomb is sent, the bomb's own round trip)."""
    worst, stop = 0.0, asyncio.Event()

    async def probe() -> None:
        nonlocal worst
        while not stop.is_set():
            started = time.perf_counter()
            await asyncio.sleep(0.01)  # a loop held meanwhile delays the wake-up, or the answer
            async with http.get(f"{url}/healthz") as resp:
                await resp.read()
            worst = max(worst, time.perf_counter() - started - 0.01)

    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.1)
    started = time.perf_counter()
    async with http.post(
        f"{url}/v1/chat/completions", data=BOMB, headers={"Content-Type": "application/json"}
    ) as resp:
        await resp.read()
    took = time.perf_counter() - started
    await asyncio.sleep(0.1)
    stop.set()
    await prober
    return worst, took


async def _small_behind_huge(http: aiohttp.ClientSession, url: str, trial: int) -> float:
    async def post(content: str) -> None:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 1,
        }
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()

    huge = [asyncio.create_task(post(f"{trial} {i} " + _text(1_000_000 - 16))) for i in range(4)]
    await asyncio.sleep(0.1)  # their bodies are in and tokenizing
    started = time.perf_counter()
    await post(f"{trial} " + _text(3_400))
    took = time.perf_counter() - started
    await asyncio.gather(*huge)
    return took


async def _emoji_refusal(http: aiohttp.ClientSession, url: str) -> float:
    body = orjson.dumps({"model": "short", "prompt": "\U0001f600" * 1_000_000})
    started = time.perf_counter()
    async with http.post(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 400, await resp.text()
    return time.perf_counter() - started


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build(Path(tmp) / "tiny")
        stub, stub_url = await _serve(create_stub_app(StubConfig(record=False)))
        policy_path = Path(tmp) / "policy.yaml"
        policy_path.write_text(yaml.safe_dump({
            "server": {"max_prompt_chars": 4_000_000, "max_body_bytes": 16 * 1024 * 1024},
            "models": {
                "tiny": {"tokenizer": str(tokenizer), "max_model_len": 8_000_000},
                "short": {"tokenizer": str(tokenizer), "max_model_len": 8192},
            },
            "pools": {
                "main": {"model": "tiny", "replicas": [stub_url], "max_concurrency": 8},
                "short": {"model": "short", "replicas": [stub_url], "max_concurrency": 8},
            },
            "classes": [{"name": "any", "when": {}}],
            "routes": [
                {"match": {"model": "tiny"}, "pool": "main"},
                {"match": {"model": "short"}, "pool": "short"},
            ],
        }))  # fmt: skip
        gateway, url = await _serve(create_app(load_policy(policy_path)))
        try:
            async with aiohttp.ClientSession() as http:
                lags = [await _bomb_lag(http, url) for _ in range(3)]
                small = [await _small_behind_huge(http, url, trial) for trial in range(3)]
                emoji = [await _emoji_refusal(http, url) for _ in range(3)]
        finally:
            await gateway.cleanup()
            await stub.cleanup()
    print(
        f"(a) bomb: worst /healthz delay {max(w for w, _ in lags) * 1000:.0f} ms,"
        f" bomb answered in {statistics.median(t for _, t in lags) * 1000:.0f} ms (median of 3)"
    )
    print(
        f"(b) 3,400-char request behind 4 huge prompts: median {statistics.median(small) * 1000:.0f} ms,"
        f" worst {max(small) * 1000:.0f} ms (of 3)"
    )
    print(f"(c) 4 MB emoji prompt over max_model_len: 400 in {statistics.median(emoji) * 1000:.0f} ms"
          " (median of 3)")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
