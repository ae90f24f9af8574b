"""The parse stage: decode the body once and check the fields admission depends on.

Only what the gateway itself needs is validated; every other field (`ignore_eos`, `stop`,
`logprobs`, `response_format`, ...) is left for the replica and passes through untouched. The
policy's size limits are checked here (`server.max_json_nodes`, `max_json_depth` on the body;
`max_messages`, `max_prompt_chars` on the prompt), so no tokenizer ever sees an input larger than
the operator allowed.

This module holds what every endpoint shares (the body, `model`, `n`, `stream`,
`stream_options`, `x-priority`, `min_tokens`, `ignore_eos`) and the size helpers; what carries
the prompt and bounds the output is the endpoint's own (`ctx.api.parse`, gateway/api/), so a new
endpoint adds a module there rather than a branch here.

A field the gateway reads is read as vLLM reads it (booleans as pydantic's lax mode does, so
`"false"` is false), and what vLLM refuses before rendering (`stream_options` without `stream`,
and each endpoint's own) is refused in its words, before any tokenizer time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from gateway.config.schema import PRIORITIES, ServerSpec
from gateway.context.ctx import Ctx
from gateway.errors import BadRequest, UnsupportedMediaType
from gateway.tokenizer.chat_template import lax_bool
from gateway.tokenizer.threads import CountingThreads

T = TypeVar("T")

_PRIORITY_INDEX = {name: index for index, name in enumerate(PRIORITIES)}
DEFAULT_PRIORITY = _PRIORITY_INDEX["standard"]
# Longer than any served name or alias (Hugging Face ids are at most 96 characters).
MAX_MODEL_CHARS = 256


def lax_int(body: dict[str, Any], name: str) -> int:
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


def positive_int(body: dict[str, Any], name: str) -> int | None:
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


def check_prompt_chars(chars: int, limits: ServerSpec, param: str) -> None:
    if chars > limits.max_prompt_chars:
        raise BadRequest(
            f"the prompt has {chars} characters, over the {limits.max_prompt_chars} limit",
            param=param,
            code="prompt_too_long",
        )


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


async def by_size(
    raw: bytes, threads: CountingThreads | None, work: Callable[..., T], *args: Any
) -> T:
    """`work(*args)`, the parse of the body `raw`: on `threads` when it is over
    `INLINE_PARSE_BYTES`."""
    if threads is not None and len(raw) > INLINE_PARSE_BYTES:
        return await threads.run(work, *args)
    return work(*args)


async def parse_request(
    ctx: Ctx, content_type: str, raw: bytes, limits: ServerSpec, threads: CountingThreads | None
) -> None:
    """`parse`, on `threads` when the body is over `INLINE_PARSE_BYTES`."""
    await by_size(raw, threads, parse, ctx, content_type, raw, limits)


def decode_checked(
    content_type: str,
    raw: bytes,
    limits: ServerSpec,
    check: Callable[[dict[str, Any], ServerSpec], dict[str, Any]],
) -> dict[str, Any]:
    """The body decoded (`decode_body`) and checked by `check`, an endpoint's own checks."""
    return check(decode_body(content_type, raw, limits), limits)


def parse(ctx: Ctx, content_type: str, raw: bytes, limits: ServerSpec) -> None:
    """Fill `ctx` from the request body, or raise a 4xx `GatewayError`."""
    body = decode_body(content_type, raw, limits)
    model = check_model(body.get("model"))
    prompts, max_output = ctx.api.parse(ctx, body, limits)
    if ctx.api.openai_fields:
        _parse_openai_fields(ctx, body, limits, prompts, max_output)
    stream = lax_bool(body.get("stream"), "stream", False, nullable=True)
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
    ctx.max_output = max_output


def _parse_openai_fields(
    ctx: Ctx, body: dict[str, Any], limits: ServerSpec, prompts: int, max_output: int | None
) -> None:
    """`n`, `min_tokens`, `ignore_eos` and `stream_options`, as vLLM's OpenAI APIs read them."""
    min_output = lax_int(body, "min_tokens")
    if max_output is not None and min_output > max_output:  # vLLM's SamplingParams refuse it
        raise BadRequest(
            f"min_tokens must be less than or equal to max_tokens={max_output}, got {min_output}.",
            param="min_tokens",
        )
    n = positive_int(body, "n") or 1
    if n > limits.max_n:
        raise BadRequest(
            f"'n' is {n}, over the {limits.max_n} limit", param="n", code="too_many_choices"
        )
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    if options and not body.get("stream"):  # vLLM's check runs on the value as sent
        raise BadRequest(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    include_usage = (options or {}).get("include_usage")
    wants_usage = lax_bool(include_usage, "stream_options.include_usage", False, nullable=True)
    continuous = lax_bool(
        (options or {}).get("continuous_usage_stats"),
        "stream_options.continuous_usage_stats",
        False,
        nullable=True,
    )
    ctx.client_wants_usage = wants_usage
    # vLLM sends per-chunk usage only with `include_usage` too (`should_include_usage`).
    ctx.client_wants_continuous = wants_usage and continuous
    ctx.min_output = min_output
    ctx.forced_output = lax_bool(body.get("ignore_eos"), "ignore_eos", False, nullable=True)
    ctx.sequences = n * prompts
