"""Paths a route names for its pool (`routes[].passthrough`), forwarded with their bodies unread.

vLLM serves more than the APIs the gateway counts, and a deployment may add its own paths
(audio uploads are counted endpoints: gateway/api/audio.py). A route that names such a path
sends every `POST` there to its pool: the tenant is authenticated and charged one request, the request takes
a slot like any other (held tokens: none, as nothing was counted), and the body goes to the
replica as it came, content type and all. The answer is relayed as it comes: a JSON answer whole
(within `max_response_bytes`), an event stream event by event. No usage is read: the replica's
answer to such a request carries no token counts the gateway could check. Paths no route names
stay a 404.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from gateway.api.openai import OpenAIApi

if TYPE_CHECKING:
    from gateway.config.schema import ServerSpec
    from gateway.context.ctx import Ctx
    from gateway.tokenizer.counters import TokenCounter


class PassthroughApi(OpenAIApi):
    """A passthrough path's request: nothing of it is read but its path and headers."""

    __slots__ = ()
    name = "passthrough"
    path = ""  # its route's paths, from the policy (`Policy.passthrough`)
    prompt_param = "body"
    reads_body: ClassVar[bool] = False

    def parse(self, ctx: Ctx, body: dict[str, Any], limits: ServerSpec) -> tuple[int, int | None]:
        """Never called: the body is not read. Nothing is known of it."""
        return 0, 0

    async def count(
        self, body: dict[str, Any], counter: TokenCounter, refuse_at: int, images: int
    ) -> tuple[int, int]:
        return 0, 0

    async def prompt_ids(
        self, body: dict[str, Any], counter: TokenCounter, special: bool | None = None
    ) -> list[int] | None:
        return None

    def fingerprint(self, body: dict[str, Any]) -> int:
        return 0

    def input_floor(self, ctx: Ctx, counter: TokenCounter) -> int:
        return 0

    def upstream_fields(self, ctx: Ctx, changes: dict[str, Any]) -> None:
        """Nothing: the body goes as it came."""

    def upstream_body(self, ctx: Ctx, changes: dict[str, Any]) -> bytes:
        """The body as it came, whatever it is: not even its `model` is known to change."""
        return ctx.raw

    def read_usage(self, ctx: Ctx, usage: Any) -> None:
        """Nothing: what such an answer calls usage (an audio's seconds) is no token count."""

    def usage_event(self, ctx: Ctx, event: dict[str, Any]) -> bool:
        return False


PASSTHROUGH = PassthroughApi()
