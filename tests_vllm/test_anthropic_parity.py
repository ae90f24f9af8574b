"""The gateway's `/v1/messages` counts equal vLLM 0.32's own, on the real tokenizers (issue 29).

vLLM serves Anthropic's Messages API by converting each request to a chat request
(vllm/entrypoints/anthropic/serving.py `to_chat_completion_request`) and rendering that with the
model's template. tests_vllm/vllm_render.py runs exactly that in vLLM's environment: the body
validated as `AnthropicMessagesRequest`, converted (inline system messages merged when the
renderer's templates refuse them, as `_should_merge_inline_system` decides), then the chat
render path tests_vllm/test_render_parity.py checks, to the `prompt_token_ids` vLLM reports as
usage. The gateway's side is the pipeline's: `parse` with the messages API, then its `count`.

The requests are what agents send: a system prompt as a string and as blocks (with Claude
Code's billing header), inline system reminders, multi-turn text, tool definitions (with and
without a schema `type`), tool uses and their results (as a string, as text items, with a tool
reference), an assistant's tool result, thinking and redacted thinking blocks, empty text blocks,
`tool_choice` of each kind, tools added and removed by system messages (and the refusals of
an undeclared one and of a change outside a system message), `output_config.effort`, `thinking` of each type (`disabled` as the
effort vLLM's serving probes its renderer for) and `chat_template_kwargs`.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.api import MESSAGES, Api
from gateway.context.ctx import Ctx
from gateway.errors import BadRequest
from gateway.policy.compile import load_policy
from gateway.request.parse import parse
from loadtest.real_tokenizers import directory
from tests_vllm.test_render_parity import (
    MAX_MODEL_LEN,
    MODELS,
    TOOL_PARSERS,
    agree,
    show,
    start_vllm,
    write_policy,
)

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city"}},
        "required": ["city"],
    },
}
SEARCH = {"name": "search", "input_schema": {"properties": {"q": {"type": "string"}}}}
BILLING = "x-anthropic-billing-header: cc_version=1.0.0; cch=abc123;"


def body(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": messages, **fields}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


TOOL_TURN = [
    user("What's the weather in Paris and in Tokyo?"),
    assistant(
        [
            text("Let me check both."),
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
             "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_02", "name": "get_weather",
             "input": {"city": "Tokyo", "unit": "c", "nested": {"a": [1, 2.5, None, True]}}},
        ]
    ),
    user(
        [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18°C, sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_02",
             "content": [text("22°C"), text("humid, 日本語")]},
            text("Thanks, and summarise."),
        ]
    ),
]  # fmt: skip

CASES: list[dict[str, Any]] = [
    body([user("Hello there")]),
    body([user("Hello")], system="You are a helpful assistant."),
    body([user("Hello")], system=[text("You are Claude Code."), text(" Be brief.")]),
    body([user("Hi")], system=[text(BILLING), text("You are an agent.")]),
    body([user("Hi")], system=f"{BILLING}\nYou are an agent."),
    body([user("One"), assistant("Two"), user("Three")], system="Count."),
    body([user([text("a"), text(""), text("b")])]),
    body([user([text("only one block")])]),
    body(
        [
            user("first"),
            {"role": "system", "content": "<reminder>be careful</reminder>"},
            user("second"),
        ],
        system="Main system prompt.",
    ),
    body([{"role": "system", "content": [text(BILLING)]}, user("no inline text left")]),
    body(TOOL_TURN, tools=[WEATHER]),
    body(TOOL_TURN, tools=[WEATHER, SEARCH], tool_choice={"type": "auto"}),
    body(TOOL_TURN, tools=[WEATHER], tool_choice={"type": "any"}),
    body(TOOL_TURN, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}),
    body(TOOL_TURN, tools=[WEATHER], tool_choice={"type": "none"}),
    body(
        [
            user("search"),
            assistant([{"type": "tool_use", "id": "t1", "name": "search", "input": {}}]),
            user(
                [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [
                            text("found"),
                            {"type": "tool_reference", "tool_name": "search"},
                        ],
                    }
                ]
            ),
        ],
        tools=[SEARCH],
    ),
    body(
        [
            user("q"),
            assistant([{"type": "tool_result", "tool_use_id": "x", "content": [text("odd")]}]),
            user("next"),
        ]
    ),
    body(
        [
            user("Think"),
            assistant(
                [
                    {"type": "thinking", "thinking": "Let me reason.", "signature": "sig"},
                    text("Done."),
                ]
            ),
            user("More"),
        ]
    ),
    body(
        [
            user("x"),
            assistant([{"type": "redacted_thinking", "data": "opaque"}, text("ok")]),
            user("y"),
        ]
    ),
    body([user("effort")], output_config={"effort": "low"}),
    body([user("kwargs")], chat_template_kwargs={"enable_thinking": False}),
    body([user("budget")], thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048),
    body([user("no thinking")], thinking={"type": "disabled"}),
    body(
        [
            {
                "role": "system",
                "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "search"}},
                    {
                        "type": "tool_addition",
                        "tool": {
                            "type": "tool_definition",
                            "definition": {
                                "name": "clock",
                                "description": "Now.",
                                "input_schema": {},
                            },
                        },
                    },
                    {
                        "type": "tool_removal",
                        "tool": {"type": "tool_reference", "name": "get_weather"},
                    },
                ],
            },
            user("what time is it"),
        ],
        tools=[WEATHER, {**SEARCH, "defer_loading": True}],
    ),
    body(
        [
            {
                "role": "system",
                "content": [
                    {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "missing"}}
                ],
            },
            user("x"),
        ],
        tools=[WEATHER],
    ),
    body([user([{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}])]),
    body(
        [user("no thinking, high")], thinking={"type": "disabled"}, output_config={"effort": "high"}
    ),
    body([user("adaptive")], thinking={"type": "adaptive"}, output_config={"effort": "max"}),
    body(
        [
            user("t"),
            assistant([{"type": "tool_use", "name": "get_weather", "id": "a", "input": {}}]),
        ],
        tools=[WEATHER],
    ),
]


async def gateway_count(
    policy: Any, model: str, request: dict[str, Any], api: Api
) -> dict[str, Any]:
    """The pipeline's parse and `api`'s count of `request`, or its refusal."""
    ctx = Ctx("parity", api, api.path, CIMultiDictProxy(CIMultiDict()), 0.0)
    counter = policy.models[model].counter
    try:
        parse(ctx, "application/json", orjson.dumps(request), policy.spec.server)
        tokens, _ = await api.count(ctx.body, counter, MAX_MODEL_LEN, 0)
    except BadRequest as exc:
        return {"refused": exc.status, "error": f"BadRequest: {exc}"[:500]}
    return {"tokens": tokens}


Counted = Callable[[Any, str, dict[str, Any], Api], Awaitable[dict[str, Any]]]


async def collect(
    tmp_path: Path,
    api: Api,
    cases: list[dict[str, Any]],
    kind: str | None = None,
    counted: Counted = gateway_count,
) -> list[str]:
    """`cases` counted on each real tokenizer by the gateway's `api` (`counted`) and by vLLM's
    own serving of that API (tests_vllm/vllm_render.py, its `kind` of job: the API's name
    unless told); a line per disagreement."""
    bodies = {model: [{**copy.deepcopy(c), "model": model} for c in cases] for model in MODELS}
    jobs = [
        {
            "tokenizer": str(directory(model)),
            "max_model_len": MAX_MODEL_LEN,
            "tool_parser": TOOL_PARSERS[model],
            "bodies": bodies[model],
            "api": kind or api.name,
        }
        for model in MODELS
    ]
    vllm = start_vllm(jobs, tmp_path)
    try:
        ours = {}
        for model in MODELS:
            policy = load_policy(write_policy(tmp_path, model))
            ours[model] = [await counted(policy, model, b, api) for b in bodies[model]]
            policy.close()
        out, err = vllm.communicate(timeout=600)
    finally:
        if vllm.poll() is None:
            vllm.kill()
            vllm.wait()
    assert vllm.returncode == 0, err.decode(errors="replace")[-5000:]
    theirs = json.loads(out)["results"]
    failures = []
    for model, results in zip(MODELS, theirs, strict=True):
        for index, (mine, vllms) in enumerate(zip(ours[model], results, strict=True)):
            if not agree(mine, vllms):
                failures.append(
                    f"{model} #{index}: gateway {show(mine)}, vLLM {show(vllms)}\n"
                    f"  request: {json.dumps(bodies[model][index])[:1500]}"
                )
        counted = sum("tokens" in v for v in results)
        print(f"{model}: {counted} of {len(results)} counted by vLLM")
    return failures


def test_messages_count_as_vllm_counts_them(tmp_path: Path) -> None:
    failures = asyncio.run(collect(tmp_path, MESSAGES, CASES))
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(pytest.main([__file__, "-q", "-s"]))
