"""`POST /v1/messages`: Anthropic's Messages API, counted as vLLM 0.32 serves it.

vLLM converts a messages request to a chat request (vllm/entrypoints/anthropic/serving.py
`to_chat_completion_request`) and renders that with the model's chat template, so the gateway
does the same: `to_chat` is that conversion, rule for rule (the system prompt joined, Claude
Code's billing header dropped, inline system messages merged into it when the template refuses
them, tool results as tool messages, tool uses as tool calls, thinking as reasoning, tools as
function tools after the system messages' tool additions and removals, `thinking` and
`output_config` as `reasoning_effort`), and the chat's own counting
(gateway/api/chat.py) renders and counts the result, so the count is vLLM's.

Parse checks the shape vLLM's request model validates (protocol.py), `max_tokens` required, and
bounds the input with the chat's limits (`max_messages`, `max_content_parts` over every block,
`max_prompt_chars` over everything a template may print). vLLM asks its own chat layer for a
stream's usage (`include_usage` and `continuous_usage_stats`), so the replica needs no extra
field; the answer's usage is `usage.input_tokens` (+ the cache fields vLLM splits off) and
`output_tokens`, in a stream on `message_start` and then `message_delta`. Refusals are
Anthropic's `{"type": "error", "error": {"type", "message"}}` (`anthropic_status` says which
status and type each gateway refusal takes), a broken stream ends with an `event: error`.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.api.chat import check_message_list
from gateway.api.fields import check_prompt_chars, lax_int, text_chars
from gateway.api.json_body import JsonApi
from gateway.api.openai import is_tokens
from gateway.context.endpoint import FINGERPRINT_CHARS, SAMPLE_TEXT
from gateway.errors import BadRequest, GatewayError
from gateway.tokenizer.chat_template import lax_bool
from gateway.tokenizer.counters import HFCounter

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gateway.config.schema import ServerSpec
    from gateway.context.ctx import Ctx
    from gateway.state.base import Window
    from gateway.tokenizer.counters import TokenCounter

_BILLING_HEADER = "x-anthropic-billing-header"
_ROLES = frozenset({"user", "assistant", "system"})
_BLOCK_TYPES = frozenset(
    {"text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
     "redacted_thinking", "tool_addition", "tool_removal"}
)  # fmt: skip
# Block fields by the type vLLM's `AnthropicContentBlock` gives them.
_STR_FIELDS = ("text", "id", "tool_use_id", "name", "tool_name", "thinking", "signature", "data")
_DICT_FIELDS = ("source", "input")
_TOOL_CHANGES = ("tool_addition", "tool_removal")
_TOOL_CHOICES = frozenset({"auto", "any", "tool", "none"})
_EFFORTS = frozenset({"low", "medium", "high", "xhigh", "max"})
_THINKING = frozenset({"enabled", "disabled", "adaptive"})

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); a status not
# named here is an `invalid_request_error` below 500 and an `api_error` from 500.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
OVERLOADED = 529


def anthropic_status(error: GatewayError) -> tuple[int, str]:
    """The status and Anthropic error type of a refusal. The pool having no room for the
    request (`queue_full`, `shed`, `queue_timeout`, `queue_wait_too_long`: the refusals counted
    as demand) is Anthropic's 529 `overloaded_error`, which its clients back off from and retry;
    the tenant's own windows stay 429 `rate_limit_error`; every other refusal keeps its status."""
    status = OVERLOADED if error.refusal.counts_as_demand else error.status
    kind = _ERROR_TYPES.get(status)
    if kind is None:
        kind = "invalid_request_error" if status < 500 else "api_error"
    return status, kind


def error_body(error: GatewayError) -> bytes:
    _, kind = anthropic_status(error)
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": error.message}})


def error_response(error: GatewayError, headers: dict[str, str] | None = None) -> web.Response:
    """A refusal in Anthropic's shape, with the refusal's own headers (`Retry-After`,
    `x-should-retry`, which Anthropic's SDKs obey too)."""
    status, _ = anthropic_status(error)
    return web.Response(
        status=status,
        body=error_body(error),
        content_type="application/json",
        headers={**error.headers(), **(headers or {})},
    )


def _reset_at(seconds: float) -> str:
    """Anthropic's reset: an RFC 3339 time, to the second."""
    at = datetime.fromtimestamp(time.time() + seconds, UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def ratelimit_headers(windows: Mapping[str, Window], out: dict[str, str]) -> None:
    """`anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}` for the binding windows.
    The gateway's token windows count input and output together: Anthropic's `tokens` ones."""
    for kind, window in windows.items():
        out[f"anthropic-ratelimit-{kind}-limit"] = str(window.limit)
        out[f"anthropic-ratelimit-{kind}-remaining"] = str(window.remaining)
        out[f"anthropic-ratelimit-{kind}-reset"] = _reset_at(window.reset_s)


def _refuse(param: str, message: str, code: str = "invalid_type") -> BadRequest:
    return BadRequest(f"'{param}' {message}", param=param, code=code)


def _optional(value: Any, kinds: type | tuple[type, ...], param: str, what: str) -> None:
    if value is not None and not isinstance(value, kinds):
        raise _refuse(param, f"must be {what}")


class _Size:
    """What a request may have a template print, and its parts and images, as parse walks it."""

    __slots__ = ("chars", "images", "parts")

    def __init__(self) -> None:
        self.chars = self.parts = self.images = 0


def _check_result_content(content: Any, param: str, size: _Size, role: str) -> None:
    """A `tool_result`'s `content`: a string or a list of objects (text, image, tool_reference
    items are read; others skipped, as vLLM skips them). Only a user's result has its images
    sent as images; an assistant's is printed whole."""
    if content is None or isinstance(content, str):
        size.chars += len(content or "")
        return
    if not isinstance(content, list):
        raise _refuse(param, "must be a string or an array of objects")
    size.parts += len(content)
    for item in content:
        if not isinstance(item, dict):
            raise _refuse(param, "must be a string or an array of objects")
        kind = item.get("type")
        if kind == "image":
            _optional(item.get("source"), dict, f"{param}.source", "an object")
            size.images += role == "user"
        elif kind == "tool_reference":
            for field in ("tool_name", "name"):
                _optional(item.get(field), str, f"{param}.{field}", "a string")
            size.chars += text_chars(item)
        elif kind == "text":
            text = item.get("text", "")
            if not isinstance(text, str):
                raise _refuse(f"{param}.text", "must be a string")
            size.chars += len(text)
        else:  # a tool reference's name, or what an assistant's result prints whole
            size.chars += text_chars(item)


def _check_blocks(blocks: Any, param: str, size: _Size, role: str) -> None:
    if isinstance(blocks, str):
        size.chars += len(blocks)
        return
    if not isinstance(blocks, list):
        raise _refuse(param, "must be a string or an array of content blocks")
    size.parts += len(blocks)
    for index, block in enumerate(blocks):
        where = f"{param}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in _BLOCK_TYPES:
            raise _refuse(f"{where}.type", f"must be one of {', '.join(sorted(_BLOCK_TYPES))}")
        if kind in _TOOL_CHANGES:
            _check_tool_change(block, kind, where, role, size)
            continue
        for field in _STR_FIELDS:
            _optional(block.get(field), str, f"{where}.{field}", "a string")
            size.chars += len(block.get(field) or "") if field != "data" else 0
        for field in _DICT_FIELDS:
            _optional(block.get(field), dict, f"{where}.{field}", "an object")
        lax_bool(block.get("is_error"), f"{where}.is_error", False, nullable=True)
        if kind == "image" and block.get("source"):
            size.images += 1
        elif kind == "tool_use":
            size.chars += text_chars(block.get("input"))
        elif kind == "tool_result":
            _check_result_content(block.get("content"), f"{where}.content", size, role)
            if role != "user":  # printed as its Python repr: bounded by its JSON's strings
                size.chars += text_chars(block.get("content"))


def _check_tool(tool: Any, where: str) -> None:
    """One tool as `AnthropicTool` validates it."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise _refuse(f"{where}.name", "is required and must be a string")
    if not isinstance(tool.get("input_schema"), dict):
        raise _refuse(f"{where}.input_schema", "is required and must be an object")
    _optional(tool.get("description"), str, f"{where}.description", "a string")
    for flag in ("strict", "defer_loading"):
        lax_bool(tool.get(flag), f"{where}.{flag}", False, nullable=True)


def _check_tools(tools: Any, size: _Size) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _refuse("tools", "must be an array of tools")
    for index, tool in enumerate(tools):
        _check_tool(tool, f"tools[{index}]")
    size.chars += text_chars(tools)


def _check_tool_change(
    block: dict[str, Any], kind: str, where: str, role: str, size: _Size
) -> None:
    """A `tool_addition` or `tool_removal` block: only in a system message (not the top-level
    `system`), naming a tool by reference or, to add one, defining it."""
    if role != "system" or where.startswith("system"):
        raise BadRequest(
            f'{kind} blocks are only allowed in messages with role "system"', param=where
        )
    tool = block.get("tool")
    if not isinstance(tool, dict):
        tool = {}
    change = tool.get("type")
    if change == "tool_reference" and isinstance(tool.get("name"), str):
        size.chars += len(tool["name"])
        return
    if change == "tool_definition" and kind == "tool_addition":
        _check_tool(tool.get("definition"), f"{where}.tool.definition")
        size.chars += text_chars(tool)
        return
    allowed = (
        "a tool_reference" if kind == "tool_removal" else "a tool_reference or tool_definition"
    )
    raise _refuse(f"{where}.tool", f"is required and must be {allowed}")


def _check_options(body: dict[str, Any], max_tokens: int | None) -> None:
    """`tool_choice`, `thinking` and `output_config` as vLLM's request model validates them."""
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in _TOOL_CHOICES:
            raise _refuse("tool_choice.type", "must be one of any, auto, none, tool")
        if choice["type"] == "tool" and not (
            isinstance(choice.get("name"), str) and choice["name"]
        ):
            raise _refuse("tool_choice.name", "is required when type is 'tool'", "invalid_value")
        lax_bool(choice.get("disable_parallel_tool_use"), "tool_choice", False, nullable=True)
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in _THINKING:
            raise _refuse("thinking.type", "must be one of adaptive, disabled, enabled")
        if thinking["type"] == "enabled":
            budget = thinking.get("budget_tokens")
            if type(budget) is not int or budget < 1024:
                raise _refuse("thinking.budget_tokens", "must be an integer >= 1024")
            if max_tokens is not None and budget >= max_tokens:
                raise BadRequest(
                    "thinking.budget_tokens must be less than max_tokens",
                    param="thinking.budget_tokens",
                )
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, dict):
            raise _refuse("output_config", "must be an object")
        effort = config.get("effort")
        if effort is not None and effort not in _EFFORTS:
            raise _refuse("output_config.effort", f"must be one of {', '.join(sorted(_EFFORTS))}")
    kwargs = body.get("chat_template_kwargs")
    _optional(kwargs, dict, "chat_template_kwargs", "an object")
    if (kwargs or {}).get("chat_template") is not None:
        raise BadRequest(
            "Chat template is passed with request, but --trust-request-chat-template is not set."
            " Refused request with untrusted chat template.",
            param="chat_template",
        )


def check_messages(body: dict[str, Any], limits: ServerSpec, max_tokens: int | None) -> int:
    """Check a messages request (or a count_tokens one: no `max_tokens`) as vLLM's request
    model does, within the chat's limits; return its images."""
    messages = check_message_list(body, limits)
    size = _Size()
    system = body.get("system")
    if system is not None:
        _check_blocks(system, "system", size, "system")
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            raise _refuse(f"messages[{index}].role", "must be one of assistant, system, user")
        if "content" not in message:
            raise _refuse(f"messages[{index}].content", "is required")
        _check_blocks(message["content"], f"messages[{index}].content", size, role)
        if size.parts > limits.max_content_parts:
            raise BadRequest(
                f"over {limits.max_content_parts} content blocks",
                param="messages",
                code="too_many_parts",
            )
    _check_tools(body.get("tools"), size)
    _check_options(body, max_tokens)
    size.chars += text_chars(body.get("chat_template_kwargs"))
    check_prompt_chars(size.chars, limits, "messages")
    return size.images


# The conversion: vllm/entrypoints/anthropic/serving.py, method by method.


def _image_url(source: dict[str, Any]) -> str:
    """`_convert_image_source_to_url`."""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _system_text(content: Any) -> str | None:
    """`_extract_system_text`."""
    if isinstance(content, str):
        return None if content.startswith(_BILLING_HEADER) else content
    parts = [
        block["text"]
        for block in content
        if block.get("type") == "text"
        and block.get("text")
        and not block["text"].startswith(_BILLING_HEADER)
    ]
    return "".join(parts) if parts else None


def _user_tool_result(block: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """`_convert_user_tool_result`."""
    content = block.get("content")
    text = ""
    images: list[str] = []
    references: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                url = _image_url(item.get("source", {}))
                if url:
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    if images:
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        out.append({"role": "user", "content": parts})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})


def _message(role: str, blocks: list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
    """`_convert_message_content` and `_convert_block`, then `_convert_messages`' append."""
    message: dict[str, Any] = {"role": role}
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id") or f"call_{int(time.time())}",
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result":
            if role == "user":
                _user_tool_result(block, out)
            else:
                content = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {content or ''}"})
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if parts:
        only = len(parts) == 1 and parts[0]["type"] == "text"
        message["content"] = parts[0]["text"] if only else parts
    if not (role == "user" and "content" not in message):
        out.append(message)


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    """`_convert_tools`: a function tool (`input_schema` gets `"type": "object"` if it has no
    type, as `AnthropicTool`'s validator sets it)."""
    schema = tool["input_schema"]
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    function = {
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": schema,
        "strict": tool.get("strict"),
        "defer_loading": tool.get("defer_loading"),
    }
    return {"type": "function", "function": function}


def _resolve_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """`_resolve_tools`: the tools in effect at the conversation's end, once the system
    messages' `tool_addition` and `tool_removal` blocks are applied in order to `tools` (a tool
    added by reference is no longer deferred, one added by definition is declared, a removed
    one dropped); referring to an undeclared tool is vLLM's 400."""
    changes = [
        block
        for message in body["messages"]
        if not isinstance(message["content"], str)
        for block in message["content"]
        if block["type"] in _TOOL_CHANGES
    ]
    if not changes:
        return body.get("tools")
    tools = {tool["name"]: tool for tool in body.get("tools") or ()}
    removed: set[str] = set()
    for block in changes:
        kind, change = block["type"], block["tool"]
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            tools[name] = change["definition"]
        else:
            name = change["name"]
            if name not in tools:
                raise BadRequest(
                    f"{kind} references tool {name!r}, which is not declared in tools",
                    param="messages",
                )
            if kind == "tool_addition":
                tools[name] = {**tools[name], "defer_loading": None}
        if kind == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in tools.items() if name not in removed]


_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat(
    body: dict[str, Any], merge_inline_system: bool, disabled_effort: str
) -> dict[str, Any]:
    """The chat request vLLM renders for a (checked) messages request: what of
    `to_chat_completion_request` reaches the template (messages, tools, the template's
    variables); `merge_inline_system` and `disabled_effort` are the model's template's
    (`ChatTemplate.merges_inline_system`, `.disabled_thinking_effort`)."""
    messages: list[dict[str, Any]] = []
    system_parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str) and system:
        system_parts.append(system)
    elif system:
        system_parts += [
            b["text"]
            for b in system
            if b["type"] == "text" and b.get("text") and not b["text"].startswith(_BILLING_HEADER)
        ]
    if merge_inline_system:
        for message in body["messages"]:
            if message["role"] == "system" and (text := _system_text(message["content"])):
                system_parts.append(text)
    if system_parts:
        messages.append({"role": "system", "content": "".join(system_parts)})
    for message in body["messages"]:
        role, content = message["role"], message["content"]
        if role == "system":
            if not merge_inline_system and (text := _system_text(content)):
                messages.append({"role": "system", "content": text})
        elif isinstance(content, str):
            messages.append({"role": role, "content": content})
        else:
            _message(role, content, messages)
    chat: dict[str, Any] = {"messages": messages}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    effort = (body.get("output_config") or {}).get("effort")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = disabled_effort
    if effort is not None:
        chat["reasoning_effort"] = effort
    tools = _resolve_tools(body)
    if tools is not None:
        chat["tools"] = [_tool(tool) for tool in tools]
    choice = body.get("tool_choice")
    if choice is not None:
        name = choice.get("name")
        named = {"type": "function", "function": {"name": name}}
        chat["tool_choice"] = _CHOICES.get(choice["type"], named)
    elif tools is not None:
        chat["tool_choice"] = "auto"
    return chat


def chat_for(body: dict[str, Any], counter: TokenCounter) -> dict[str, Any]:
    """`to_chat` with what the model's template decides (a counter without one: neither)."""
    if isinstance(counter, HFCounter):
        template = counter.template
        return to_chat(body, template.merges_inline_system, template.disabled_thinking_effort)
    return to_chat(body, False, "none")


_STREAM_END = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
_DELTA = b"event: content_block_delta"


class MessagesApi(JsonApi):
    """Anthropic's Messages API, as vLLM serves it."""

    __slots__ = ()
    name = "messages"
    path = "/v1/messages"
    sample = {"messages": [{"role": "user", "content": SAMPLE_TEXT}], "max_tokens": 16}
    prompt_param = "messages"
    bound_field = "max_tokens"
    openai_fields = False
    stream_end = _STREAM_END

    def parse(self, ctx: Ctx, body: dict[str, Any], limits: ServerSpec) -> tuple[int, int | None]:
        """One prompt; `max_tokens` is required."""
        if body.get("max_tokens") is None:
            raise _refuse("max_tokens", "is required", "invalid_value")
        max_tokens = lax_int(body, "max_tokens")  # as pydantic reads vLLM's `int`
        if max_tokens < 1:
            raise BadRequest("max_tokens must be positive", param="max_tokens")
        ctx.images = check_messages(body, limits, max_tokens)
        return 1, max_tokens

    async def count(
        self, body: dict[str, Any], counter: TokenCounter, refuse_at: int, images: int
    ) -> tuple[int, int]:
        """The chat vLLM converts it to, rendered and counted whole."""
        text = await counter.count_chat(
            body, refuse_at - images, partial(chat_for, counter=counter)
        )
        return images + text, images + text

    async def prompt_ids(
        self, body: dict[str, Any], counter: TokenCounter, special: bool | None = None
    ) -> list[int] | None:
        """The ids of the chat vLLM converts it to: what the replica prefills and caches."""
        return await counter.chat_ids(body, bool(special), partial(chat_for, counter=counter))

    def fingerprint(self, body: dict[str, Any]) -> int:
        """The start of the system prompt (without Claude Code's per-request billing header,
        which would make every request unlike the last), else of the first message."""
        system = body.get("system")
        if not system:
            system = body["messages"][0]["content"]
        if not isinstance(system, str):
            system = "".join(
                b.get("text") or ""
                for b in system
                if b.get("type") == "text" and not (b.get("text") or "").startswith(_BILLING_HEADER)
            )
        elif system.startswith(_BILLING_HEADER):
            system = system.partition("\n")[2]
        return hash(system[:FINGERPRINT_CHARS])

    def input_floor(self, ctx: Ctx, counter: TokenCounter) -> int:
        """The images, as a chat's (gateway/api/chat.py)."""
        return ctx.images * counter.image_cost

    def upstream_fields(self, ctx: Ctx, changes: dict[str, Any]) -> None:
        """Nothing: vLLM asks its chat layer for a stream's usage itself."""

    def read_usage(self, ctx: Ctx, usage: Any) -> None:
        """`output_tokens`, and the prompt as vLLM counted it: `input_tokens` plus the cache
        reads and writes its `_build_anthropic_usage` takes out of it."""
        if not isinstance(usage, dict):
            return
        output = usage.get("output_tokens")
        if not is_tokens(output):
            if output is not None:
                ctx.untrusted_usage = "completion_tokens"
            return
        ctx.output_tokens = output
        prompt = usage.get("input_tokens")
        if not is_tokens(prompt):
            if prompt is not None:
                ctx.untrusted_usage = "prompt_tokens"
            return
        total = prompt
        for cached in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            value = usage.get(cached)
            if is_tokens(value):
                total += value
        ctx.prompt_tokens = total
        read = usage.get("cache_read_input_tokens")
        if is_tokens(read):  # vLLM's `cached_tokens`, split off the input
            ctx.cached_tokens = read

    def usage_event(self, ctx: Ctx, event: dict[str, Any]) -> bool:
        """`message_start` carries the prompt (output 0 so far), `message_delta` the final
        counts; both carry more than usage, so neither is ever dropped."""
        kind = event.get("type")
        if kind == "message_delta":
            self.read_usage(ctx, event.get("usage"))
        elif kind == "message_start":
            message = event.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict) and is_tokens(usage.get("input_tokens")):
                ctx.prompt_tokens = usage["input_tokens"]
        return False

    def deltas(self, events: bytes) -> int:
        """Content deltas: a token each, near enough, should the stream break."""
        return events.count(_DELTA)

    def error_response(
        self, error: GatewayError, headers: dict[str, str] | None = None
    ) -> web.Response:
        return error_response(error, headers)

    def stream_error(self, error: GatewayError) -> bytes:
        return b"event: error\ndata: " + error_body(error) + b"\n\n"

    def ratelimit_headers(self, windows: Mapping[str, Window], out: dict[str, str]) -> None:
        ratelimit_headers(windows, out)


MESSAGES = MessagesApi()
