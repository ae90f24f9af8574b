"""Anthropic's Messages API against real vLLM: the `anthropic` SDK through the gateway, the
answer relayed as vLLM wrote it, its usage (whole or streamed) accounted, the gateway's count
equal to vLLM's `usage.input_tokens` and to vLLM's own `/v1/messages/count_tokens`. (Tools are
tests_vllm/test_anthropic_parity.py's: this vLLM has no tool parser, so it refuses them.)"""

from __future__ import annotations

import anthropic
import orjson

from tests_vllm.conftest import vllm_policy

SYSTEM = "You review product listings."
MESSAGES = [{"role": "user", "content": "write the listing review summary"}]


def client(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


def records(gw) -> list[dict]:
    return [orjson.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def test_messages_through_the_gateway_are_vllms(vllm, gateway_factory, http) -> None:
    gw = await gateway_factory(vllm_policy(vllm))
    async with client(gw.url) as sdk:
        reply = await sdk.messages.create(
            model="tiny", system=SYSTEM, messages=MESSAGES, max_tokens=6
        )
        async with sdk.messages.stream(
            model="tiny", system=SYSTEM, messages=MESSAGES, max_tokens=7
        ) as stream:
            async for _ in stream.text_stream:
                pass
            final = await stream.get_final_message()
        ours = await sdk.messages.count_tokens(model="tiny", system=SYSTEM, messages=MESSAGES)
    async with client(vllm.url) as direct:  # vLLM's own count
        theirs = await direct.messages.count_tokens(model="tiny", system=SYSTEM, messages=MESSAGES)
    assert ours.input_tokens == theirs.input_tokens == reply.usage.input_tokens
    whole, streamed = records(gw)[0], records(gw)[-1]
    assert whole["endpoint"] == "messages" and whole["status"] == 200
    assert whole["input_tokens"] == reply.usage.input_tokens
    assert whole["output_tokens"] == reply.usage.output_tokens
    assert streamed["input_tokens"] == final.usage.input_tokens
    assert streamed["output_tokens"] == final.usage.output_tokens
    assert final.usage.output_tokens >= 1


async def test_vllms_refusal_reaches_the_client_in_its_shape(vllm, gateway_factory, http) -> None:
    gw = await gateway_factory(vllm_policy(vllm))
    # Between the gateway's max_model_len and vLLM's: vLLM's own 400, relayed.
    body = {"model": "tiny", "max_tokens": 100_000, "messages": MESSAGES}
    async with http.post(f"{gw.url}/v1/messages", json=body) as resp:
        answer = await resp.json()
    assert resp.status == 400 and answer["type"] == "error", answer
