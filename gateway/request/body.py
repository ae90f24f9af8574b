"""Reading a request's body: the policy's size limit as a 413, and its declared media type.

Shared by the pipeline and the endpoints that answer on their own (`/tokenize`, `/detokenize`),
so every body the gateway reads is bounded the same way.
"""

from __future__ import annotations

from aiohttp import web

from gateway.errors import BodyTooLarge


async def read(request: web.Request, limit: int) -> bytes:
    """The whole body; aiohttp stops reading at `client_max_size` (the policy's `limit`)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(f"request body is over the {limit}-byte limit") from None


def media_type(request: web.Request) -> str:
    """The body's declared media type. aiohttp's `content_type` runs the stdlib e-mail parser,
    which raises IndexError on some malformed values (`;0*`): such a body is simply not JSON.

    The value nearly every client sends, bare `application/json`, is its own media type: it is
    answered without the property's cache check and parameter parsing, paid on every request."""
    if request.headers.get("Content-Type") == "application/json":
        return "application/json"
    try:
        return request.content_type
    except (IndexError, ValueError):
        return request.headers.get("Content-Type", "")
