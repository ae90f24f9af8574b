"""OpenAI's Responses API against real vLLM (its store on): the `openai` SDK through the gateway,
the answer and its typed events relayed as vLLM wrote them, the usage (whole or streamed)
accounted, the gateway's count equal to vLLM's `usage.input_tokens`; a conversation continued
by `previous_response_id` and its response retrieved, both through the gateway."""

from __future__ import annotations

import openai
import orjson
import pytest

from tests_vllm.conftest import vllm_policy

INSTRUCTIONS = "You review product listings."
ITEMS = [
    {"role": "user", "content": [{"type": "input_text", "text": "write the review summary"}]},
    {"type": "message", "role": "assistant", "content": "Which listing?"},
    {"role": "user", "content": "the kettle"},
]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def records(gw) -> list[dict]:
    return [orjson.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def test_responses_through_the_gateway_are_vllms(vllm, gateway_factory) -> None:
    gw = await gateway_factory(vllm_policy(vllm))
    async with client(gw.url) as sdk:
        reply = await sdk.responses.create(
            model="tiny", instructions=INSTRUCTIONS, input=ITEMS, max_output_tokens=6
        )
        async with sdk.responses.stream(
            model="tiny", instructions=INSTRUCTIONS, input=ITEMS, max_output_tokens=7
        ) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
    assert reply.status in ("completed", "incomplete") and reply.usage is not None
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    assert final.usage is not None and final.usage.output_tokens >= 1
    whole, streamed = records(gw)
    assert whole["endpoint"] == "responses" and whole["status"] == 200
    # The gateway counted, before admitting it, what vLLM then reported.
    assert whole["input_tokens"] == reply.usage.input_tokens
    assert whole["output_tokens"] == reply.usage.output_tokens
    assert streamed["input_tokens"] == final.usage.input_tokens
    assert streamed["output_tokens"] == final.usage.output_tokens


async def test_a_stored_conversation_continues_and_is_retrieved(vllm, gateway_factory) -> None:
    gw = await gateway_factory(vllm_policy(vllm))
    async with client(gw.url) as sdk:
        first = await sdk.responses.create(model="tiny", input="the kettle", max_output_tokens=4)
        second = await sdk.responses.create(
            model="tiny", input="and the toaster", previous_response_id=first.id,
            max_output_tokens=4,
        )  # fmt: skip
        stored = await sdk.responses.retrieve(second.id)
        with pytest.raises(openai.NotFoundError) as caught:  # the gateway's: vLLM never saw it
            await sdk.responses.retrieve("resp_unknown")
    assert caught.value.code == "response_not_found"
    # vLLM rendered the stored turns before the new input: the gateway's count (the stored
    # response's prompt and output, plus the new input) is within a template's few tokens.
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert stored.id == second.id and stored.output_text == second.output_text
    _, continued = records(gw)
    assert abs(continued["input_tokens"] - second.usage.input_tokens) <= 8, continued
    assert continued["output_tokens"] == second.usage.output_tokens
