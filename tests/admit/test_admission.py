"""Caps hold per replica; the rest waits in a bounded priority queue or is refused, retryably."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import basic_policy, eventually

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "classify this"}],
    "max_tokens": 4,
}


async def post(
    http: aiohttp.ClientSession, url: str, body: dict, **headers: str
) -> tuple[int, dict, dict]:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def test_twenty_requests_never_exceed_three_per_replica(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replicas = [await stub_factory(delay_s=0.2), await stub_factory(delay_s=0.2)]
    gw = await gateway_factory(
        basic_policy(tokenizer_dir, [r.url for r in replicas], max_concurrency=3)
    )
    results = await asyncio.gather(*(post(http, gw.url, CHAT) for _ in range(20)))
    assert [status for status, _, _ in results] == [200] * 20
    assert [r.stats.max_running for r in replicas] == [3, 3]
    assert sum(r.stats.completed for r in replicas) == 20
    assert gw.inflight() == 0 and gw.waiting() == 0
    waits = [line for line in gw.access_log.getvalue().splitlines() if b'"queue_wait_s"' in line]
    assert len(waits) == 20


async def test_queue_full_is_429_with_retry_after(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=1.0)
    gw = await gateway_factory(
        basic_policy(
            tokenizer_dir, [slow.url], max_concurrency=1, queue={"max_depth": 1, "max_wait_s": 5}
        )
    )
    running = asyncio.create_task(post(http, gw.url, CHAT))
    await eventually(lambda: gw.inflight() == 1)
    queued = asyncio.create_task(post(http, gw.url, CHAT))
    await eventually(lambda: gw.waiting() == 1)
    status, body, headers = await post(http, gw.url, CHAT)
    assert status == 429
    assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1
    assert [(await running)[0], (await queued)[0]] == [200, 200]
    assert gw.inflight() == 0 and gw.waiting() == 0


async def test_queue_timeout_is_429(stub_factory, gateway_factory, tokenizer_dir, http) -> None:
    slow = await stub_factory(delay_s=1.0)
    gw = await gateway_factory(
        basic_policy(tokenizer_dir, [slow.url], max_concurrency=1, queue={"max_wait_s": 0.2})
    )
    running = asyncio.create_task(post(http, gw.url, CHAT))
    await eventually(lambda: gw.inflight() == 1)
    status, body, headers = await post(http, gw.url, CHAT)
    assert status == 429 and body["error"]["code"] == "queue_timeout"
    assert "Retry-After" in headers
    assert (await running)[0] == 200
    assert slow.stats.requests == 1  # the timed-out request never reached the replica
    assert gw.inflight() == 0 and gw.waiting() == 0


async def test_priority_header_orders_the_queue(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=0.3)
    gw = await gateway_factory(basic_policy(tokenizer_dir, [slow.url], max_concurrency=1))
    first = asyncio.create_task(post(http, gw.url, CHAT))
    await eventually(lambda: gw.inflight() == 1)
    order: list[str] = []

    async def tagged(tag: str, priority: str) -> None:
        body = {**CHAT, "messages": [{"role": "user", "content": tag}]}
        status, _, _ = await post(http, gw.url, body, **{"x-priority": priority})
        assert status == 200
        order.append(tag)

    low = asyncio.create_task(tagged("low", "sheddable"))
    await eventually(lambda: gw.waiting() == 1)
    normal = asyncio.create_task(tagged("normal", "standard"))
    await eventually(lambda: gw.waiting() == 2)
    high = asyncio.create_task(tagged("high", "critical"))
    await eventually(lambda: gw.waiting() == 3)
    await asyncio.gather(first, low, normal, high)
    assert order == ["high", "normal", "low"]


async def test_disconnect_while_queued_sends_nothing_upstream(
    stub_factory, gateway_factory, tokenizer_dir
) -> None:
    slow = await stub_factory(delay_s=0.5)
    gw = await gateway_factory(basic_policy(tokenizer_dir, [slow.url], max_concurrency=1))
    async with aiohttp.ClientSession() as keeper:
        running = asyncio.create_task(post(keeper, gw.url, CHAT))
        await eventually(lambda: gw.inflight() == 1)
        leaver = aiohttp.ClientSession()
        queued = asyncio.create_task(post(leaver, gw.url, CHAT))
        await eventually(lambda: gw.waiting() == 1)
        queued.cancel()
        await leaver.close()
        await eventually(lambda: gw.waiting() == 0)
        assert (await running)[0] == 200
    await eventually(lambda: gw.inflight() == 0)
    assert slow.stats.requests == 1


async def test_disconnect_mid_stream_closes_upstream_and_frees_the_slot(
    stub_factory, gateway_factory, tokenizer_dir
) -> None:
    slow = await stub_factory(chunk_delay_s=0.05)
    gw = await gateway_factory(basic_policy(tokenizer_dir, [slow.url], max_concurrency=1))
    body = {**CHAT, "max_tokens": 200, "stream": True}
    session = aiohttp.ClientSession()
    resp = await session.post(f"{gw.url}/v1/chat/completions", json=body)
    assert resp.status == 200
    await resp.content.readline()  # the stream has begun
    assert gw.inflight() == 1 and slow.stats.running == 1
    resp.close()
    await session.close()
    await eventually(lambda: slow.stats.disconnects == 1)
    await eventually(lambda: gw.inflight() == 0 and gw.inflight_tokens() == 0)
    assert slow.stats.running == 0 and slow.stats.completed == 0
    # The slot is really free: the next request is served at once.
    async with aiohttp.ClientSession() as http:
        assert (await post(http, gw.url, CHAT))[0] == 200
    assert b'"status":499' in gw.access_log.getvalue()


async def test_token_cap_limits_admission(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=0.3)
    policy = basic_policy(tokenizer_dir, [slow.url], max_concurrency=10, max_inflight_tokens=1500)
    gw = await gateway_factory(policy)
    body = {**CHAT, "max_tokens": 1000}  # ~1,010 tokens reserved each: one at a time fits
    results = await asyncio.gather(*(post(http, gw.url, body) for _ in range(3)))
    assert [s for s, _, _ in results] == [200] * 3
    assert slow.stats.max_running == 1
    assert gw.inflight_tokens() == 0


@pytest.mark.parametrize("status", [500, 503])
async def test_upstream_error_reaches_client_and_frees_slot(
    stub_factory, gateway_factory, tokenizer_dir, http, status
) -> None:
    broken = await stub_factory(status=status)
    gw = await gateway_factory(basic_policy(tokenizer_dir, [broken.url]))
    got, body, _ = await post(http, gw.url, CHAT)
    assert got == status and "error" in body
    assert gw.inflight() == 0


async def test_unreachable_replica_is_502(gateway_factory, tokenizer_dir, http) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, ["http://127.0.0.1:9"]))
    status, body, _ = await post(http, gw.url, CHAT)
    assert status == 502 and body["error"]["code"] == "upstream_error"
    assert gw.inflight() == 0


async def test_a_saturated_pool_sheds_the_lowest_tier_first(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=0.5)
    policy = basic_policy(tokenizer_dir, [slow.url], max_concurrency=2)
    policy["pools"]["main"]["shed"] = {"sheddable": 1.0, "standard": 1.5}
    gw = await gateway_factory(policy)
    busy = [asyncio.create_task(post(http, gw.url, CHAT)) for _ in range(2)]
    await eventually(lambda: gw.inflight() == 2)  # saturation 1.0
    status, body, headers = await post(http, gw.url, CHAT, **{"x-priority": "sheddable"})
    assert (status, body["error"]["code"]) == (429, "shed") and "Retry-After" in headers
    queued = asyncio.create_task(post(http, gw.url, CHAT))  # standard still waits: 1.0 < 1.5
    await eventually(lambda: gw.waiting() == 1)  # saturation 1.5 now
    status, body, _ = await post(http, gw.url, CHAT)
    assert (status, body["error"]["code"]) == (429, "shed")
    critical = asyncio.create_task(post(http, gw.url, CHAT, **{"x-priority": "critical"}))
    results = await asyncio.gather(*busy, queued, critical)
    assert [s for s, _, _ in results] == [200] * 4  # critical is never shed here
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    assert 'llm_shed_total{pool="main",tier="sheddable"} 1.0' in text
    assert 'llm_shed_total{pool="main",tier="standard"} 1.0' in text
