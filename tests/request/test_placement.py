"""Placement: the one step that settles a request's pool runs every pool's rules there, whether
the pool is the route's, a fallback or the holder of the stored response the request continues.

The gateway is real, on loopback, in front of stub replicas (simulated vLLM ones where a stored
response is needed); the clients are the official SDKs where a refusal's shape is the point.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from loadtest.sim import Profile, ReplicaOptions, start_replica
from loadtest.sim.faults import Faults
from tests.cli.test_explain import chat, explain
from tests.conftest import accounted, basic_policy, eventually, write_policy
from tests.loadtest.test_simulator import write_profile
from tests.request.test_spillover import CHAT, access, holding, post, spill_policy, spilled

LIMIT = 100  # the pool's max_output_tokens in these tests


def limited(tokenizer_dir: Path, url: str) -> dict[str, Any]:
    return basic_policy(tokenizer_dir, [url], max_output_tokens=LIMIT)


def reasons(gw: Any) -> list[str | None]:
    return [line["reason"] for line in access(gw)]


async def test_output_over_the_pools_max_output_tokens_is_refused_in_each_apis_shape(
    stub, gateway_factory, tokenizer_dir
) -> None:
    gw = await gateway_factory(limited(tokenizer_dir, stub.url))
    hello = [{"role": "user", "content": "hello"}]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0) as sdk:
        with pytest.raises(openai.BadRequestError) as chat_over:
            await sdk.chat.completions.create(
                model="tiny", messages=hello, max_completion_tokens=LIMIT + 1
            )
        with pytest.raises(openai.BadRequestError) as choices_over:  # n x max_tokens
            await sdk.completions.create(model="tiny", prompt="hi", max_tokens=30, n=4)
        with pytest.raises(openai.BadRequestError) as responses_over:
            await sdk.responses.create(model="tiny", input="hi", max_output_tokens=LIMIT + 1)
        # At the limit, and without a bound of its own: served.
        await sdk.chat.completions.create(model="tiny", messages=hello, max_tokens=LIMIT)
        await sdk.completions.create(model="tiny", prompt="hi", max_tokens=25, n=4)
        await sdk.chat.completions.create(model="tiny", messages=hello)
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="x", max_retries=0) as claude:
        with pytest.raises(anthropic.BadRequestError) as messages_over:
            await claude.messages.create(model="tiny", messages=hello, max_tokens=LIMIT + 1)
    for caught in (chat_over, choices_over, responses_over):
        assert caught.value.code == "max_output_tokens_exceeded"
        assert caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert chat_over.value.param == "max_completion_tokens"
    assert responses_over.value.param == "max_output_tokens"
    assert "up to 120 output tokens (30 for each of 4)" in choices_over.value.message
    assert f"serves at most {LIMIT} a request" in choices_over.value.message
    assert messages_over.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "up to 101 output tokens" in messages_over.value.body["error"]["message"]  # type: ignore[index]
    await accounted(gw, 6)
    refused = "max_output_tokens_exceeded"
    assert reasons(gw) == [refused] * 3 + [None] * 3 + [refused]
    assert stub.stats.requests == 3  # nothing refused reached the replica


async def test_a_fallback_serves_within_its_max_output_tokens_and_is_passed_over_beyond(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    primary, spare = await stub_factory(delay_s=0.5), await stub_factory()
    policy = spill_policy(tokenizer_dir, primary.url, spare.url)
    policy["pools"]["spare"]["max_output_tokens"] = LIMIT
    gw = await gateway_factory(policy)
    first = await holding(http, gw)
    # Over the spare's limit: it stays at home and queues there, the spare idle.
    long = asyncio.create_task(post(http, gw.url, {**CHAT, "max_tokens": LIMIT + 1}))
    await eventually(lambda: gw.gateway.slots["primary"].waiting == 1)
    short = await post(http, gw.url, {**CHAT, "max_tokens": LIMIT})
    assert [h["x-gateway-pool"] for _, h in [await first, await long, short]] == [
        "primary", "primary", "spare",
    ]  # fmt: skip
    assert await spilled(http, gw) == {("routes[0]", "primary", "spare", "standard"): 1.0}


def test_explain_names_the_rule_that_passes_a_fallback_over(capsys, tmp_path, tokenizer_dir):
    policy = spill_policy(tokenizer_dir, "http://127.0.0.1:1", "http://127.0.0.1:2")
    policy["pools"]["spare"]["max_output_tokens"] = LIMIT
    path = str(write_policy(tmp_path, policy))
    request = chat(tmp_path, model="big", max_tokens=LIMIT + 1)
    code, out, _ = explain(capsys, "--policy", path, "--json", "--saturation", "primary=1", request)
    decision = json.loads(out)
    assert code == 0 and decision["pool"] == "primary"
    assert decision["fallback"][0].endswith(
        "passed over: spare cannot serve it (max_output_tokens)"
    )
    request = chat(tmp_path, model="big", max_tokens=LIMIT)
    code, out, _ = explain(capsys, "--policy", path, "--json", "--saturation", "primary=1", request)
    assert json.loads(out)["pool"] == "spare"


async def test_an_image_request_does_not_spill_to_a_model_without_images(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    primary, spare = await stub_factory(delay_s=0.5), await stub_factory()
    policy = spill_policy(tokenizer_dir, primary.url, spare.url, allow_model_substitution=True)
    policy["models"]["big"]["image_tokens"] = 64
    policy["pools"]["spare"]["model"] = "small"  # takes no images
    gw = await gateway_factory(policy)
    first = await holding(http, gw)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    seeing = {**CHAT, "messages": [{"role": "user", "content": [image]}]}
    status, headers = await post(http, gw.url, seeing)
    assert (status, headers["x-gateway-pool"]) == (200, "primary")
    await first
    assert spare.stats.requests == 0 and await spilled(http, gw) == {}


@pytest.fixture
def tiny(tmp_path: Path) -> Profile:
    return write_profile(tmp_path)


@pytest.fixture
async def sims(tiny: Profile, tokenizer_dir: Path) -> AsyncIterator[list[Any]]:
    """Two simulated replicas that store the responses they answer, the first one slow to
    start answering (half a second), so a request holds it a while."""
    slow = Faults(first_token_delay_s=500)
    replicas = [
        await start_replica(tiny, ReplicaOptions(1000, tokenizer_dir, faults))
        for faults in (slow, Faults())
    ]
    yield replicas
    for replica in replicas:
        await replica.close()


async def test_a_continued_response_goes_to_its_holder_and_is_not_counted_as_spilled(
    sims, gateway_factory, tokenizer_dir, http
) -> None:
    policy = spill_policy(tokenizer_dir, sims[0].url, sims[1].url)
    policy["models"] = {"tiny": policy["models"]["big"]}
    for pool in policy["pools"].values():
        pool["model"] = "tiny"
    policy["routes"][0]["match"]["model"] = "tiny"
    gw = await gateway_factory(policy)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0) as sdk:
        stored = await sdk.responses.create(model="tiny", input="hello", max_output_tokens=3)
        # The primary's one slot held while the continuation arrives: full, by its fallback's
        # `when`, with the spare idle. The continuation belongs on its holder, spilled or not.
        gate = gw.gateway.slots["primary"]
        hold = asyncio.create_task(
            sdk.responses.create(model="tiny", input="hold", max_output_tokens=3)
        )
        await eventually(lambda: gate.inflight == 1)
        await sdk.responses.create(
            model="tiny", input="and then?", previous_response_id=stored.id, max_output_tokens=3
        )
        await hold
    await accounted(gw, 2)
    assert [(x["pool"], x["spilled_from"]) for x in access(gw)] == [("primary", None)] * 3
    assert await spilled(http, gw) == {}
    assert gw.gateway.slots["primary"].demand.refused == 0
