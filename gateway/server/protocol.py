"""Requests aiohttp refuses before the application sees them, answered in the OpenAI error shape.

A head its parser refuses (bare-LF line endings, a NUL in a field, a line over the limit) never
reaches the application: aiohttp's `RequestHandler.handle_error` answers it with plain text that
quotes the offending bytes back (a key in `Authorization` included). `GatewayRunner` is an
`AppRunner` whose connections use `_Protocol`, which answers those in the OpenAI shape instead:
431 for a line over the limit or too many fields, 400 for the rest, naming the kind of error and
never its bytes. Logging stays with aiohttp (through `ServerLogFilter`, gateway/server/logs.py),
so it is the same whichever runner serves the app.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.errors import GatewayError, HeadersTooLarge, MalformedRequest

_TOO_MANY = "Too many headers"  # the start of both parsers' message for too many fields


def refusal(status: int, exc: BaseException | None) -> GatewayError:
    """The gateway's answer to what aiohttp would answer with `status` for `exc`."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "the"
        return HeadersTooLarge(f"a line of the request head is over the {limit}-byte limit")
    if isinstance(exc, BadHttpMessage):
        if exc.message.startswith(_TOO_MANY):
            return HeadersTooLarge("the request has too many header fields")
        return MalformedRequest(f"the request head is not valid HTTP/1.1 ({type(exc).__name__})")
    error = GatewayError("internal gateway error; see the gateway log")
    error.status = status
    return error


class _Protocol(RequestHandler):
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's version logs (through the filter) and refuses once a byte was sent; only its
        # plain-text body is replaced.
        super().handle_error(request, status, exc, message)
        resp = refusal(status, exc).response()
        resp.force_close()
        return resp


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Protocol(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer parser refusals in the OpenAI error shape."""

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        kwargs: dict[str, Any] = plain._kwargs
        return _Server(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            **kwargs,
        )
