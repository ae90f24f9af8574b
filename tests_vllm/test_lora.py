"""Real vLLM with a LoRA made here and priority scheduling: the gateway discovers the adapter
from vLLM's `/v1/models`, routes it to its base model's pool with its name kept (vLLM applies
it), and the tier it sends in `priority` is what vLLM orders its queue by."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from loadtest.vllm_server import SERVED_NAME, VLLMServer
from tests.conftest import RunningGateway
from tests_vllm.conftest import LORA_NAME, eventually, scrape, vllm_policy


def completion(model: str, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": "the listing says", "max_tokens": 8, "temperature": 0}
    return {**body, **extra}


async def lora_gateway(gateway_factory: Any, server: VLLMServer, **pool: Any) -> RunningGateway:
    """The gateway in front of the LoRA server, the adapter not in its policy: discovered."""
    gw: RunningGateway = await gateway_factory(
        vllm_policy(server, health={"reconcile_interval_s": 0.2}, **pool)
    )
    replica = gw.gateway.slots["main"].replicas[0]
    await eventually(lambda: LORA_NAME in replica.adapters, within_s=30)
    return gw


async def test_vllm_lists_the_adapter_with_its_parent_and_the_gateway_too(
    vllm_lora, gateway_factory, http
) -> None:
    async with http.get(f"{vllm_lora.url}/v1/models") as resp:
        cards = {c["id"]: c for c in (await resp.json())["data"]}
    assert cards[LORA_NAME]["parent"] == SERVED_NAME
    assert cards[SERVED_NAME]["parent"] is None
    gw = await lora_gateway(gateway_factory, vllm_lora)
    assert gw.gateway.slots["main"].replicas[0].adapters == {LORA_NAME}
    async with http.get(f"{gw.url}/v1/models") as resp:
        listed = {c["id"]: c.get("parent") for c in (await resp.json())["data"]}
    assert listed[LORA_NAME] == SERVED_NAME


async def test_an_adapter_reaches_vllm_by_its_name_and_changes_the_answer(
    vllm_lora, gateway_factory, http
) -> None:
    gw = await lora_gateway(gateway_factory, vllm_lora)
    answers = {}
    for model in (SERVED_NAME, LORA_NAME):
        async with http.post(f"{gw.url}/v1/completions", json=completion(model)) as resp:
            assert resp.status == 200, await resp.text()
            answers[model] = await resp.json()
    assert answers[LORA_NAME]["model"] == LORA_NAME  # vLLM names the adapter that answered
    assert answers[LORA_NAME]["choices"][0]["text"] != answers[SERVED_NAME]["choices"][0]["text"]
    # Counted with the base model's tokenizer, as vLLM counted it.
    line = json.loads(gw.access_log.getvalue().splitlines()[-1])
    assert line["adapter"] == LORA_NAME
    assert line["input_tokens"] == answers[LORA_NAME]["usage"]["prompt_tokens"]


async def test_vllm_orders_its_queue_by_the_tier_the_gateway_sends(
    vllm_lora, gateway_factory, http
) -> None:
    """vLLM runs one sequence at a time here and the gateway admits 8, so the queue is vLLM's.
    A sheddable request queued first, a critical one after it: once the running one leaves,
    vLLM serves the critical one first (lower `priority` first)."""
    gw = await lora_gateway(gateway_factory, vllm_lora, upstream_priority=True)
    url = f"{gw.url}/v1/completions"

    async def stream_until_cancelled() -> None:
        body = completion(SERVED_NAME, max_tokens=60000, ignore_eos=True, stream=True)
        async with http.post(url, json=body, headers={"x-priority": "sheddable"}) as resp:
            async for _ in resp.content.iter_any():
                pass

    async def send(tier: str) -> str:
        headers = {"x-priority": tier, "x-request-id": tier}
        async with http.post(url, json=completion(SERVED_NAME), headers=headers) as resp:
            assert resp.status == 200, await resp.text()
        return tier

    async def until(gauge: str, at_least: int, *requests: asyncio.Task[Any]) -> None:
        """Until vLLM's gauge reads `at_least`; a request that ended meanwhile (it should be
        running or waiting) fails the test with its own error, not a time-out."""
        async with asyncio.timeout(120):  # a first run on a cold machine is slow
            while await scrape(http, vllm_lora.url, gauge) < at_least:
                if ended := [r for r in requests if r.done()]:
                    raise AssertionError(f"ended before {gauge} reached {at_least}: {ended}")
                await asyncio.sleep(0.05)

    blocker = asyncio.create_task(stream_until_cancelled())
    try:
        await until("vllm:num_requests_running", 1, blocker)
        sheddable = asyncio.create_task(send("sheddable"))
        await until("vllm:num_requests_waiting", 1, blocker, sheddable)
        critical = asyncio.create_task(send("critical"))
        await until("vllm:num_requests_waiting", 2, blocker, sheddable, critical)
    finally:
        blocker.cancel()  # the gateway closes its upstream: vLLM aborts it and picks the next
        await asyncio.gather(blocker, return_exceptions=True)
    assert sorted(await asyncio.gather(sheddable, critical)) == ["critical", "sheddable"]
    ended = [json.loads(line)["request_id"] for line in gw.access_log.getvalue().splitlines()]
    assert [r for r in ended if r in ("critical", "sheddable")] == ["critical", "sheddable"]


async def test_vllm_scheduling_fcfs_ignores_a_priority(vllm: VLLMServer) -> None:
    """vLLM 0.32's `priority` field says non-zero raises without priority scheduling; the V1
    engine does not check it (vllm/v1/engine/input_processor.py passes it on, the FCFS queue
    ignores it). So `upstream_priority` on an FCFS replica is harmless, and does nothing."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{vllm.url}/v1/completions", json=completion(SERVED_NAME, priority=2)) as resp,
    ):
        assert resp.status == 200, await resp.text()
