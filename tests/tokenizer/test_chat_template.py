"""Chats are rendered and counted as vLLM 0.32 renders them, on the real tokenizers, and hostile
chat input is refused before any tokenizer time (gateway/tokenizer/chat_template.py, gateway/api/chat.py)."""

from __future__ import annotations

import time
from collections import ChainMap
from collections.abc import Iterator
from functools import cache
from typing import Any

import orjson
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.api import CHAT, Api
from gateway.config.schema import ServerSpec
from gateway.context.ctx import Ctx
from gateway.errors import BadRequest
from gateway.request.parse import parse
from gateway.tokenizer import chat_template
from gateway.tokenizer.chat_template import ChatTemplate
from gateway.tokenizer.counters import HFCounter
from loadtest.real_tokenizers import directory
from tests.conftest import real_reference

PROSE = (
    "The committee reviewed the quarterly figures and agreed that the new warehouse would open"
    " in the spring, provided the contractors finished the loading bays on time. "
)


@cache
def template(name: str) -> ChatTemplate:
    return ChatTemplate(real_reference(name))


def hf_render(name: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """transformers' own render, the way vLLM calls it."""
    kwargs.setdefault("add_generation_prompt", True)
    return str(real_reference(name).apply_chat_template(messages, tokenize=False, **kwargs))


def parsed(body: dict[str, Any], api: Api = CHAT, **limits: Any) -> Ctx:
    ctx = Ctx("r", api, "/v1/chat/completions", CIMultiDictProxy(CIMultiDict()), 0.0)
    parse(ctx, "application/json", orjson.dumps(body), ServerSpec(**limits))
    return ctx


def refused(body: dict[str, Any], **limits: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        parsed(body, **limits)
    return info.value


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **fields}


TEXT_PARTS = [
    {"type": "text", "text": "plain text part"},
    {"type": "input_text", "text": "a Responses API input text"},
    {"type": "output_text", "text": "a Responses API output text"},
    {"type": "refusal", "refusal": "I cannot help with that"},
    {"type": "thinking", "thinking": "first, the units", "closed": True},
    "a bare string part",
]
PART_TEXTS = [
    "plain text part",
    "a Responses API input text",
    "a Responses API output text",
    "I cannot help with that",
    "first, the units",
    "a bare string part",
]


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
@pytest.mark.parametrize("index", range(len(TEXT_PARTS)))
def test_every_text_part_type_renders_as_its_text_for_a_string_template(
    name: str, index: int
) -> None:
    body = chat({"role": "tool", "content": ["before", TEXT_PARTS[index], "after"]})
    expected = hf_render(name, [{"role": "tool", "content": f"before\n{PART_TEXTS[index]}\nafter"}])
    assert template(name).render(body) == expected


@pytest.mark.parametrize("index", range(len(TEXT_PARTS)))
def test_every_text_part_type_reaches_gemmas_parts_template_as_a_text_part(index: int) -> None:
    assert template("gemma3").takes_parts  # Gemma 3 loops over content parts: vLLM's "openai"
    body = chat({"role": "user", "content": [TEXT_PARTS[index]]})
    expected = hf_render(
        "gemma3", [{"role": "user", "content": [{"type": "text", "text": PART_TEXTS[index]}]}]
    )
    assert template("gemma3").render(body) == expected


def test_an_image_reaches_gemma_as_an_image_part_and_its_placeholder_is_known() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = chat({"role": "user", "content": [{"type": "text", "text": "describe"}, image]})
    parts = [{"type": "text", "text": "describe"}, {"type": "image"}]
    assert template("gemma3").render(body) == hf_render(
        "gemma3", [{"role": "user", "content": parts}]
    )
    assert template("gemma3").image_placeholder == "<start_of_image>"
    assert template("qwen3").image_placeholder == ""  # vLLM adds a string template's placeholder


async def test_a_huge_input_text_part_is_counted_in_full() -> None:
    text = PROSE * 400
    counter = HFCounter.load(str(directory("qwen3")))
    alone = len(real_reference("qwen3").encode(text, add_special_tokens=False))
    body = chat({"role": "tool", "content": [{"type": "input_text", "text": text}]})
    assert await counter.count_chat(body) >= alone


def test_qwen_renders_tools_tool_calls_and_reasoning_as_transformers_does() -> None:
    tool = {
        "type": "function",
        "function": {"name": "weather", "parameters": {"type": "object"}, "x-vendor": 1},
    }
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Call the tool.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    dumped_tool = {
        "type": "function",
        "function": {"name": "weather", "description": None, "parameters": {"type": "object"}},
    }
    parsed_call = {**call, "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    expected = hf_render(
        "qwen3",
        [
            messages[0],
            {"role": "assistant", "content": "", "tool_calls": [parsed_call],
             "reasoning": "Call the tool.", "reasoning_content": "Call the tool."},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        ],
        tools=[dumped_tool],
    )  # fmt: skip
    rendered = template("qwen3").render(chat(*messages, tools=[tool]))
    assert rendered == expected
    assert '"arguments": {"city": "Paris"}' in rendered and "Call the tool." in rendered


def test_reasoning_effort_none_turns_qwens_thinking_off_and_unknown_kwargs_are_dropped() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = chat(*messages, reasoning_effort="none", chat_template_kwargs={"padding": True, "x": 1})
    assert template("qwen3").render(body) == hf_render("qwen3", messages, enable_thinking=False)


def test_developer_messages_become_one_system_message_where_the_template_has_no_developer() -> None:
    body = chat(
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Use French."},
    )
    merged = [
        {"role": "system", "content": "Answer briefly.\n\nUse French."},
        {"role": "user", "content": "hi"},
    ]
    assert template("qwen3").render(body) == hf_render("qwen3", merged)


def test_a_string_false_is_false_for_add_generation_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}]
    rendered = template("qwen3").render(chat(*messages, add_generation_prompt="false"))
    assert rendered == hf_render("qwen3", messages, add_generation_prompt=False)


def test_a_template_error_is_a_400_on_messages() -> None:
    body = chat({"role": "assistant", "content": "no user turn first"})
    with pytest.raises(BadRequest) as info:
        template("gemma3").render(body)
    assert info.value.param == "messages" and "user/assistant/user/assistant" in info.value.message


def test_template_variables_override_special_tokens_but_never_the_messages() -> None:
    """The request's variables reach the template after the special tokens, as transformers
    passes them; one naming `messages` is refused as transformers' own call refuses it (two
    values for one keyword), never rendered in place of the conversation it counts."""
    messages = [{"role": "user", "content": "hi"}]
    body = chat(*messages, chat_template_kwargs={"bos_token": "<own>"})
    assert template("gemma3").render(body) == hf_render("gemma3", messages, bos_token="<own>")
    assert template("gemma3").render(body).startswith("<own>")
    body = chat(*messages, chat_template_kwargs={"messages": []})
    with pytest.raises(BadRequest) as info:
        template("gemma3").render(body)
    assert info.value.param == "messages" and "'messages'" in info.value.message


def test_a_render_copies_none_of_the_environments_globals(monkeypatch: pytest.MonkeyPatch) -> None:
    """The template's globals (jinja's and transformers' `raise_exception`, a `ChainMap`) are
    flattened when the template is loaded: jinja's `Template.render` walks them in Python on every
    call (docs/benchmarks.md, issue 39)."""
    messages = [{"role": "user", "content": "hi"}]
    loaded = template("qwen3")
    expected = hf_render("qwen3", messages)

    def walked(self: ChainMap[Any, Any]) -> Iterator[Any]:
        raise AssertionError("the environment's globals were walked for a request")

    monkeypatch.setattr(ChainMap, "__iter__", walked)
    assert loaded.render(chat(*messages)) == expected
    with pytest.raises(BadRequest, match="user/assistant/user/assistant"):  # still raised
        template("gemma3").render(chat({"role": "assistant", "content": "no user turn first"}))


def test_a_chat_setting_no_template_keyword_gets_the_keywords_worked_out_at_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chat without any of `KEYWORD_FIELDS` is rendered with the keywords of an empty body,
    found when the template loaded; one with any of them works its own out."""
    messages = [{"role": "user", "content": "hi"}]
    loaded = template("qwen3")
    thinking_off = hf_render("qwen3", messages, enable_thinking=False)

    def per_request(body: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("a plain chat's template keywords were worked out per request")

    monkeypatch.setattr(chat_template, "template_kwargs", per_request)
    assert loaded.render(chat(*messages, max_tokens=5)) == hf_render("qwen3", messages)
    monkeypatch.undo()
    assert loaded.render(chat(*messages, reasoning_effort="none")) == thinking_off


def test_keyword_fields_are_every_field_template_kwargs_reads() -> None:
    """Else a field added to `template_kwargs` would be ignored for a chat taking the plain path."""

    class Reading(dict[str, Any]):
        read: set[str] = set()

        def get(self, key: str, default: Any = None) -> Any:
            self.read.add(key)
            return super().get(key, default)

        def __getitem__(self, key: str) -> Any:
            self.read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key: object) -> bool:
            self.read.add(str(key))
            return super().__contains__(key)

    chat_template.template_kwargs(Reading())
    assert Reading.read == chat_template.KEYWORD_FIELDS


@pytest.mark.parametrize(
    "fields",
    [
        {"chat_template": "{% for i in range(9999999) %}x{% endfor %}"},
        {"chat_template_kwargs": {"chat_template": "{{ 'x' * 99999999 }}"}},
    ],
)
def test_a_clients_chat_template_is_refused_before_rendering(fields: dict[str, Any]) -> None:
    error = refused(chat({"role": "user", "content": "hi"}, **fields))
    assert error.status == 400 and error.param == "chat_template"
    assert "--trust-request-chat-template is not set" in error.message


def test_a_huge_role_is_refused_in_microseconds() -> None:
    spent = []
    for _ in range(5):  # the fastest of five: a busy machine's pause falls on one, not all
        started = time.perf_counter()
        error = refused(chat({"role": "u" * 6_000_000, "content": "hi"}))
        spent.append(time.perf_counter() - started)
        assert error.code == "role_too_long" and error.param == "messages[0].role"
    assert min(spent) < 0.1


@pytest.mark.parametrize(
    "message, fields",
    [
        ({"role": "user", "content": "hi", "name": "n" * 2000}, {}),
        ({"role": "tool", "content": "hi", "tool_call_id": "i" * 2000}, {}),
        ({"role": "assistant", "content": "hi", "reasoning_content": "r" * 2000}, {}),
        (
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "a" * 2000}}
            ]},
            {},
        ),
        ({"role": "user", "content": [{"type": "thinking", "thinking": "t" * 2000}]}, {}),
        ({"role": "user", "content": "hi"}, {"chat_template_kwargs": {"date_string": "d" * 2000}}),
        ({"role": "user", "content": "hi"}, {"tools": [{"type": "function", "function": {"name": "f", "description": "d" * 2000}}]}),
        ({"role": "user", "content": "hi"}, {"documents": [{"text": "d" * 2000}]}),
    ],
)  # fmt: skip
def test_every_rendered_field_counts_against_max_prompt_chars(
    message: dict[str, Any], fields: dict[str, Any]
) -> None:
    parsed(chat(message, **fields), max_prompt_chars=4000)  # within the limit: fine
    error = refused(chat(message, **fields), max_prompt_chars=1000)
    assert error.code == "prompt_too_long"


@pytest.mark.parametrize(
    "sent, wants",
    [("false", False), ("False", False), ("0", False), (0, False), ("true", True), ("on", True), (1, True), (None, False)],
)  # fmt: skip
def test_include_usage_is_read_as_vllm_reads_it(sent: Any, wants: bool) -> None:
    body = chat(
        {"role": "user", "content": "hi"}, stream=True, stream_options={"include_usage": sent}
    )
    assert parsed(body).client_wants_usage is wants


@pytest.mark.parametrize(
    "options, wants",
    [({"include_usage": True, "continuous_usage_stats": "on"}, True),
     ({"include_usage": "1", "continuous_usage_stats": 1}, True),
     ({"continuous_usage_stats": True}, False),  # vLLM sends none without `include_usage`
     ({"include_usage": True, "continuous_usage_stats": None}, False)],
)  # fmt: skip
def test_continuous_usage_stats_is_read_as_vllm_reads_it(
    options: dict[str, Any], wants: bool
) -> None:
    body = chat({"role": "user", "content": "hi"}, stream=True, stream_options=options)
    assert parsed(body).client_wants_continuous is wants


@pytest.mark.parametrize("sent, stream", [("yes", True), ("off", False), (None, False)])
def test_stream_is_read_as_vllm_reads_it(sent: Any, stream: bool) -> None:
    assert parsed(chat({"role": "user", "content": "hi"}, stream=sent)).stream is stream


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"stream": True, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": "x"}},
         "stream_options.continuous_usage_stats"),
        ({"stream": 2}, "stream"),
        ({"add_generation_prompt": "sometimes"}, "add_generation_prompt"),
        ({"continue_final_message": None}, "continue_final_message"),
    ],
)  # fmt: skip
def test_what_pydantic_refuses_as_a_boolean_is_a_400(fields: dict[str, Any], param: str) -> None:
    error = refused(chat({"role": "user", "content": "hi"}, **fields))
    assert error.param == param and error.code == "invalid_type"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"continue_final_message": True, "add_generation_prompt": True},
         "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
        ({"stream_options": {"include_usage": True}},
         "Stream options can only be defined when `stream=True`."),
        ({"tools": []}, "`tools` must not be an empty array."),
        ({"reasoning_effort": "extreme"}, "'reasoning_effort' must be one of"),
    ],
)  # fmt: skip
def test_vllms_refusals_before_rendering(fields: dict[str, Any], message: str) -> None:
    assert message in refused(chat({"role": "user", "content": "hi"}, **fields)).message


@pytest.mark.parametrize(
    "part, message",
    [
        ({"type": "made_up", "text": "x"}, "Unsupported chat content part type: 'made_up'"),
        ({"text": "no type"}, "Missing 'type' field in multimodal part."),
        ({"type": 7}, "Invalid 'type' field in multimodal part."),
    ],
)
def test_content_parts_vllm_refuses_are_refused(part: dict[str, Any], message: str) -> None:
    # After a text part, the message validates as vLLM's own type, so its parser sees the part.
    content = [{"type": "text", "text": "a"}, part]
    assert message in refused(chat({"role": "user", "content": content})).message


@pytest.mark.parametrize("call", ["f", {"type": "function", "function": "f"}, {"type": "web"}])
def test_a_tool_call_of_another_shape_is_a_400_not_an_internal_error(call: Any) -> None:
    error = refused(chat({"role": "assistant", "content": "", "tool_calls": [call]}))
    assert error.param is not None and error.param.endswith("tool_calls")


def test_tool_call_arguments_too_deep_for_pythons_parser_are_a_400() -> None:
    """vLLM parses arguments with `json.loads`, which reads them as deep as its recursion goes:
    deeper is no count the gateway could match (vLLM's own answer is a 500)."""
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
    body = chat({"role": "assistant", "content": "", "tool_calls": [call]})
    parsed(body)  # as vLLM's request model takes it
    with pytest.raises(BadRequest, match="nested too deep"):
        template("qwen3").render(body)
