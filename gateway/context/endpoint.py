"""What the pipeline asks of an API shape: one `Api` per endpoint the gateway admits.

The stages are the same for every endpoint (parse, count, estimate, charge, admit, forward,
account); what differs is where a body carries its prompt and its output bound, how its prompt
is counted, what the estimator keys it by, what the answer's usage looks like and how a refusal
is written. Those differences live in one object per endpoint, reached through `ctx.api`, so a
new endpoint is a new small module rather than new branches through every stage.

An `Api` is a module-level singleton without state: the route handler sets it on the `Ctx` once,
and every stage after that costs one attribute lookup, never an allocation or a string compare.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from collections.abc import Mapping

    from aiohttp import web

    from gateway.config.schema import ServerSpec
    from gateway.context.ctx import Ctx
    from gateway.errors import GatewayError
    from gateway.state.base import Window
    from gateway.tokenizer.counters import TokenCounter

# How much of a prompt's start keys the output estimator (gateway/request/estimate.py): a system prompt
# or a rules block, what makes a classification prompt recognisable from one request to the next.
FINGERPRINT_CHARS = 256
FINGERPRINT_IDS = 64  # the same for a prompt given as token ids
# What the APIs' example requests (`Api.example`) say: one text, and two documents to score.
SAMPLE_TEXT = "Lithium battery packs must show a valid safety certificate and its number."
SAMPLE_DOCS = ["Ships in two days with a one year warranty.", "Replica brand items are prohibited."]


class Api(ABC):
    """One API shape: the endpoint-specific part of every stage.

    `name` is the endpoint as policies, metrics labels and the access log name it (a route's
    `match.endpoint`: gateway/config/schema.py `Endpoint`); `path` is where it is served (and
    `aliases`, other paths vLLM serves it at: each is forwarded as the client called it);
    `prompt_param` is the field a refusal about the prompt names. `exact`: with a tokenizer,
    `count` is vLLM's own count, so a replica's `prompt_tokens` far from it is not believed;
    an endpoint whose count is only an upper bound (vLLM's depends on the model's kind) says
    False, and the replica's usage settles it.
    """

    __slots__ = ()
    name: ClassVar[str]
    path: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    prompt_param: ClassVar[str]
    # Whether the body's OpenAI sampling fields (`n`, `min_tokens`, `ignore_eos`,
    # `stream_options`) are read: an API whose replica ignores them leaves them unread.
    openai_fields: ClassVar[bool] = True
    # The bytes a whole stream ends with: once written, the client has its whole answer.
    stream_end: ClassVar[bytes]
    exact: ClassVar[bool] = True
    # The body field that bounds the output, where the gateway writes its own bound for a
    # request that states none (gateway/request/quota.py `bound_output`); None: nothing is generated.
    bound_field: ClassVar[str | None] = None
    # The media type a client sends the body in (`example`'s, and what explain assumes).
    content_type: ClassVar[str]
    # Whether the pipeline reads the body (parse, count, classify); an API that does not
    # (gateway/api/passthrough.py) is routed by its path and forwarded as it came.
    reads_body: ClassVar[bool] = True
    # Whether the replica streams a cumulative usage on every chunk when asked (vLLM's chat and
    # completions: `stream_options.continuous_usage_stats`): what a stream the client left is
    # settled on (gateway/api/openai.py `delivered`).
    continuous_usage: ClassVar[bool] = False

    @abstractmethod
    def decode(self, raw: bytes, content_type: str, limits: ServerSpec) -> dict[str, Any]:
        """The body's fields, `content_type` its `Content-Type` header, within the body limits
        of `limits`, or raise a 4xx `GatewayError` (415 for a media type it does not take)."""

    @abstractmethod
    def upstream_body(self, ctx: Ctx, changes: dict[str, Any]) -> bytes:
        """The body the replica is sent: the client's, with `changes` (fields the gateway sets:
        `model`, `priority`, the API's own `upstream_fields`, the output bound), in the client's
        encoding, so its `Content-Type` goes upstream as it came. The client's bytes
        themselves when nothing changes: the common case pays no copy."""

    @abstractmethod
    def example(self, model: str) -> tuple[bytes, str]:
        """A small valid request for `model` and its `Content-Type`: what the endpoint
        benchmark and the tests send to every endpoint the gateway admits."""

    @abstractmethod
    def parse(self, ctx: Ctx, body: dict[str, Any], limits: ServerSpec) -> tuple[int, int | None]:
        """Check the fields that carry the prompt and bound the output, within `limits`, or
        raise a 4xx `GatewayError`; return the number of prompts and the client's output bound
        (None when it gave none). May set `ctx.images`."""

    @abstractmethod
    async def count(
        self, body: dict[str, Any], counter: TokenCounter, refuse_at: int, images: int
    ) -> tuple[int, int]:
        """The prompt's input tokens and its longest prompt's, `images` (already costed)
        included; `TooManyTokens` (its text's tokens, without the images) for a prompt that
        provably has `refuse_at` or more."""

    @abstractmethod
    async def prompt_ids(
        self, body: dict[str, Any], counter: TokenCounter, special: bool | None = None
    ) -> list[int] | None:
        """The token ids vLLM will see for the request's (first) prompt, `special` (add special
        tokens) overriding the endpoint's default; None when they cannot be known here."""

    @abstractmethod
    def fingerprint(self, body: dict[str, Any]) -> int:
        """A hash of the prompt's start: what "similar requests" share for the estimator."""

    @abstractmethod
    def input_floor(self, ctx: Ctx, counter: TokenCounter) -> int:
        """Input tokens the request provably has before it is counted (the quota's early
        charge)."""

    @abstractmethod
    def upstream_fields(self, ctx: Ctx, changes: dict[str, Any]) -> None:
        """Add to `changes` the fields the replica must be sent other than the client's for the
        gateway to read the answer's usage (`model` and `priority` are the forward stage's)."""

    @abstractmethod
    def read_usage(self, ctx: Ctx, usage: Any) -> None:
        """Fill `ctx.output_tokens` (and `prompt_tokens`) from an answer's decoded `usage`, when
        they are counts."""

    @abstractmethod
    def usage_event(self, ctx: Ctx, event: dict[str, Any]) -> bool:
        """Read the usage a decoded stream event carries; whether the event only carries it (the
        gateway's to drop when the client did not ask for it)."""

    def asks_continuous(self, ctx: Ctx) -> bool:
        """Whether the replica is asked for a usage on every chunk: for a stream whose tokens a
        tenant's window settles (nothing else needs the count of a stream cut short, and
        reading and stripping it costs every event a few µs), of one sequence only, since vLLM
        counts each choice alone and a chunk carries one choice's count."""
        return self.continuous_usage and ctx.stream and ctx.sequences == 1 and ctx.tokens_charged

    async def count_answer(self, ctx: Ctx, answer: bytearray) -> None:
        """Count a whole 200 answer's output where its usage carries no count, setting
        `ctx.output_tokens` and `ctx.output_counted`: read already, before the client gets it.
        Nothing here: an answer's usage counts it, or the reservation settles it."""
        return None

    def ended(self, out: bytes) -> bool:
        """Whether a run of whole events just written ends the stream: the client has it all."""
        return out.endswith(self.stream_end)

    @abstractmethod
    def deltas(self, events: bytes) -> int:
        """The generated chunks in a run of whole stream events that carry no usage (what a
        broken stream's output is counted by)."""

    @abstractmethod
    def ratelimit_headers(self, windows: Mapping[str, Window], out: dict[str, str]) -> None:
        """Add this API's own rate-limit headers to `out` for the binding window of each kind
        (`requests`, `tokens`), beside OpenAI's `x-ratelimit-*` every answer carries."""

    @abstractmethod
    def error_response(
        self, error: GatewayError, headers: dict[str, str] | None = None
    ) -> web.Response:
        """A refusal as this API's clients expect it."""

    @abstractmethod
    def stream_error(self, error: GatewayError) -> bytes:
        """The events that end a stream the replica broke after its first byte."""
