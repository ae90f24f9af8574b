"""No single request holds the event loop: JSON bombs and huge prompts cost their sender only."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from tests.conftest import basic_policy

GENEROUS_S = 0.5  # what the issue allows a probe while bombs land (a kubelet probe gives 1 s)
BOMB = (
    b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"x":['
    + b",".join([b"[]"] * 1_500_000)
    + b"]}"
)


@pytest.fixture
async def gw(stub_factory, gateway_factory, tokenizer_dir):
    stub = await stub_factory(chunk_delay_s=0.02)
    return await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))


async def _bombs(http, url: str, count: int) -> list[str]:
    codes = []
    for _ in range(count):
        async with http.post(
            f"{url}/v1/chat/completions", data=BOMB, headers={"Content-Type": "application/json"}
        ) as resp:
            codes.append(f"{resp.status} {(await resp.json())['error']['code']}")
    return codes


async def _probe(http, url: str, stop: asyncio.Event) -> float:
    """The slowest `/healthz` answer seen until `stop`."""
    worst = 0.0
    while not stop.is_set():
        started = time.perf_counter()
        async with http.get(f"{url}/healthz") as resp:
            assert resp.status == 200
        worst = max(worst, time.perf_counter() - started)
        await asyncio.sleep(0.01)
    return worst


async def _stream(http, url: str, stop: asyncio.Event) -> float:
    """The longest gap between chunks of one live stream, read until `stop`."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "max_tokens": 4000,
    }
    worst, last = 0.0, time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        async for _ in resp.content.iter_any():
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
            if stop.is_set():
                break
    return worst


async def test_json_bombs_do_not_stall_probes_or_streams(gw, http):
    stop = asyncio.Event()
    stream = asyncio.create_task(_stream(http, gw.url, stop))
    await asyncio.sleep(0.2)  # the stream is flowing
    probe = asyncio.create_task(_probe(http, gw.url, stop))
    codes = await asyncio.gather(*(_bombs(http, gw.url, 3) for _ in range(2)))
    stop.set()
    assert [c for sender in codes for c in sender] == ["400 json_too_complex"] * 6
    assert await probe < GENEROUS_S
    assert await stream < GENEROUS_S


async def test_a_long_body_of_prose_is_not_mistaken_for_a_bomb(gw, http):
    text = 'a, b: "c", [d] {e} \\ ' * 40_000  # 160,000 commas and colons, all inside a string
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
    async with http.post(f"{gw.url}/v1/chat/completions", data=orjson.dumps(body),
                         headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
        error = (await resp.json())["error"]
    assert error["code"] == "context_length_exceeded"  # parsed, and refused only for its length


async def test_loop_lag_is_exported(gw, http):
    await asyncio.sleep(0.6)  # two ticks of the lag timer
    async with http.get(f"{gw.url}/metrics") as resp:
        text = await resp.text()
    counts = [
        line for line in text.splitlines() if line.startswith("llm_event_loop_lag_seconds_count")
    ]
    assert counts and float(counts[0].split()[-1]) >= 1
