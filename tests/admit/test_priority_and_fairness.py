"""Tiers and fair share under overload, through the gateway: the lowest tier is shed first,
`critical` keeps its latency, and within a tier each tenant gets its weight's share of the tokens
served, however hard another tenant floods the queue.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from tests.conftest import RunningGateway, basic_policy, eventually
from tests.request.test_tenants import hashed

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "share"}], "max_tokens": 4}


def tenants_policy(
    tokenizer_dir: Any, replica: str, tenants: dict[str, dict[str, Any]], **pool: Any
) -> dict[str, Any]:
    policy = basic_policy(tokenizer_dir, [replica], **pool)
    policy["tenants"] = {
        name: {"keys": [hashed(f"sk-{name}")], **spec} for name, spec in tenants.items()
    }
    return policy


async def call(http: aiohttp.ClientSession, gw: RunningGateway, tenant: str) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer sk-{tenant}"}
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        body = await resp.json()
        return resp.status, body["error"]["code"] if resp.status != 200 else ""


def served_order(gw: RunningGateway) -> list[str]:
    """Tenants of the served requests, in the order they finished (the access log's order)."""
    records = [json.loads(line) for line in gw.access_log.getvalue().splitlines()]
    return [r["tenant"] for r in records if r["status"] == 200]


async def test_two_flooding_tenants_share_a_tier_by_their_weights(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory(delay_s=0.01)
    policy = tenants_policy(
        tokenizer_dir,
        replica.url,
        {"heavy": {"tier": "standard", "weight": 2}, "light": {"tier": "standard", "weight": 1}},
        max_concurrency=1,
        queue={"max_depth": 200, "max_wait_s": 60},
    )
    gw = await gateway_factory(policy)
    flood = [call(http, gw, tenant) for _ in range(60) for tenant in ("heavy", "light")]
    assert {s for s, _ in await asyncio.gather(*flood)} == {200}
    # While both still had requests queued (the first 60 served of 120), the tokens served
    # (equal requests here) split 2:1; both floods arrived before the first of them finished.
    contended = served_order(gw)[:60]
    share = contended.count("heavy") / contended.count("light")
    assert 2 * 0.8 <= share <= 2 * 1.2, (share, contended)


async def test_a_flooding_tenant_does_not_starve_another_of_its_tier(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory(delay_s=0.01)
    policy = tenants_policy(
        tokenizer_dir,
        replica.url,
        {"flood": {"tier": "standard"}, "steady": {"tier": "standard"}},
        max_concurrency=1,
        queue={"max_depth": 200, "max_wait_s": 60},
    )
    gw = await gateway_factory(policy)
    flood = [asyncio.create_task(call(http, gw, "flood")) for _ in range(100)]
    await eventually(lambda: gw.waiting() >= 90)  # the flood is queued first
    steady = [asyncio.create_task(call(http, gw, "steady")) for _ in range(10)]
    await asyncio.gather(*flood, *steady)
    order = served_order(gw)
    first_steady = order.index("steady")
    # Equal weights: from its arrival on, `steady` is served every other request, not after 90.
    window = order[first_steady : first_steady + 20]
    assert window.count("steady") >= 8, order
    assert len(order) == 110


async def test_overload_sheds_sheddable_before_standard_and_critical_keeps_its_latency(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory(delay_s=0.05)
    policy = tenants_policy(
        tokenizer_dir,
        replica.url,
        {
            "ops": {"tier": "critical"},
            "app": {"tier": "standard"},
            "batch": {"tier": "sheddable"},
        },
        max_concurrency=2,
        shed={"sheddable": 1.5, "standard": 4.0},
        queue={"max_depth": 50, "max_wait_s": 60, "fail_fast": False},
    )
    gw = await gateway_factory(policy)
    slots = gw.gateway.slots["main"]
    # Alone, a critical request takes one hold of the replica.
    alone = [await timed(http, gw, "ops") for _ in range(5)]

    # Overload: standard and sheddable clients arrive 3x faster than the replica serves.
    outcomes: dict[str, list[tuple[int, str]]] = {"app": [], "batch": []}
    first_shed: dict[str, float] = {}
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def client(tenant: str) -> None:
        result = await call(http, gw, tenant)
        outcomes[tenant].append(result)
        if result[1] == "shed":
            first_shed.setdefault(tenant, loop.time() - started)

    load = []
    for i in range(240):
        load.append(asyncio.create_task(client("app" if i % 2 else "batch")))
        await asyncio.sleep(0.008)  # ~125 requests/s against ~40/s served
        if i == 120:
            assert slots.saturation >= 1.5  # overloaded by then
    critical = [await timed(http, gw, "ops") for _ in range(5)]  # in the thick of it
    await asyncio.gather(*load)

    batch_shed = sum(code == "shed" for _, code in outcomes["batch"])
    app_shed = sum(code == "shed" for _, code in outcomes["app"])
    assert batch_shed > 0 and "batch" in first_shed
    assert app_shed == 0 or first_shed["batch"] < first_shed["app"]  # the lowest tier goes first
    assert batch_shed > app_shed
    # Critical waits for the next free slot only, never behind the queue of lower tiers.
    assert all(status == 200 for status, _ in critical)
    assert max(s for _, s in critical) < 2 * max(s for _, s in alone) + 0.2, (alone, critical)
    await eventually(lambda: gw.inflight() == 0 and gw.waiting() == 0)


async def timed(http: aiohttp.ClientSession, gw: RunningGateway, tenant: str) -> tuple[int, float]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, _ = await call(http, gw, tenant)
    return status, loop.time() - started
