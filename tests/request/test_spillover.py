"""Spill-over: a route's full pool sends new requests to a fallback pool that has room.

A stub replica per pool on loopback, the gateway in front: the first request holds the primary's
only slot, and what arrives meanwhile goes to the fallback, or stays and queues when its tier may
not spill, the fallback is full too, or the fallback cannot serve it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.admit import Claim, LivePool
from gateway.config.load import PolicyError
from gateway.config.schema import PoolSpec
from gateway.pick.picker import LeastInflightPicker
from gateway.policy.compile import load_policy
from tests.conftest import RedisServer, eventually, write_policy
from tests.request.test_tenants import hashed

CHAT = {"model": "big", "messages": [{"role": "user", "content": "spill"}], "max_tokens": 4}


def spill_policy(tokenizer_dir: Path, primary: str, spare: str, **route: Any) -> dict[str, Any]:
    """Pool `primary` (one slot) with pool `spare` (one slot) as its fallback; `route` overrides
    route fields, `fallback` included."""
    model = {"tokenizer": str(tokenizer_dir), "max_model_len": 8192}
    queue = {"max_depth": 10, "max_wait_s": 30}
    return {
        "models": {"big": model, "small": {**model, "max_model_len": 4096}},
        "pools": {
            "primary": {
                "model": "big",
                "replicas": [primary],
                "max_concurrency": 1,
                "queue": queue,
            },
            "spare": {"model": "big", "replicas": [spare], "max_concurrency": 1, "queue": queue},
        },
        "classes": [{"name": "any", "when": {}}],
        "routes": [
            {"match": {"model": "big"}, "pool": "primary", "fallback": [{"pool": "spare"}], **route}
        ],
    }


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any] = CHAT, key: str | None = None
) -> tuple[int, dict[str, str]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}


def access(gw: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def spilled(http: aiohttp.ClientSession, gw: Any) -> dict[tuple[str, ...], float]:
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    return {
        tuple(s.labels[k] for k in ("route", "from_pool", "to_pool", "tier")): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "llm_spillover"
        for s in family.samples
        if s.name == "llm_spillover_total"
    }


async def holding(http: aiohttp.ClientSession, gw: Any, **post_args: Any) -> asyncio.Task[Any]:
    """A request that holds the primary's slot (the stub is slow) until awaited."""
    task = asyncio.create_task(post(http, gw.url, **post_args))
    await eventually(lambda: gw.gateway.slots["primary"].inflight == 1)
    return task


async def test_a_request_arriving_while_the_primary_is_full_is_served_by_the_fallback(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    primary, spare = await stub_factory(delay_s=0.5), await stub_factory()
    gw = await gateway_factory(spill_policy(tokenizer_dir, primary.url, spare.url))
    first = await holding(http, gw)
    status, headers = await post(http, gw.url)
    assert status == 200
    assert (headers["x-gateway-pool"], headers["x-gateway-model"]) == ("spare", "big")
    assert (await first)[1]["x-gateway-pool"] == "primary"
    assert (primary.stats.requests, spare.stats.requests) == (1, 1)  # each admitted once
    log = access(gw)
    assert [(x["pool"], x["spilled_from"]) for x in log] == [
        ("spare", "primary"),
        ("primary", None),
    ]
    assert await spilled(http, gw) == {("routes[0]", "primary", "spare", "standard"): 1.0}
    # Still demand for the primary: it counts as one it could not serve.
    assert gw.gateway.slots["primary"].demand.refused == 1
    assert gw.inflight() == 0


async def test_nothing_spills_while_the_primary_has_room(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    primary, spare = await stub_factory(), await stub_factory()
    gw = await gateway_factory(spill_policy(tokenizer_dir, primary.url, spare.url))
    for _ in range(5):
        assert (await post(http, gw.url))[1]["x-gateway-pool"] == "primary"
    assert spare.stats.requests == 0 and await spilled(http, gw) == {}


async def test_a_full_fallback_takes_nothing_and_the_request_queues_at_home(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    primary, spare = await stub_factory(delay_s=0.4), await stub_factory(delay_s=0.4)
    gw = await gateway_factory(spill_policy(tokenizer_dir, primary.url, spare.url))
    first = await holding(http, gw)
    second = asyncio.create_task(post(http, gw.url))  # spills: the spare's only slot
    await eventually(lambda: gw.gateway.slots["spare"].inflight == 1)
    third = asyncio.create_task(post(http, gw.url))
    await eventually(lambda: gw.gateway.slots["primary"].waiting == 1)  # neither has room
    results = await asyncio.gather(first, second, third)
    assert [h["x-gateway-pool"] for _, h in results] == ["primary", "spare", "primary"]
    assert (primary.stats.requests, spare.stats.requests) == (2, 1)


async def test_only_the_tiers_allowed_spill_and_sheddable_is_left_out_by_default(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    primary, spare = await stub_factory(delay_s=0.4), await stub_factory()
    policy = spill_policy(tokenizer_dir, primary.url, spare.url)
    policy["tenants"] = {
        "paying": {"keys": [hashed("sk-paying")], "tier": "standard"},
        "batch": {"keys": [hashed("sk-batch")], "tier": "sheddable"},
    }
    gw = await gateway_factory(policy)
    first = await holding(http, gw, key="sk-paying")
    batch = asyncio.create_task(post(http, gw.url, key="sk-batch"))
    await eventually(lambda: gw.gateway.slots["primary"].waiting == 1)  # it stayed and queued
    _, paying = await post(http, gw.url, key="sk-paying")
    assert paying["x-gateway-pool"] == "spare"
    assert [h["x-gateway-pool"] for _, h in await asyncio.gather(first, batch)] == ["primary"] * 2
    assert await spilled(http, gw) == {("routes[0]", "primary", "spare", "standard"): 1.0}


async def test_a_tier_named_in_the_fallback_spills(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    primary, spare = await stub_factory(delay_s=0.4), await stub_factory()
    policy = spill_policy(
        tokenizer_dir, primary.url, spare.url,
        fallback=[{"pool": "spare", "tiers": ["sheddable"]}],
    )  # fmt: skip
    policy["tenants"] = {"batch": {"keys": [hashed("sk-batch")], "tier": "sheddable"}}
    gw = await gateway_factory(policy)
    first = await holding(http, gw, key="sk-batch")
    assert (await post(http, gw.url, key="sk-batch"))[1]["x-gateway-pool"] == "spare"
    await first


async def test_another_model_is_a_fallback_only_when_the_route_allows_it(
    stub_factory, gateway_factory, tokenizer_dir, tmp_path, http
) -> None:
    primary, spare = await stub_factory(delay_s=0.4), await stub_factory()
    policy = spill_policy(tokenizer_dir, primary.url, spare.url)
    policy["pools"]["spare"]["model"] = "small"
    with pytest.raises(PolicyError, match="allow_model_substitution"):
        load_policy(write_policy(tmp_path, policy))
    policy["routes"][0]["allow_model_substitution"] = True
    gw = await gateway_factory(policy)
    first = await holding(http, gw)
    status, headers = await post(http, gw.url)
    assert (status, headers["x-gateway-pool"], headers["x-gateway-model"]) == (
        200,
        "spare",
        "small",
    )
    assert spare.stats.bodies[0]["model"] == "small"  # the replica is asked for its own model
    await first


async def test_a_request_the_fallback_cannot_fit_stays_at_home(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    primary, spare = await stub_factory(delay_s=0.3), await stub_factory()
    policy = spill_policy(tokenizer_dir, primary.url, spare.url, allow_model_substitution=True)
    policy["pools"]["spare"]["model"] = "small"  # 4,096 tokens of context, the primary 8,192
    gw = await gateway_factory(policy)
    first = await holding(http, gw)
    long_answer = {**CHAT, "max_tokens": 6000}
    assert (await post(http, gw.url, long_answer))[1]["x-gateway-pool"] == "primary"
    await first
    assert spare.stats.requests == 0


def test_a_fallback_counted_by_another_tokenizer_or_unknown_is_refused(
    tokenizer_dir, tmp_path
) -> None:
    policy = spill_policy(
        tokenizer_dir, "http://127.0.0.1:1", "http://127.0.0.1:2", allow_model_substitution=True,
        fallback=[{"pool": "spare"}, {"pool": "nowhere"}, {"pool": "primary"}],
    )  # fmt: skip
    policy["models"]["small"]["tokenizer"] = str(tmp_path)
    policy["pools"]["spare"]["model"] = "small"
    with pytest.raises(PolicyError) as refused:
        load_policy(write_policy(tmp_path, policy))
    message = str(refused.value)
    assert "a spilled request keeps its count" in message
    assert "unknown pool 'nowhere'" in message
    assert "pool 'primary' is in the chain already" in message


async def test_the_tenants_pool_window_charged_is_the_one_of_the_pool_that_serves(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    primary, spare = await stub_factory(delay_s=0.4), await stub_factory()
    policy = spill_policy(tokenizer_dir, primary.url, spare.url)
    policy["tenants"] = {
        "team": {"keys": [hashed("sk-team")], "tier": "standard", "pools": {"spare": {"rpm": 1}}}
    }
    gw = await gateway_factory(policy)
    first = await holding(http, gw, key="sk-team")  # the primary's window is not limited
    assert (await post(http, gw.url, key="sk-team"))[0] == 200  # spilled: the spare's 1 rpm
    third = asyncio.create_task(post(http, gw.url, key="sk-team"))
    status, _ = await third
    assert status == 429  # spilled again, over the spare's window: refused, not admitted twice
    assert [x["reason"] for x in access(gw)][-1] == "rate_limit_exceeded"
    await first
    assert (primary.stats.requests, spare.stats.requests) == (1, 1)


async def test_with_redis_the_primary_is_full_when_another_gateway_fills_it(
    fresh_redis: RedisServer, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    # The first request holds the primary's one slot for 4 s: the second gateway learns of its
    # lease within a renewal (about a second, longer on a loaded machine) and asks while held.
    primary, spare = await stub_factory(delay_s=4.0), await stub_factory()
    policy = spill_policy(tokenizer_dir, primary.url, spare.url)
    policy["state"] = {"backend": "redis", "url": fresh_redis.url, "timeout_s": 0.3, "gateways": 2}
    one, two = await gateway_factory(policy), await gateway_factory(policy)
    first = asyncio.create_task(post(http, one.url))
    # The second gateway sees the first one's lease once the leases are shared (every second).
    await eventually(lambda: two.gateway.slots["primary"].saturation >= 1.0)
    status, headers = await post(http, two.url)
    assert (status, headers["x-gateway-pool"]) == (200, "spare")
    assert (await first)[1]["x-gateway-pool"] == "primary"
    assert (primary.stats.max_running, spare.stats.requests) == (1, 1)


async def test_the_predicted_wait_is_zero_with_room_and_grows_with_the_line() -> None:
    slots = LivePool(
        "p",
        PoolSpec(model="m", replicas=["http://127.0.0.1:9"], max_concurrency=2),
        LeastInflightPicker(None),
    )
    assert slots.predicted_wait("") == 0.0  # a slot is free
    grants = [await slots.acquire(Claim(1)) for _ in range(2)]
    assert slots.predicted_wait("") is None  # full, and no hold time measured yet
    for _ in range(40):
        slots.queue.holds[0].add(2.0)
    assert slots.predicted_wait("") == pytest.approx(1 * 2.0 / 2)  # next of 2 slots, 2 s each
    waiter = asyncio.create_task(slots.acquire(Claim(1)))
    await eventually(lambda: slots.waiting == 1)
    assert slots.predicted_wait("") == pytest.approx(2 * 2.0 / 2)
    for grant in grants:
        slots.release(grant)
    slots.release(await waiter)
