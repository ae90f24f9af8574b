"""Connection limits: header count and size, the slow-client deadlines, and the parser's bounds.

aiohttp parses a request's head before any gateway code runs, so the policy reaches its parser
through the application's `handler_args`. The parser's bounds sit a little above the policy's
limits: it is the backstop that keeps a hostile client from making the gateway buffer unbounded
headers (it refuses and closes; gateway/server/protocol.py answers that in the OpenAI shape),
while `RequestLimits` applies the exact limits.

Slow clients. aiohttp's keep-alive timer runs from when a connection opens, or answers its last
request, until a complete request head has arrived, and partial data does not reset it: as
`keepalive_timeout` it is also the deadline for headers sent byte by byte. aiohttp has no deadline
for a body, so `RequestLimits` sets one on the request's payload.
"""

from __future__ import annotations

import asyncio
from itertools import chain
from typing import Any

from aiohttp import StreamReader, web

from gateway.config.schema import ServerSpec
from gateway.errors import HeadersTooLarge, RequestTimeout


def handler_args(server: ServerSpec) -> dict[str, Any]:
    """aiohttp `RequestHandler` arguments (`web.Application(handler_args=...)`) for the policy."""
    return {
        "keepalive_timeout": server.idle_timeout_s,
        # No single line can be longer than all headers together are allowed to be.
        "max_line_size": server.max_header_bytes,
        "max_field_size": server.max_header_bytes,
        # Twice the limit: between the two, `RequestLimits` refuses with a proper 431.
        "max_headers": 2 * server.max_headers,
    }


def _check_headers(raw_headers: tuple[tuple[bytes, bytes], ...], server: ServerSpec) -> None:
    if len(raw_headers) > server.max_headers:
        raise HeadersTooLarge(
            f"{len(raw_headers)} header fields, over the {server.max_headers} limit"
        )
    size = sum(map(len, chain.from_iterable(raw_headers)))  # names and values, in C
    if size > server.max_header_bytes:
        raise HeadersTooLarge(
            f"{size} bytes of header fields, over the {server.max_header_bytes}-byte limit"
        )


def _expire(payload: StreamReader, timeout_s: float) -> None:
    if not payload.is_eof():
        # Raised from the handler's pending `request.read()`: the pipeline answers it as a 408.
        payload.set_exception(
            RequestTimeout(f"the request body did not arrive within {timeout_s}s")
        )


class RequestLimits:
    """The policy's header limits (431, checked when made) and `body_timeout_s` (408, a timer on
    the body) for one request: made before the handler runs and cancelled after it, by the one
    wrapper every route runs in (gateway/server/app.py)."""

    __slots__ = ("_payload", "_timer")

    def __init__(self, request: web.Request, server: ServerSpec) -> None:
        _check_headers(request.raw_headers, server)  # raises HeadersTooLarge
        self._payload = payload = request.content
        self._timer = (
            None  # no body, or it all came with the headers: nothing to wait for
            if payload.is_eof()
            else asyncio.get_running_loop().call_later(
                server.body_timeout_s, _expire, payload, server.body_timeout_s
            )
        )

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    @property
    def expired(self) -> bool:
        """Whether the body timed out: its rest is never read, so the connection must close."""
        return self._timer is not None and isinstance(self._payload.exception(), RequestTimeout)
