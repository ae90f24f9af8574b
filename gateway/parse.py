"""The parse stage: decode the body once and check the fields admission depends on.

Only what the gateway itself needs is validated; every other field (`ignore_eos`, `stop`,
`logprobs`, `response_format`, ...) is left for the replica and passes through untouched. The
policy's size limits (`server.max_json_nodes`, `max_json_depth`, `max_messages`,
`max_prompt_chars`) are checked here, so no tokenizer ever sees an input larger than the operator
allowed: `max_prompt_chars` bounds every string a chat template may render (contents, roles,
names, tool calls, reasoning, tools, documents, template variables), not the contents alone.

A field the gateway reads is read as vLLM reads it (booleans as pydantic's lax mode does, so
`"false"` is false), and what vLLM refuses before rendering (a client's chat template, both
`continue_final_message` and `add_generation_prompt`, `stream_options` without `stream`, empty
`tools`) is refused here in its words, before any tokenizer time.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.api.message_types import check_message_type
from gateway.context import Ctx
from gateway.errors import BadRequest, UnsupportedMediaType
from gateway.policy.schema import PRIORITIES, ServerSpec
from gateway.tokenizer.chat_template import extra_fields, lax_bool, part_kind
from gateway.tokenizer.threads import CountingThreads

_PRIORITY_INDEX = {name: index for index, name in enumerate(PRIORITIES)}
DEFAULT_PRIORITY = _PRIORITY_INDEX["standard"]
# Longer than any served name or alias (Hugging Face ids are at most 96 characters).
MAX_MODEL_CHARS = 256
# vLLM takes any role, and templates print it in every turn's header: OpenAI's longest is 9
# characters ("assistant"), custom ones (critic, environment, ipython) stay far below 64.
MAX_ROLE_CHARS = 64
# `reasoning_effort` values vLLM's field accepts (a template may read them).
REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
_UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set."
    " Refused request with untrusted chat template."
)


def _lax_int(body: dict[str, Any], name: str) -> int:
    """A non-negative integer field as pydantic's lax mode reads vLLM's (integral floats and
    numeric strings too); absent or null is 0."""
    value = body.get(name)
    if value is None:
        return 0
    try:
        number = int(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, int):
        raise BadRequest(f"'{name}' must be an integer", param=name, code="invalid_type")
    if number < 0:
        raise BadRequest(f"'{name}' must be >= 0, got {number}", param=name, code="invalid_value")
    return number


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer", param=name, code="invalid_type")
    if value < 1:
        raise BadRequest(f"'{name}' must be >= 1, got {value}", param=name, code="invalid_value")
    return value


_STRUCTURAL = (b",", b":", b"[", b"{")  # an element after the first, a member, a container
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_CURLY_TO_SQUARE = bytes.maketrans(b"{}", b"[]")


def _unescaped(raw: bytes) -> bytes:
    """The body without escape pairs (`\\\\`, then `\\"`, left to right as JSON reads them):
    every quote left opens or closes a string."""
    if b"\\" not in raw:  # a search, far cheaper than two copies
        return raw
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"")


def _outside_strings(unescaped: bytes) -> bytes:
    """The body without its string literals; for any prefix a JSON parser accepts, the quote
    split agrees with its string boundaries."""
    return b"".join(unescaped.split(b'"')[0::2])


def _over(data: bytes, limit: int) -> bool:
    """Whether `data` holds more than `limit` structural characters (bytes.count is C speed;
    commas, the likeliest to settle it, first)."""
    total = 0
    for char in _STRUCTURAL:
        total += data.count(char)
        if total > limit:
            return True
    return False


def _check_nodes(raw: bytes, limit: int) -> bytes | None:
    """Refuse, before anything is built, a body of more than `limit` JSON values.

    Parsing costs per value, not per byte (1.5 million `[]` in 4.5 MB hold the loop for a
    second), so the bound is on structural characters. Counting them in the raw bytes also counts
    commas and colons inside strings; only when that count is over the limit are strings taken
    out for the exact count. Every string but a top-level one comes right after its own `[`, `{`,
    `,` or `:`, so a body with more strings than the limit is refused on its quotes, and the split
    stays small. Returns the
    body outside strings when it was computed, for the depth check.
    """
    if len(raw) <= limit or not _over(raw, limit):
        return None
    too_many = BadRequest(f"body has more than {limit} JSON values", code="json_too_complex")
    unescaped = _unescaped(raw)
    if unescaped.count(b'"') > 2 * (limit + 1):
        raise too_many
    outside = _outside_strings(unescaped)
    if _over(outside, limit):
        raise too_many
    return outside


def _check_depth(raw: bytes, outside: bytes | None, limit: int) -> None:
    """Refuse a body nested deeper than `limit` objects and arrays, at C speed.

    A body with fewer brackets than the limit cannot nest deeper. Otherwise, on its brackets
    outside strings, each pass of `replace("[]", "")` removes exactly the innermost level, so a
    body still non-empty after `limit` passes is deeper; the passes shrink fast and the node
    bound caps the first one.
    """
    if raw.count(b"{") + raw.count(b"[") <= limit:
        return
    if outside is None:
        outside = _outside_strings(_unescaped(raw))
    brackets = outside.translate(_CURLY_TO_SQUARE, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return
        brackets = brackets.replace(b"[]", b"")
    if brackets:
        raise BadRequest(f"body is nested deeper than {limit} levels", code="json_too_deep")


def text_chars(value: Any) -> int:
    """Characters of every string (keys too) in a JSON value a template may print whole."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(map(len, item))
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return total


def _content_chars(content: Any, index: int) -> tuple[int, int]:
    """Characters and image parts of one message's content; its shape is checked on the way.

    Every part is classified as vLLM classifies it (gateway/tokenizer/chat_template.py `part_kind`): the
    text of text-like parts and any field an "openai" template gets counts; images are counted
    apart and charged at the model's `image_tokens` by tokenize (their URLs are no prompt)."""
    param = f"messages[{index}].content"
    if content is None:
        return 0, 0
    if isinstance(content, str):
        return len(content), 0
    if not isinstance(content, list):
        raise BadRequest(f"{param} must be a string or an array of parts", param=param)
    chars = images = 0
    for part in content:
        try:
            kind, value = part_kind(part)
        except BadRequest as exc:
            raise BadRequest(exc.message, param=param) from None
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"{param} parts' text must be a string", param=param)
        images += kind == "image"
        chars += len(value or "") + text_chars(extra_fields(part))
    return chars, images


def check_prompt_chars(chars: int, limits: ServerSpec, param: str) -> None:
    if chars > limits.max_prompt_chars:
        raise BadRequest(
            f"the prompt has {chars} characters, over the {limits.max_prompt_chars} limit",
            param=param,
            code="prompt_too_long",
        )


_TEMPLATE_FLAGS = (("add_generation_prompt", True), ("continue_final_message", False))
# The fields besides role, content and tool calls a template may render (gateway/tokenizer/chat_template.py).
_TEXT_FIELDS = ("name", "tool_call_id", "reasoning", "reasoning_content", "task")


def _message_chars(message: Any, index: int) -> tuple[int, int]:
    """Characters a template may render of one message, and its images; bounded and checked."""
    param = f"messages[{index}]"
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(role, str):
        raise BadRequest(f"{param} must be an object with a string 'role'", param=param)
    if len(role) > MAX_ROLE_CHARS:
        raise BadRequest(
            f"{param}.role is over {MAX_ROLE_CHARS} characters",
            param=f"{param}.role",
            code="role_too_long",
        )
    calls = message.get("tool_calls")
    if isinstance(calls, str | dict):  # vLLM's request model lists any iterable but a list
        calls = message["tool_calls"] = list(calls)
    check_message_type(message, index)  # tool calls included, where vLLM reads them
    chars, images = _content_chars(message.get("content"), index)
    for field in _TEXT_FIELDS:  # of any type: vLLM prints only strings, and only some
        chars += text_chars(message.get(field))
    return len(role) + chars + text_chars(calls) + text_chars(message.get("tools")), images


def _check_tools(tools: Any, choice: Any) -> None:
    """vLLM's refusals of `tools` and `tool_choice` (`check_tool_usage`,
    `ChatCompletionToolsParam`)."""
    if tools is not None:
        _check_tool_list(tools)
    if choice is None or choice == "none":
        return
    if tools is None:
        raise BadRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if not isinstance(choice, dict):
        if choice in ("auto", "required"):
            return
        raise BadRequest(
            f"Invalid value for `tool_choice`: {str(choice)[:100]}! Only named tools, "
            '"none", "auto" or "required" are supported.',
            param="tool_choice",
        )
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
        raise BadRequest(
            "`tool_choice` must name a function: "
            '{"type": "function", "function": {"name": "my_function"}}',
            param="tool_choice.function.name",
        )
    if all(tool["function"]["name"] != name for tool in tools):
        raise BadRequest(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            param="tool_choice",
        )


def _optional_bool(value: Any) -> bool:
    try:
        lax_bool(value, "", False, nullable=True)
    except BadRequest:
        return False
    return True


def _function_tool(tool: Any) -> bool:
    """Whether `tool` validates as vLLM's `ChatCompletionToolsParam`."""
    function = tool.get("function") if isinstance(tool, dict) else None
    return (
        isinstance(function, dict)
        and tool.get("type", "function") == "function"
        and _optional_bool(tool.get("defer_loading"))
        and isinstance(function.get("name"), str)
        and isinstance(function.get("description", ""), str | None)
        and isinstance(function.get("parameters", {}), dict | None)
        and all(_optional_bool(function.get(key)) for key in ("strict", "defer_loading"))
    )


def _check_tool_list(tools: Any) -> None:
    if tools == []:
        raise BadRequest(
            "`tools` must not be an empty array. Either provide at least one tool or omit the"
            " field entirely.",
            param="tools",
        )
    if not isinstance(tools, list) or not all(map(_function_tool, tools)):
        raise BadRequest(
            "'tools' must be an array of function tools, each with a string 'function.name' (and"
            " a string description, an object of parameters, boolean strict and defer_loading)",
            param="tools",
            code="invalid_type",
        )


def check_chat(body: dict[str, Any], limits: ServerSpec) -> int:
    """Check a chat's shape, vLLM's refusals and the size of everything its template may render
    (messages, tools, documents, template variables, all in `max_prompt_chars`) before anything
    is rendered; return its image parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    if len(messages) > limits.max_messages:
        raise BadRequest(
            f"{len(messages)} messages, over the {limits.max_messages} limit",
            param="messages",
            code="too_many_messages",
        )
    parts = sum(
        len(content)
        for message in messages
        if isinstance(message, dict) and isinstance(content := message.get("content"), list)
    )
    if parts > limits.max_content_parts:
        raise BadRequest(
            f"{parts} content parts, over the {limits.max_content_parts} limit",
            param="messages",
            code="too_many_parts",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest(
            "'chat_template_kwargs' must be an object",
            param="chat_template_kwargs",
            code="invalid_type",
        )
    if body.get("chat_template") is not None or (kwargs or {}).get("chat_template") is not None:
        raise BadRequest(_UNTRUSTED_TEMPLATE, param="chat_template")
    for name, default in _TEMPLATE_FLAGS:  # pydantic's refusal; the template reads them again
        lax_bool(body.get(name, default), name, default)
    if body.get("continue_final_message") and body.get("add_generation_prompt"):  # as sent
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise BadRequest(
            f"'reasoning_effort' must be one of {', '.join(sorted(REASONING_EFFORTS))}",
            param="reasoning_effort",
        )
    _check_tools(body.get("tools"), body.get("tool_choice"))
    documents = body.get("documents")
    if documents is not None and not isinstance(documents, list):
        raise BadRequest("'documents' must be an array", param="documents", code="invalid_type")
    chars = images = 0
    for index, message in enumerate(messages):
        message_chars, message_images = _message_chars(message, index)
        chars += message_chars
        images += message_images
    chars += text_chars(body.get("tools")) + text_chars(documents) + text_chars(kwargs)
    check_prompt_chars(chars, limits, "messages")
    return images


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_shape(prompt: Any) -> tuple[int, int]:
    """Number of prompts in a completions request and their characters (0 for token ids).

    Raise if `prompt` has no valid shape.
    """
    if isinstance(prompt, str):
        return 1, len(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return len(prompt), sum(map(len, prompt))
        if all(map(_is_token, prompt)):
            return 1, 0
        if all(isinstance(p, list) and p and all(map(_is_token, p)) for p in prompt):
            return len(prompt), 0
    raise BadRequest("'prompt' must be a string, an array of strings, or token ids", param="prompt")


def decode_body(content_type: str, raw: bytes, limits: ServerSpec) -> dict[str, Any]:
    """The body as a JSON object, within the policy's node and depth limits, or raise a 4xx."""
    if content_type != "application/json":
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {content_type or 'none'!r}"
        )
    outside = _check_nodes(raw, limits.max_json_nodes)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object", code="invalid_json")
    _check_depth(raw, outside, limits.max_json_depth)
    return body


def check_model(model: Any) -> str:
    """The request's `model`, a non-empty string short enough to echo, or raise 400."""
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    if len(model) > MAX_MODEL_CHARS:  # else a 7 MB name is echoed in the 404 and the access log
        raise BadRequest(
            f"'model' is over {MAX_MODEL_CHARS} characters", param="model", code="model_too_long"
        )
    return model


# A body's checks cost per message and part, not per byte: up to this size they take a few
# milliseconds at most (docs/benchmarks.md); a larger body is parsed on the tokenizer threads,
# where the GIL's switch interval lets the loop run.
INLINE_PARSE_BYTES = 32_768


async def parse_request(
    ctx: Ctx, content_type: str, raw: bytes, limits: ServerSpec, threads: CountingThreads | None
) -> None:
    """`parse`, on `threads` when the body is over `INLINE_PARSE_BYTES`."""
    if threads is not None and len(raw) > INLINE_PARSE_BYTES:
        await threads.run(parse, ctx, content_type, raw, limits)
    else:
        parse(ctx, content_type, raw, limits)


def parse(ctx: Ctx, content_type: str, raw: bytes, limits: ServerSpec) -> None:
    """Fill `ctx` from the request body, or raise a 4xx `GatewayError`."""
    body = decode_body(content_type, raw, limits)
    model = check_model(body.get("model"))
    if ctx.endpoint == "chat":
        ctx.images = check_chat(body, limits)
        prompts = 1
        max_output = _positive_int(body, "max_completion_tokens")
        if max_output is None:
            max_output = _positive_int(body, "max_tokens")
    else:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        prompts, chars = _prompt_shape(body["prompt"])
        check_prompt_chars(chars, limits, "prompt")
        max_output = _positive_int(body, "max_tokens")
    min_output = _lax_int(body, "min_tokens")
    if max_output is not None and min_output > max_output:  # vLLM's SamplingParams refuse it
        raise BadRequest(
            f"min_tokens must be less than or equal to max_tokens={max_output}, got {min_output}.",
            param="min_tokens",
        )
    n = _positive_int(body, "n") or 1
    if n > limits.max_n:
        raise BadRequest(
            f"'n' is {n}, over the {limits.max_n} limit", param="n", code="too_many_choices"
        )
    stream = lax_bool(body.get("stream"), "stream", False, nullable=True)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    if options and not body.get("stream"):  # vLLM's check runs on the value as sent
        raise BadRequest(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    include_usage = (options or {}).get("include_usage")
    wants_usage = lax_bool(include_usage, "stream_options.include_usage", False, nullable=True)
    priority = ctx.headers.get("x-priority")
    if priority is not None:
        if priority not in _PRIORITY_INDEX:
            raise BadRequest(
                f"x-priority must be one of {', '.join(PRIORITIES)}", param="x-priority"
            )
        ctx.priority = max(ctx.tier, _PRIORITY_INDEX[priority])  # lowered, never raised
    ctx.raw = raw
    ctx.body = body
    ctx.requested_model = model
    ctx.stream = stream
    ctx.client_wants_usage = wants_usage
    ctx.max_output = max_output
    ctx.min_output = min_output
    ctx.forced_output = lax_bool(body.get("ignore_eos"), "ignore_eos", False, nullable=True)
    ctx.sequences = n * prompts
