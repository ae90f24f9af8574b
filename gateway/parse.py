"""Stage 1, parse: decode the body once and check the fields admission depends on.

Only what the gateway itself needs is validated; every other field (`ignore_eos`, `stop`,
`logprobs`, `response_format`, ...) is left for the replica and passes through untouched. The
policy's size limits (`server.max_json_nodes`, `max_json_depth`, `max_messages`, `max_prompt_chars`) are checked here,
so no tokenizer ever sees an input larger than the operator allowed.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.context import Ctx
from gateway.errors import BadRequest, UnsupportedMediaType
from gateway.policy.schema import PRIORITIES, ServerSpec
from gateway.tokens import is_image

_PRIORITY_INDEX = {name: index for index, name in enumerate(PRIORITIES)}
DEFAULT_PRIORITY = _PRIORITY_INDEX["standard"]
# Longer than any served name or alias (Hugging Face ids are at most 96 characters).
MAX_MODEL_CHARS = 256


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


def _content_chars(content: Any, index: int) -> tuple[int, int]:
    """Characters and image parts of one message's content; its shape is checked on the way.

    Images are counted here, in the one walk over the parts, and charged at the model's
    `image_tokens` by tokenize: their bytes (URLs, base64) are no prompt characters."""
    if content is None:
        return 0, 0
    if isinstance(content, str):
        return len(content), 0
    if not isinstance(content, list):
        raise BadRequest(
            f"messages[{index}].content must be a string or an array of parts",
            param=f"messages[{index}].content",
        )
    chars = images = 0
    for part in content:
        if not isinstance(part, dict):
            raise BadRequest(
                f"messages[{index}].content parts must be objects",
                param=f"messages[{index}].content",
            )
        text = part.get("text")
        if is_image(part):  # first: vLLM goes by the type, whatever else the part carries
            images += 1
        elif isinstance(text, str):
            chars += len(text)
    return chars, images


def check_prompt_chars(chars: int, limits: ServerSpec, param: str) -> None:
    if chars > limits.max_prompt_chars:
        raise BadRequest(
            f"the prompt has {chars} characters, over the {limits.max_prompt_chars} limit",
            param=param,
            code="prompt_too_long",
        )


def check_messages(messages: Any, limits: ServerSpec) -> int:
    """Check the messages' shape and size; return their image parts."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    if len(messages) > limits.max_messages:
        raise BadRequest(
            f"{len(messages)} messages, over the {limits.max_messages} limit",
            param="messages",
            code="too_many_messages",
        )
    chars = images = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(
                f"messages[{index}] must be an object with a string 'role'",
                param=f"messages[{index}]",
            )
        content_chars, content_images = _content_chars(message.get("content"), index)
        chars += content_chars
        images += content_images
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


def check_flags(body: dict[str, Any]) -> None:
    """The chat template options the token counter keys its caches on must be booleans."""
    for name in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(body.get(name, False), bool):
            raise BadRequest(f"'{name}' must be a boolean", param=name, code="invalid_type")


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


def parse(ctx: Ctx, content_type: str, raw: bytes, limits: ServerSpec) -> None:
    """Fill `ctx` from the request body, or raise a 4xx `GatewayError`."""
    body = decode_body(content_type, raw, limits)
    model = check_model(body.get("model"))
    if ctx.endpoint == "chat":
        ctx.images = check_messages(body.get("messages"), limits)
        check_flags(body)
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
    n = _positive_int(body, "n") or 1
    stream = body.get("stream")
    if stream is None:  # `null` is false to vLLM (pydantic's default), so it is here too
        stream = False
    elif not isinstance(stream, bool):
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
        ctx.priority = max(ctx.tier, _PRIORITY_INDEX[priority])  # lowered, never raised
    ctx.raw = raw
    ctx.body = body
    ctx.requested_model = model
    ctx.stream = stream
    ctx.client_wants_usage = bool(options and options.get("include_usage"))
    ctx.max_output = max_output
    ctx.sequences = n * prompts
