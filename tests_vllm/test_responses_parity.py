"""The gateway's `/v1/responses` counts equal vLLM 0.32's own, on the real tokenizers (issue 29).

vLLM serves the Responses API by turning the request into chat messages and chat tools
(vllm/entrypoints/openai/responses/utils.py `construct_input_messages`,
`construct_tool_dicts`) and rendering them with the model's template
(`OnlineRenderer.render_responses`). tests_vllm/vllm_render.py runs exactly that in vLLM's
environment: the body validated as `ResponsesRequest`, `_validate_create_responses_input`, then
`render_responses`, to the `prompt_token_ids` vLLM reports as `usage.input_tokens`. The
gateway's side is the pipeline's: `parse` with the responses API, then its `count`.

The requests are what the Agents SDK and Codex send: a string input with and without
instructions, message items with text parts, assistant output messages, function and custom
tool calls with their outputs (merged into the assistant turn as vLLM merges them), reasoning
items, an unfinished last message (continued), the developer role, function, namespace, custom
and built-in tools, `reasoning.effort`, `chat_template_kwargs`, and what vLLM refuses.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.api import RESPONSES, Api
from gateway.api.responses import Continued, output_messages, stored_turns
from gateway.context.ctx import Ctx
from gateway.errors import BadRequest
from gateway.request.parse import parse
from tests_vllm.test_anthropic_parity import collect
from tests_vllm.test_render_parity import MAX_MODEL_LEN

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather.",
           "parameters": PARAMETERS, "strict": True}  # fmt: skip
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}'}  # fmt: skip
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "18C and sunny"}


def said(text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant output message, as a previous response's `output` gives it back."""
    content = [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": "msg_1", "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def body(input_: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": input_, **fields}


CASES: list[dict[str, Any]] = [
    body("Summarize the plot of Hamlet in one line."),
    body("What is 2 + 2?", instructions="You are a terse calculator."),
    body(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]},
            said("Hi! How can I help?"),
            {"role": "user", "content": "Tell me a joke."},
        ],
        instructions="Be funny.",
    ),
    body([{"role": "user", "content": "Weather in Paris?"}, CALL, OUTPUT], tools=[WEATHER]),
    body(
        [{"role": "user", "content": "Weather?"}, said("Checking."), CALL, OUTPUT],
        tools=[WEATHER, {"type": "web_search_preview"}],
    ),
    body(
        "Use the tools.",
        tools=[
            {"type": "function", "name": "plain"},
            {"type": "function", "name": "loose", "parameters": PARAMETERS, "strict": False},
            {
                "type": "namespace",
                "name": "maps",
                "description": "Maps.",
                "tools": [{"type": "function", "name": "route", "parameters": PARAMETERS}],
            },
            {"type": "custom", "name": "shell", "description": "Run a command."},
        ],
    ),
    body(
        [
            {"role": "user", "content": "List files."},
            {"type": "custom_tool_call", "call_id": "c9", "name": "shell", "input": "ls -la"},
            {"type": "custom_tool_call_output", "call_id": "c9", "output": "README.md"},
        ],
        tools=[{"type": "custom", "name": "shell"}],
    ),
    body(
        [
            {"role": "user", "content": "Think first."},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Let me think."}],
            },
            said("Done thinking."),
            {"role": "user", "content": "And?"},
        ]
    ),
    body(
        [
            {
                "type": "reasoning",
                "id": "rs_2",
                "summary": [{"type": "summary_text", "text": "A summary."}],
            },
            {"role": "user", "content": "Go on."},
        ]
    ),
    body(
        [{"role": "user", "content": "Finish my sentence:"}, said("The quick brown", "incomplete")]
    ),
    body(
        [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    ),
    body([{"type": "message", "role": "user", "content": "typed message item"}]),
    body("Plan a trip.", reasoning={"effort": "low"}),
    body("Plan a trip.", reasoning={"effort": "none"}),
    body("Plan a trip.", chat_template_kwargs={"enable_thinking": False}),
    body("Weather?", tools=[WEATHER], tool_choice="none"),
    body([], instructions="Only instructions."),
    body([{"role": "user", "content": "x"}, {**CALL, "namespace": "maps"}, OUTPUT]),
    # A call merged into the client's own content-less assistant message, counted once.
    body(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": []}, CALL, OUTPUT],
        tools=[WEATHER],
    ),
    # What vLLM refuses.
    body([{"type": "nonsense"}]),
    body([{"type": "reasoning", "id": "rs_3", "summary": [], "encrypted_content": "opaque"}]),
]


def test_responses_count_as_vllm_counts_them(tmp_path: Path) -> None:
    failures = asyncio.run(collect(tmp_path, RESPONSES, CASES))
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


# --- conversations continued by `previous_response_id`: each turn renders the turn before's
# stored messages (system ones left out) and its output's text, then its own input ------------

REASONED = {"type": "reasoning", "id": "rs_9", "summary": [],
            "content": [{"type": "reasoning_text", "text": "The user wants weather."}]}  # fmt: skip
CALLED = {**CALL, "id": "fc_1", "status": "completed"}
TWO_PARTS = {**said("First part."), "content": [
    {"type": "output_text", "text": "First part.", "annotations": []},
    {"type": "output_text", "text": " Second part.", "annotations": []},
]}  # fmt: skip


def turn(body_: dict[str, Any], *output: dict[str, Any]) -> dict[str, Any]:
    return {"body": body_, "output": list(output)}


CHAINS: list[dict[str, Any]] = [
    {"turns": [
        turn(body("Summarize Hamlet.", instructions="Be terse."), said("Hamlet dithers.")),
        turn(body("And Macbeth?"), said("He kills the king.")),
        turn(body([{"role": "user", "content": "Compare them."}], instructions="One word."),
             said("Ambition.")),
    ]},
    {"turns": [
        turn(body([{"role": "system", "content": "Be kind."},
                   {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]),
             TWO_PARTS),
        turn(body([{"role": "developer", "content": "Answer in French."},
                   {"role": "user", "content": "Tell me a joke."}]),
             said("Pourquoi?", "incomplete")),
        turn(body("Another.", instructions="Be funny.")),
    ]},
    {"turns": [
        turn(body("Weather in Paris?", tools=[WEATHER]), REASONED, CALLED),
        turn(body([OUTPUT, {"role": "user", "content": "Thanks; and Rome?"}], tools=[WEATHER]),
             REASONED, said("Rome is 21C.")),
        turn(body("Summarize.")),
    ]},
    {"turns": [
        turn(body("First.", store=True), said("")),
        turn(body([{"role": "user", "content": "Second."}, said("Half an ans", "incomplete")]),
             said("wer, finished.")),
        turn(body("Third.")),
    ]},
]  # fmt: skip


async def gateway_chain(policy: Any, model: str, chain: dict[str, Any], api: Api) -> dict[str, Any]:
    """Each turn's count as the gateway makes it: the turn's body parsed, carrying the turns
    the gateway stored of those before it (gateway/request/holders.py `remember`), then counted."""
    counter = policy.models[model].counter
    counts, turns = [], None
    try:
        for step in chain["turns"]:
            ctx = Ctx("parity", api, api.path, CIMultiDictProxy(CIMultiDict()), 0.0)
            parse(ctx, "application/json", orjson.dumps(step["body"]), policy.spec.server)
            given = ctx.body if turns is None else Continued(ctx.body, turns)
            counts.append((await api.count(given, counter, MAX_MODEL_LEN, 0))[0])
            turns = stored_turns(given, output_messages(step["output"]) or [])
    except BadRequest as exc:
        return {"refused": exc.status, "error": f"BadRequest: {exc}"[:500]}
    return {"tokens": counts}


def test_continued_conversations_count_as_vllm_counts_them(tmp_path: Path) -> None:
    failures = asyncio.run(collect(tmp_path, RESPONSES, CHAINS, "responses_chain", gateway_chain))
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)
