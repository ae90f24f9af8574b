"""`POST /v1/messages` (gateway/api/anthropic.py): refusals in Anthropic's shape, wherever they are
made, a broken stream's `event: error`, the request checks, and the usage read from answers."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession, web
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api import MESSAGES
from gateway.api.anthropic import anthropic_status, to_chat
from gateway.config.schema import ServerSpec
from gateway.errors import (
    BadRequest,
    BodyTooLarge,
    GatewayError,
    InvalidApiKey,
    NoReplica,
    OverQuota,
    QueueFull,
    QueueTimeout,
    QueueWaitTooLong,
    QuotaExceeded,
    Shed,
    UpstreamError,
    UpstreamTimeout,
)
from tests.conftest import _serve, accounted, basic_policy
from tests.fuzzing import counted_or_refused, values

HELLO = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (BadRequest("x"), 400, "invalid_request_error"),
        (InvalidApiKey("x"), 401, "authentication_error"),
        (BodyTooLarge("x"), 413, "request_too_large"),
        (QuotaExceeded("x", retry_after_s=1), 429, "rate_limit_error"),
        (OverQuota("x"), 429, "rate_limit_error"),
        (QueueFull("x", retry_after_s=1), 529, "overloaded_error"),
        (Shed("x", retry_after_s=1), 529, "overloaded_error"),
        (QueueTimeout("x", retry_after_s=1), 529, "overloaded_error"),
        (QueueWaitTooLong("x", retry_after_s=1), 529, "overloaded_error"),
        (NoReplica("x", retry_after_s=1), 503, "api_error"),
        (UpstreamError("x"), 502, "api_error"),
        (UpstreamTimeout("x"), 504, "timeout_error"),
        (GatewayError("x"), 500, "api_error"),
    ],
)
def test_each_refusal_has_its_anthropic_status_and_type(
    error: GatewayError, status: int, kind: str
) -> None:
    assert anthropic_status(error) == (status, kind)


class Replica:
    """Answers `/v1/messages` with a script of SSE bytes (or a JSON answer), recording bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.events: list[bytes] = []
        self.answer: dict[str, Any] | None = None
        self.break_after = False

    async def messages(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        if self.answer is not None:
            return web.json_response(self.answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in self.events:
            await resp.write(event)
        if self.break_after:
            assert request.transport is not None
            request.transport.abort()
        return resp


def event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


START = event(
    "message_start",
    {
        "type": "message_start",
        "message": {
            "id": "m", "type": "message", "role": "assistant", "content": [], "model": "tiny",
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 9, "output_tokens": 0},
        },
    },
)  # fmt: skip
BLOCK = event(
    "content_block_start",
    {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0},
)


def delta(text: str) -> bytes:
    return event(
        "content_block_delta",
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": text}, "index": 0},
    )


END = (
    event("content_block_stop", {"type": "content_block_stop", "index": 0})
    + event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"input_tokens": 7, "output_tokens": 3, "cache_read_input_tokens": 2},
        },
    )
    + event("message_stop", {"type": "message_stop"})
)


@pytest.fixture
async def replica() -> AsyncIterator[tuple[Replica, str]]:
    fake = Replica()
    app = web.Application()
    app.router.add_post("/v1/messages", fake.messages)
    runner, url = await _serve(app)
    yield fake, url
    await runner.cleanup()


@pytest.fixture
async def gw(replica, gateway_factory, tokenizer_dir):
    return await gateway_factory(basic_policy(tokenizer_dir, [replica[1]]))


async def post(
    http: ClientSession, url: str, body: Any, **headers: str
) -> tuple[int, Any, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json", **headers}
    async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
        raw = await resp.read()
        try:
            decoded = orjson.loads(raw)
        except orjson.JSONDecodeError:
            decoded = None
        return resp.status, decoded, dict(resp.headers), raw


def log_lines(gw: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def test_a_stream_is_relayed_untouched_and_its_usage_read(gw, replica, http) -> None:
    fake, _ = replica
    fake.events = [START, BLOCK, delta("a"), delta("b"), delta("c"), END]
    status, _, headers, raw = await post(
        http,
        f"{gw.url}/v1/messages",
        {**HELLO, "stream": True},
        **{"Content-Type": "application/json"},
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert raw == b"".join(fake.events)
    assert "stream_options" not in fake.bodies[0]  # vLLM asks its chat layer for usage itself
    await accounted(gw, 0)
    (line,) = log_lines(gw)
    # The prompt vLLM counted: input_tokens plus the cache reads it split off.
    assert line["output_tokens"] == 3 and line["status"] == 200


async def test_a_stream_broken_after_its_first_byte_ends_with_an_error_event(
    gw, replica, http
) -> None:
    fake, _ = replica
    fake.events, fake.break_after = [START, BLOCK, delta("a"), delta("b")], True
    _, _, _, raw = await post(http, f"{gw.url}/v1/messages", {**HELLO, "stream": True})
    *relayed, last = raw.decode().split("\n\n")[:-1]
    assert "\n\n".join(relayed).encode() + b"\n\n" == b"".join(fake.events)
    name, data = last.split("\n")
    assert name == "event: error"
    error = orjson.loads(data.removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    await accounted(gw, 0)
    (line,) = log_lines(gw)
    assert line["output_tokens"] == 2  # the content deltas relayed, as it broke


async def test_a_whole_answers_usage_is_read(gw, replica, http) -> None:
    fake, _ = replica
    fake.answer = {
        "id": "m", "type": "message", "role": "assistant", "model": "tiny",
        "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
        "usage": {"input_tokens": 4, "output_tokens": 2, "cache_creation_input_tokens": 3},
    }  # fmt: skip
    status, answer, _, _ = await post(http, f"{gw.url}/v1/messages", HELLO)
    assert status == 200 and answer == fake.answer
    await accounted(gw, 0)
    (line,) = log_lines(gw)
    assert line["output_tokens"] == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**HELLO, "max_tokens": None}, "max_tokens"),
        ({**HELLO, "max_tokens": 0}, "max_tokens"),
        ({**HELLO, "messages": []}, "messages"),
        ({**HELLO, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({**HELLO, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, None),
        ({**HELLO, "system": 5}, "system"),
        ({**HELLO, "tools": [{"name": "t"}]}, "tools[0].input_schema"),
        ({**HELLO, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({**HELLO, "thinking": {"type": "enabled", "budget_tokens": 10}}, None),
        ({**HELLO, "output_config": {"effort": "extreme"}}, "output_config.effort"),
    ],
)
async def test_what_vllms_request_model_refuses_is_refused_before_counting(
    gw, replica, http, body: dict[str, Any], param: str | None
) -> None:
    status, answer, _, _ = await post(http, f"{gw.url}/v1/messages", body)
    assert status == 400, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert set(answer["error"]) == {"type", "message"}
    assert not replica[0].bodies
    if param is not None:
        assert param in answer["error"]["message"]


async def test_the_chats_limits_bound_a_messages_request(
    gateway_factory, replica, tokenizer_dir, http
) -> None:
    policy = basic_policy(tokenizer_dir, [replica[1]])
    policy["server"] = {"max_content_parts": 4, "max_prompt_chars": 1000}
    gw = await gateway_factory(policy)
    blocks = [{"type": "text", "text": "x"}] * 5
    parts = {**HELLO, "messages": [{"role": "user", "content": blocks}]}
    long = {**HELLO, "system": "y" * 1001}
    for body in (parts, long):
        status, answer, _, _ = await post(http, f"{gw.url}/v1/messages", body)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error"


async def test_refusals_outside_the_pipeline_take_anthropics_shape(gw, http) -> None:
    async with http.get(f"{gw.url}/v1/messages") as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
    async with http.post(f"{gw.url}/v1/messages/batches", json={}) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "not_found_error"
    async with http.post(f"{gw.url}/v1/nothing", json={}) as resp:  # OpenAI's elsewhere
        assert resp.status == 404 and "code" in (await resp.json())["error"]
    crowded = {f"x-h{i}": "v" for i in range(ServerSpec().max_headers + 1)}
    async with http.post(f"{gw.url}/v1/messages", json=HELLO, headers=crowded) as resp:
        assert resp.status == 431
        assert (await resp.json())["type"] == "error"


async def test_count_tokens_is_the_gateways_own_count(gw, replica, http) -> None:
    body = {k: v for k, v in HELLO.items() if k != "max_tokens"}
    status, answer, _, _ = await post(http, f"{gw.url}/v1/messages/count_tokens", body)
    assert status == 200 and answer["input_tokens"] > 0
    assert answer["context_management"] == {"original_input_tokens": answer["input_tokens"]}
    assert not replica[0].bodies
    image = {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
    with_image = {**body, "messages": [{"role": "user", "content": [image]}]}
    status, answer, _, _ = await post(http, f"{gw.url}/v1/messages/count_tokens", with_image)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"


def test_the_conversion_follows_vllms() -> None:
    body = {
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
            {"type": "text", "text": "Be brief."},
        ],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "system", "content": "reminder"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "r"}],
                    },
                    {"type": "text", "text": "go on"},
                ],
            },
        ],
        "tools": [{"name": "f", "input_schema": {}}],
        "thinking": {"type": "disabled"},
    }
    merged = to_chat(body, True, "low")
    assert merged["messages"] == [
        {"role": "system", "content": "Be brief.reminder"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "reasoning": "hm",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "r"},
        {"role": "user", "content": "go on"},
    ]
    assert merged["tools"][0]["function"]["parameters"] == {"type": "object"}
    assert merged["tool_choice"] == "auto" and merged["reasoning_effort"] == "low"
    inline = to_chat(body, False, "none")["messages"]
    assert inline[0] == {"role": "system", "content": "Be brief."}
    assert inline[2] == {"role": "system", "content": "reminder"}


async def test_x_api_key_and_bearer_both_name_the_tenant(
    gateway_factory, replica, tokenizer_dir, http, tmp_path: Path
) -> None:
    fake, url = replica
    fake.answer = {"type": "message", "usage": {"input_tokens": 1, "output_tokens": 1}}
    policy = basic_policy(tokenizer_dir, [url])
    digest = hashlib.sha256(b"sk-acme").hexdigest()
    policy["tenants"] = {"acme": {"keys": [f"sha256:{digest}"]}}
    gw = await gateway_factory(policy)
    for headers in ({"x-api-key": "sk-acme"}, {"Authorization": "Bearer sk-acme"}):
        status, _, _, _ = await post(http, f"{gw.url}/v1/messages", HELLO, **headers)
        assert status == 200
    status, answer, _, _ = await post(http, f"{gw.url}/v1/messages", HELLO)
    assert status == 401 and answer["error"]["type"] == "authentication_error"
    await asyncio.sleep(0)


def test_system_messages_add_and_remove_tools_as_vllm_resolves_them() -> None:
    weather = {"name": "weather", "input_schema": {"type": "object"}}
    search = {"name": "search", "input_schema": {}, "defer_loading": True}
    changes = [
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "search"}},
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "weather"}},
    ]
    body = {
        "messages": [{"role": "system", "content": changes}, {"role": "user", "content": "q"}],
        "tools": [weather, search],
    }
    (tool,) = to_chat(body, False, "none")["tools"]
    assert tool["function"]["name"] == "search" and tool["function"]["defer_loading"] is None
    body["tools"] = [weather]
    with pytest.raises(BadRequest, match="not declared in tools"):
        to_chat(body, False, "none")


async def test_a_tool_change_outside_a_system_message_is_refused(gw, http) -> None:
    change = {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}
    for body in (
        {**HELLO, "messages": [{"role": "user", "content": [change]}]},
        {**HELLO, "system": [change]},
    ):
        status, answer, _, _ = await post(http, f"{gw.url}/v1/messages", body)
        assert status == 400 and 'role "system"' in answer["error"]["message"]


block_types = st.sampled_from(
    ["text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
     "redacted_thinking", "tool_addition", "tool_removal", "video"]
)  # fmt: skip
fields = st.sampled_from(
    ["text", "source", "id", "tool_use_id", "name", "input", "content", "thinking", "tool",
     "is_error", "tool_name"]
)  # fmt: skip
blocks = st.builds(
    lambda kind, extra: {"type": kind, **extra},
    block_types,
    st.dictionaries(fields, values, max_size=3),
)
contents = st.text(max_size=10) | st.lists(blocks, max_size=3)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "user", "system"]), "content": contents}
    ),
    min_size=1,
    max_size=4,
)
bodies = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.just(8), "messages": messages},
    optional={
        "system": contents,
        "tools": st.lists(
            st.fixed_dictionaries({"name": st.text(max_size=5), "input_schema": values}), max_size=2
        )
        | values,
        "tool_choice": values | st.fixed_dictionaries({"type": st.sampled_from(["auto", "tool"])}),
        "thinking": values,
        "output_config": values,
    },
)


@settings(max_examples=400, deadline=None, database=None)
@given(body=bodies)
def test_any_body_is_counted_or_refused_never_a_crash(
    tiny_policy: Any, body: dict[str, Any]
) -> None:
    """Whatever the shape, the checks and the conversion end in a count or a 400: a body that
    passed the checks never crashes the conversion or the template (a 500 for the client)."""
    counted_or_refused(tiny_policy, MESSAGES, body)


def test_prefix_affinity_hashes_the_system_prompt_first() -> None:
    from gateway.pick.prompt import prompt_text

    body = {"system": [{"type": "text", "text": "rules"}], "messages": [HELLO["messages"][0]]}
    assert prompt_text(body) == "system\x1frules\x1euser\x1fhi\x1e"
    assert prompt_text({"messages": [HELLO["messages"][0]]}) == "user\x1fhi\x1e"


async def test_only_a_users_tool_result_sends_its_images(gw, replica, http) -> None:
    replica[0].answer = {"type": "message", "usage": {"input_tokens": 1, "output_tokens": 1}}
    image = {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    for role, status in (("user", 400), ("assistant", 200)):
        body = {**HELLO, "messages": [{"role": role, "content": [result]}, HELLO["messages"][0]]}
        got, answer, _, _ = await post(http, f"{gw.url}/v1/messages", body)
        assert got == status, answer  # the tiny model takes no images


def test_the_estimators_key_ignores_claude_codes_billing_header() -> None:
    first = {"type": "text", "text": "x-anthropic-billing-header: cch=1;"}
    second = {"type": "text", "text": "x-anthropic-billing-header: cch=2;"}
    rules = {"type": "text", "text": "You are an agent."}
    one = {**HELLO, "system": [first, rules]}
    other = {**HELLO, "system": [second, rules]}
    assert MESSAGES.fingerprint(one) == MESSAGES.fingerprint(other)
    assert MESSAGES.fingerprint(one) != MESSAGES.fingerprint(HELLO)
