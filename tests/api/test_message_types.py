"""Messages vLLM's request model refuses are refused by the gateway before counting; those it
takes are forwarded. (tests_vllm/test_render_parity.py checks every such case against vLLM's
own code.)"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.message_types import _valid_part, _vllm_part
from tests.conftest import basic_policy

HI = {"role": "user", "content": "Hello."}
REFUSAL = {"type": "refusal", "refusal": "I cannot."}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.fixture
async def gw(stub, gateway_factory, tokenizer_dir):
    return await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))


REFUSED: list[tuple[str, dict[str, Any]]] = [
    # OpenAI's system type takes text parts only, and nothing tips it to vLLM's own type
    ("input_text in a system message", {"messages": [
        {"role": "system", "content": [{"type": "input_text", "text": "Be brief."}]}, HI]}),
    ("a plain string part", {"messages": [{"role": "user", "content": ["Hello."]}]}),
    ("a null text", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}),
    ("a null content", {"messages": [{"role": "user", "content": None}]}),
    ("a null name", {"messages": [{"role": "user", "content": "Hi.", "name": None}]}),
    ("a tool call without an id", {"messages": [
        HI, {"role": "assistant", "tool_calls": [{k: v for k, v in CALL.items() if k != "id"}]}]}),
    ("tool call arguments as an object", {"messages": [HI, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": {"a": 1}}}]}]}),
    ("tool_choice without tools", {"messages": [HI], "tool_choice": "required"}),
    ("tool_choice of no known value", {"messages": [HI], "tools": [TOOL], "tool_choice": "any"}),
    ("tool_choice naming another tool", {"messages": [HI], "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}),
    ("a message's tools that are not tools", {"messages": [
        {"role": "user", "content": [{"type": "input_text", "text": "x"}], "tools": [1]}]}),
    ("a tool_choice of another type", {"messages": [HI], "tools": [TOOL],
        "tool_choice": {"type": "custom", "function": {"name": "f"}}}),
    ("a tool whose description is a number", {"messages": [HI],
        "tools": [{"type": "function", "function": {"name": "f", "description": 5}}]}),
]  # fmt: skip

ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    # a part vLLM's own type sets fields of outweighs OpenAI's: the rest are taken as text
    ("input_text beside a refusal part", {"messages": [
        {"role": "user", "content": [REFUSAL, {"type": "input_text", "text": "Hello."}]}]}),
    ("input_text in a message with reasoning", {"messages": [
        HI, {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}],
             "reasoning": "Greet back."}, HI]}),
    ("a custom role takes any part", {"messages": [
        {"role": "narrator", "content": ["Once.", {"type": "input_text", "text": "Upon."}]}, HI]}),
    ("an empty content array", {"messages": [{"role": "user", "content": []}]}),
    ("an assistant without content", {"messages": [HI, {"role": "assistant", "content": None}, HI]}),
    ("a named tool_choice", {"messages": [HI], "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("tool_choice none without tools", {"messages": [HI], "tool_choice": "none"}),
    # vLLM's own type counts each tool's fields too: it outweighs OpenAI's refusal field
    ("input_text in an assistant message with a refusal and tools", {"messages": [
        HI, {"role": "assistant", "content": [{"type": "input_text", "text": "Hi."}],
             "refusal": None, "tools": [TOOL]}, HI]}),
    ("tool_calls as an empty string (vLLM lists it)", {"messages": [
        HI, {"role": "assistant", "content": "ok", "tool_calls": ""}, HI]}),
    ("fields vLLM does not read, of any type", {"messages": [
        {"role": "user", "content": "Hi.", "tool_call_id": 5, "task": 5, "tool_calls": [1]},
        {"role": "assistant", "content": "ok", "reasoning": "r", "reasoning_content": 5}, HI]}),
    ("tool call arguments nested 200 deep", {"messages": [HI, {"role": "assistant",
        "tool_calls": [{**CALL, "function": {"name": "f",
                                            "arguments": '{"a": ' + "[" * 200 + "]" * 200 + "}"}}]},
        HI]}),
]  # fmt: skip


@pytest.mark.parametrize(("case", "body"), REFUSED, ids=[c for c, _ in REFUSED])
async def test_what_vllms_request_model_refuses_is_a_400_before_counting(
    gw, stub, http, case: str, body: dict[str, Any]
) -> None:
    async with http.post(f"{gw.url}/v1/chat/completions", json={"model": "tiny", **body}) as resp:
        assert resp.status == 400, case
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert stub.stats.requests == 0
    assert gw.inflight() == 0 and gw.inflight_tokens() == 0


@pytest.mark.parametrize(("case", "body"), ACCEPTED, ids=[c for c, _ in ACCEPTED])
async def test_what_it_takes_is_forwarded(gw, stub, http, case: str, body: dict[str, Any]) -> None:
    async with http.post(f"{gw.url}/v1/chat/completions", json={"model": "tiny", **body}) as resp:
        assert resp.status == 200, (case, await resp.text())
    assert stub.stats.requests == 1


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-1, 2), st.text(max_size=3),
    st.sampled_from(["text", "refusal", "thinking", "tool_reference", "image_url", "audio_url"]),
    st.dictionaries(st.sampled_from(["url", "detail", "mode", "data", "format"]), st.text(max_size=2)),
)  # fmt: skip
KEYS = st.sampled_from([
    "type", "text", "refusal", "thinking", "closed", "name", "uuid", "image_pil", "image_url",
    "audio_url", "video_url", "input_audio", "file", "data", "image_embeds", "x",
])  # fmt: skip


@settings(max_examples=3000, deadline=None)
@given(st.dictionaries(KEYS, VALUES, max_size=5))
def test_the_quick_validity_check_agrees_with_scoring_every_part_type(part: dict[str, Any]) -> None:
    """The walk over a long content array checks its later parts with `_valid_part`, which must
    say exactly what scoring the part against every member says."""
    assert _valid_part(part) == (_vllm_part(part) is not None)
