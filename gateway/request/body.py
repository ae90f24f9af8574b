"""Reading a request's body: the policy's size limit as a 413.

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
