"""The parse stage: decode the body once and check the fields admission depends on.

Only what the gateway itself needs is validated; every other field (`ignore_eos`, `stop`,
`logprobs`, `response_format`, ...) is left for the replica and passes through untouched. The
policy's size limits are checked here (the body's own, by its decoder; `max_messages`,
`max_prompt_chars` on the prompt), so no tokenizer ever sees an input larger than the operator
allowed.

This module holds what every endpoint shares (`model`, `n`, `stream`, `stream_options`,
`x-priority`, `min_tokens`, `ignore_eos`) and the size helpers; how the body is decoded (JSON,
a multipart upload), what carries the prompt and what bounds the output are the endpoint's own
(`ctx.api.decode`, `ctx.api.parse`, gateway/api/), so a new endpoint adds a module there rather
than a branch here.

A field the gateway reads is read as vLLM reads it (booleans as pydantic's lax mode does, so
`"false"` is false), and what vLLM refuses before rendering (`stream_options` without `stream`,
and each endpoint's own) is refused in its words, before any tokenizer time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from gateway.api.fields import check_model, lax_int, positive_int
from gateway.config.schema import PRIORITIES, ServerSpec
from gateway.context.ctx import Ctx
from gateway.errors import BadRequest
from gateway.tokenizer.chat_template import lax_bool
from gateway.tokenizer.threads import CountingThreads

T = TypeVar("T")

_PRIORITY_INDEX = {name: index for index, name in enumerate(PRIORITIES)}
DEFAULT_PRIORITY = _PRIORITY_INDEX["standard"]
# Longer than any served name or alias (Hugging Face ids are at most 96 characters).
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


def parse(ctx: Ctx, content_type: str, raw: bytes, limits: ServerSpec) -> None:
    """Fill `ctx` from the request body (`content_type`: its `Content-Type` header), or raise a
    4xx `GatewayError`."""
    body = ctx.api.decode(raw, content_type, limits)
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
