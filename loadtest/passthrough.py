"""The baseline the gateway is measured against: a bare aiohttp + uvloop pass-through proxy.

It does the least a Python proxy on this stack can do — one `ClientSession`, the request body
forwarded as bytes, the answer streamed back chunk by chunk as it arrives (`iter_any`), nothing
parsed — so the gap between it and the gateway is what the gateway's own features cost.

    python -m loadtest.passthrough --port 8001 --upstream http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

UPSTREAM = web.AppKey("upstream", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def relay(request: web.Request) -> web.StreamResponse:
    """Forward one POST and copy the answer through without looking at it."""
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    url = request.app[UPSTREAM] + request.path_qs
    async with request.app[SESSION].post(url, data=body, headers=headers) as up:
        resp = web.StreamResponse(status=up.status)
        resp.content_type = up.content_type
        if up.content_length is not None:  # keep small answers unchunked, as the gateway does
            resp.content_length = up.content_length
        await resp.prepare(request)
        async for data in up.content.iter_any():
            await resp.write(data)
        await resp.write_eof()
        return resp


def create_app(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")

    async def session(app: web.Application) -> AsyncIterator[None]:
        # The same client settings as the gateway's, so neither side gets a cheaper client.
        connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=60)
        app[SESSION] = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/{path:.*}", relay)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:9000")
    args = parser.parse_args()
    import uvloop

    app = create_app(args.upstream)
    uvloop.run(web._run_app(app, host=args.host, port=args.port, print=None, access_log=None,
                            handler_cancellation=True))  # fmt: skip


if __name__ == "__main__":
    main()
