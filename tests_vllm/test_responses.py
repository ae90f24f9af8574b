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


CHAIN = [  # (instructions, input, streamed): each turn continues the one before
    (INSTRUCTIONS, [{"role": "system", "content": "Be terse."}, *ITEMS], False),
    (None, "and the toaster?", True),
    ("Answer in French.",
     [{"type": "message", "role": "user", "content": "which is better?"}], False),
]  # fmt: skip


async def test_a_stored_conversation_is_counted_exactly_and_retrieved(
    vllm, gateway_factory
) -> None:
    """Each turn of a chain, vLLM's real ~30-token outputs in it, is counted before it is
    admitted as vLLM then reports it: the stored inputs and outputs rendered with the new input
    (instructions of earlier turns, and system messages, not carried over)."""
    gw = await gateway_factory(vllm_policy(vllm))
    replies = []
    async with client(gw.url) as sdk:
        for instructions, given, streamed in CHAIN:
            fields = {
                "model": "tiny", "input": given, "max_output_tokens": 30,
                "extra_body": {"ignore_eos": True},
            }  # fmt: skip
            if instructions:
                fields["instructions"] = instructions
            if replies:
                fields["previous_response_id"] = replies[-1].id
            if streamed:
                async with sdk.responses.stream(**fields) as stream:
                    async for _ in stream:
                        pass
                    replies.append(await stream.get_final_response())
            else:
                replies.append(await sdk.responses.create(**fields))
        stored = await sdk.responses.retrieve(replies[-1].id)
        with pytest.raises(openai.NotFoundError) as caught:  # the gateway's: vLLM never saw it
            await sdk.responses.retrieve("resp_unknown")
    assert caught.value.code == "response_not_found"
    assert stored.id == replies[-1].id and stored.output_text == replies[-1].output_text
    assert all(r.usage is not None and r.usage.output_tokens == 30 for r in replies)
    lines = records(gw)
    assert [line["input_tokens"] for line in lines] == [r.usage.input_tokens for r in replies]
    assert [line["output_tokens"] for line in lines] == [30] * len(CHAIN)
