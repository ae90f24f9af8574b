"""The OpenAI surface through the gateway against real vLLM: what the client sends reaches vLLM
untouched and what vLLM answers reaches the client untouched, errors included."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from openai import AsyncOpenAI

from loadtest.vllm_server import MAX_MODEL_LEN
from tests_vllm.conftest import POLICY_MAX_MODEL_LEN, vllm_policy

CHAT = [{"role": "user", "content": "write the listing review summary"}]


def client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


async def events(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[str]:
    """The data fields of an SSE answer, in order."""
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        text = await resp.text()
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]


async def test_chat_and_completions_streaming_and_not(vllm, gateway_factory) -> None:
    gw = await gateway_factory(vllm_policy(vllm))
    sdk = client(gw.url)
    chat = await sdk.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5)
    assert chat.model == "tiny" and chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens <= 5
    chunks = [
        c
        async for c in await sdk.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=5, stream=True
        )
    ]
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    completion = await sdk.completions.create(model="tiny", prompt="the seller", max_tokens=5)
    assert completion.object == "text_completion" and completion.choices[0].text is not None
    streamed = [
        c
        async for c in await sdk.completions.create(
            model="tiny", prompt="the seller", max_tokens=5, stream=True
        )
    ]
    assert streamed and streamed[-1].choices[0].finish_reason in ("length", "stop")


# Each body goes to vLLM directly and through the gateway with the same seed: the same answer
# back means every field reached vLLM as sent. The checks say what vLLM did with the field.
SEEDED = {"temperature": 1.0, "seed": 1234}
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("n", "chat", {"messages": CHAT, "max_tokens": 4, "n": 3}),
    ("stop", "completions", {"prompt": "the rules", "max_tokens": 60, "stop": ["e", "a"]}),
    ("logprobs-chat", "chat", {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}),
    ("logprobs-completions", "completions", {"prompt": "a price", "max_tokens": 3, "logprobs": 2}),
    ("ignore_eos", "chat", {"messages": CHAT, "max_tokens": 40, "ignore_eos": True}),
    ("max_completion_tokens", "chat", {"messages": CHAT, "max_completion_tokens": 7, "ignore_eos": True}),
    (
        "response_format",
        "chat",
        {
            "messages": CHAT,
            "max_tokens": 20,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": {"enum": ["allow", "deny"]}},
            },
        },
    ),
]  # fmt: skip
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def _answer(body: dict[str, Any]) -> Any:
    return [
        {k: c.get(k) for k in ("text", "message", "finish_reason", "logprobs", "index")}
        for c in body["choices"]
    ], body["usage"]


@pytest.mark.parametrize(("case", "endpoint", "fields"), CASES, ids=[c[0] for c in CASES])
async def test_fields_pass_through(vllm, gateway_factory, http, case, endpoint, fields) -> None:
    gw = await gateway_factory(vllm_policy(vllm))
    body = {"model": "tiny", **SEEDED, **fields}
    answers = []
    for base in (vllm.url, gw.url):
        async with http.post(base + PATHS[endpoint], json=body) as resp:
            assert resp.status == 200, await resp.text()
            answers.append(await resp.json())
    direct, through = answers
    assert _answer(through) == _answer(direct)
    choices = through["choices"]
    if case == "n":
        assert len(choices) == 3
    elif case == "stop":
        assert choices[0]["finish_reason"] == "stop" and not set("ea") & set(choices[0]["text"])
    elif case == "logprobs-chat":
        assert [len(t["top_logprobs"]) for t in choices[0]["logprobs"]["content"]] == [2, 2, 2]
    elif case == "logprobs-completions":
        assert len(choices[0]["logprobs"]["tokens"]) == 3
    elif case == "ignore_eos":
        assert through["usage"]["completion_tokens"] == 40
    elif case == "max_completion_tokens":
        assert through["usage"]["completion_tokens"] == 7
    elif case == "response_format":
        assert json.loads(choices[0]["message"]["content"]) in ("allow", "deny")


async def test_vllm_gets_the_gateways_request_id_and_the_client_its_own(
    vllm, gateway_factory, http
) -> None:
    """vLLM makes `x-request-id` its engine's request id: a client's would let a tenant collide
    with another's, so vLLM gets the gateway's own (logged as `upstream_request_id`), and the
    client still gets its id echoed."""
    gw = await gateway_factory(vllm_policy(vllm))
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2}
    headers = {"x-request-id": "tool-req-42"}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200 and resp.headers["x-request-id"] == "tool-req-42"
        answer_id = (await resp.json())["id"]
    sent = orjson.loads(gw.access_log.getvalue().splitlines()[-1])["upstream_request_id"]
    assert answer_id == f"chatcmpl-{sent}" and "tool-req-42" not in answer_id


async def test_usage_chunk_is_last_before_done(vllm, gateway_factory, http) -> None:
    gw = await gateway_factory(vllm_policy(vllm))
    for path, fields in (
        ("/v1/chat/completions", {"messages": CHAT}),
        ("/v1/completions", {"prompt": "the seller"}),
    ):
        body = {"model": "tiny", **fields, "max_tokens": 6, "stream": True}
        body["stream_options"] = {"include_usage": True}
        data = await events(http, gw.url + path, body)
        assert data[-1] == "[DONE]"
        usage = json.loads(data[-2])
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
        assert all("usage" not in json.loads(d) or not json.loads(d)["usage"] for d in data[:-2])


async def test_vllm_errors_reach_the_client_intact(vllm, gateway_factory, http) -> None:
    policy = vllm_policy(vllm)
    # A model the policy routes to vLLM but vLLM does not serve: vLLM's own 404.
    policy["models"]["ghost"] = {**policy["models"]["tiny"]}
    policy["pools"]["ghost"] = {**policy["pools"]["main"], "model": "ghost"}
    policy["routes"].append({"match": {"model": "ghost"}, "pool": "ghost"})
    gw = await gateway_factory(policy)
    # One token per "review " (plus <bos>): over vLLM's max-model-len, under the policy's.
    too_long = "review " * (MAX_MODEL_LEN + 1000)
    assert MAX_MODEL_LEN + 1000 < POLICY_MAX_MODEL_LEN - 100  # room for the chat template too
    for body, status in (
        ({"model": "ghost", "messages": CHAT, "max_tokens": 2}, 404),
        ({"model": "tiny", "messages": [{"role": "user", "content": too_long}]}, 400),
    ):
        answers = []
        for base in (vllm.url, gw.url):
            async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
                answers.append((resp.status, await resp.json()))
        assert answers[1] == answers[0] and answers[0][0] == status
    with pytest.raises(openai.NotFoundError):
        await client(gw.url).chat.completions.create(model="ghost", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await client(gw.url).completions.create(model="tiny", prompt=too_long, max_tokens=2)
