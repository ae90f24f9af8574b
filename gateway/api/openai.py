"""What chat completions and completions share: OpenAI's usage, stream framing and error shape.

Both answer with a top-level `usage` (`prompt_tokens`, `completion_tokens`), stream it only when
asked (`stream_options.include_usage`, in a last chunk with no choices; with
`continuous_usage_stats` too, the running count on every chunk besides) and refuse with
`{"error": {...}}` (gateway/errors.py). Their bodies are JSON (gateway/api/json_body.py) but an
upload's (gateway/api/audio.py). An API of another shape (Anthropic's messages, OpenAI's
responses) subclasses `JsonApi` instead and says its own.

A stream's running count is what a client that leaves is settled on (`delivered`): the count of
the last chunk relayed is the output it got, to the chunk in flight, where the chunks relayed
undercount it as many times as a chunk has tokens (speculative decoding, `--stream-interval`).
A replica's count is input: it is believed only while every count is a token count, none is
less than the one before or than the chunks relayed with it (less `_SILENT`), none is over the
request's bound and the last chunk relayed carried one (`account`); otherwise the request is
settled as one that got no count, on its reservation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, TypeGuard

from gateway.api.json_body import JsonApi

if TYPE_CHECKING:
    from collections.abc import Mapping

    from aiohttp import web

    from gateway.context.ctx import Ctx
    from gateway.errors import GatewayError
    from gateway.state.base import Window


def is_tokens(value: Any) -> TypeGuard[int]:
    """A usage count as a replica may report it: not a bool, a float, a string or negative."""
    return type(value) is int and value >= 0


def _read_cached(ctx: Ctx, details: Any) -> None:
    """`cached_tokens` of a usage's prompt details (OpenAI's `prompt_tokens_details`, the
    Responses API's `input_tokens_details`), when it is a count."""
    if isinstance(details, dict) and is_tokens(cached := details.get("cached_tokens")):
        ctx.cached_tokens = cached


# The chunks vLLM sends with no token in them: a chat's first (its role) and an echo's.
_SILENT = 2


def delivered(ctx: Ctx, usage: Any, output_field: str) -> None:
    """Note a chunk's running output count, as the relay is about to write the chunk
    (`ctx.chunks` is the chunks before it); a count not to believe ends the counting."""
    if ctx.untrusted_usage:
        return
    count = usage.get(output_field) if isinstance(usage, dict) else None
    bound = ctx.max_output
    if (
        not is_tokens(count)
        or count < (ctx.delivered or 0)
        or count + _SILENT <= ctx.chunks
        or (bound is not None and count > bound)
    ):
        ctx.delivered, ctx.untrusted_usage = None, "completion_tokens"
        return
    ctx.delivered, ctx.delivered_at = count, ctx.chunks + 1


class OpenAIApi(JsonApi):
    """The usage, upstream fields and refusals of OpenAI's completion APIs, as vLLM serves them."""

    __slots__ = ()
    stream_end = b"data: [DONE]\n\n"

    def upstream_fields(self, ctx: Ctx, changes: dict[str, Any]) -> None:
        """A stream's usage is asked for on the client's behalf, and its running count on every
        chunk where it is the request's (`asks_continuous`); `forward` drops the chunk and
        strips the counts the client did not ask for."""
        if not ctx.stream:
            return
        continuous = self.asks_continuous(ctx)
        if ctx.client_wants_usage and (ctx.client_wants_continuous or not continuous):
            return
        asked = {"include_usage": True}
        if continuous:
            asked["continuous_usage_stats"] = True
        changes["stream_options"] = {**(ctx.body.get("stream_options") or {}), **asked}

    # The usage's fields: the output's count, the prompt's, the prompt's details.
    usage_fields: ClassVar[tuple[str, str, str]] = (
        "completion_tokens", "prompt_tokens", "prompt_tokens_details"
    )  # fmt: skip

    def read_usage(self, ctx: Ctx, usage: Any) -> None:
        """The replica's counts, when they are counts; a field that is not is noted (a replica's
        answer is input too: `account` settles on the gateway's own numbers then)."""
        if not isinstance(usage, dict):
            return
        output_field, prompt_field, details = self.usage_fields
        completion, prompt = usage.get(output_field), usage.get(prompt_field)
        if not is_tokens(completion):
            if completion is not None:
                ctx.untrusted_usage = "completion_tokens"
            return
        ctx.output_tokens = completion
        if is_tokens(prompt):
            ctx.prompt_tokens = prompt
            _read_cached(ctx, usage.get(details))
        elif prompt is not None:
            ctx.untrusted_usage = "prompt_tokens"

    def usage_event(self, ctx: Ctx, event: dict[str, Any]) -> bool:
        """The final usage chunk has no choices; continuous usage stats ride on ordinary ones,
        each its choice's count: the request's only when it has one sequence."""
        if event.get("choices") == []:
            self.read_usage(ctx, event.get("usage"))
            return True
        if ctx.sequences == 1:
            delivered(ctx, event.get("usage"), self.usage_fields[0])
        return False

    def deltas(self, events: bytes) -> int:
        """Every data event but `[DONE]`."""
        return events.count(b"data: ") - events.count(b"data: [DONE]")

    def ratelimit_headers(self, windows: Mapping[str, Window], out: dict[str, str]) -> None:
        """OpenAI's `x-ratelimit-*` are every answer's already."""

    def error_response(
        self, error: GatewayError, headers: dict[str, str] | None = None
    ) -> web.Response:
        return error.response(headers)

    def stream_error(self, error: GatewayError) -> bytes:
        return b"data: " + error.body() + b"\n\ndata: [DONE]\n\n"
