"""Stage 1, parse: decode the body once and check the fields admission depends on.

Only what the gateway itself needs is validated; every other field (`ignore_eos`, `stop`,
`logprobs`, `response_format`, ...) is left for the replica and passes through untouched.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.context import Ctx
from gateway.errors import BadRequest, UnsupportedMediaType
from gateway.policy.schema import PRIORITIES

_PRIORITY_INDEX = {name: index for index, name in enumerate(PRIORITIES)}
DEFAULT_PRIORITY = _PRIORITY_INDEX["standard"]


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer", param=name, code="invalid_type")
    if value < 1:
        raise BadRequest(f"'{name}' must be >= 1, got {value}", param=name, code="invalid_value")
    return value


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(
                f"messages[{index}] must be an object with a string 'role'",
                param=f"messages[{index}]",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                f"messages[{index}].content must be a string or an array of parts",
                param=f"messages[{index}].content",
            )


def _prompt_count(prompt: Any) -> int:
    """Number of prompts in a completions request; raise if `prompt` has no valid shape."""
    if isinstance(prompt, str):
        return 1
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return len(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return 1
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return len(prompt)
    raise BadRequest("'prompt' must be a string, an array of strings, or token ids", param="prompt")


def parse(ctx: Ctx, content_type: str, raw: bytes) -> None:
    """Fill `ctx` from the request body, or raise a 4xx `GatewayError`."""
    if content_type != "application/json":
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {content_type or 'none'!r}"
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    if ctx.endpoint == "chat":
        _check_messages(body.get("messages"))
        prompts = 1
        max_output = _positive_int(body, "max_completion_tokens")
        if max_output is None:
            max_output = _positive_int(body, "max_tokens")
    else:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        prompts = _prompt_count(body["prompt"])
        max_output = _positive_int(body, "max_tokens")
    n = _positive_int(body, "n") or 1
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    priority = ctx.headers.get("x-priority")
    if priority is not None:
        if priority not in _PRIORITY_INDEX:
            raise BadRequest(
                f"x-priority must be one of {', '.join(PRIORITIES)}", param="x-priority"
            )
        ctx.priority = _PRIORITY_INDEX[priority]
    ctx.raw = raw
    ctx.body = body
    ctx.requested_model = model
    ctx.stream = stream
    ctx.client_wants_usage = bool(options and options.get("include_usage"))
    ctx.max_output = max_output
    ctx.sequences = n * prompts
