"""A round-robin proxy over replicas: what a Kubernetes Service gives you, for `compare`.

Each request goes to the next replica in turn, whatever it is and however busy the replica is —
no token counting, no caps, no queue. (A Service balances TCP connections rather than requests;
per-request rotation is its best case.) Bodies and answers stream through unchanged, and a
client that leaves closes the upstream request, so the replica stops generating.

    python -m loadtest.loadgen.cli roundrobin [--host 127.0.0.1] [--port 0] URL [URL ...]

prints `listening on http://HOST:PORT` once it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from collections.abc import AsyncIterator, Iterator, Sequence

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
NEXT = web.AppKey[Iterator[str]]("next")
HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


async def forward(request: web.Request) -> web.StreamResponse:
    rotation: Iterator[str] = request.app[NEXT]
    replica = next(rotation)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    body = await request.read()
    try:
        up = await request.app[SESSION].request(
            request.method, replica + request.path_qs, data=body, headers=headers
        )
    except aiohttp.ClientConnectionError as exc:  # what a client of a Service sees as a reset
        error = {
            "error": {
                "message": f"replica {replica}: {exc}",
                "type": "BadGateway",
                "param": None,
                "code": 502,
            }
        }
        return web.json_response(error, status=502)
    async with up:
        resp = web.StreamResponse(status=up.status)
        for key, value in up.headers.items():
            if key.lower() not in HOP_BY_HOP:
                resp.headers[key] = value
        await resp.prepare(request)
        try:
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
        except (asyncio.CancelledError, ConnectionResetError):
            up.close()
            raise
        await resp.write_eof()
        return resp


def create_roundrobin_app(replicas: Sequence[str]) -> web.Application:
    if not replicas:
        raise ValueError("round robin needs at least one replica")
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[NEXT] = itertools.cycle([r.rstrip("/") for r in replicas])

    async def session(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        # No connection limit: a Service does not cap what it forwards.
        async with aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        ) as s:
            app[SESSION] = s
            yield

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


@contextlib.asynccontextmanager
async def roundrobin_process(replicas: Sequence[str]) -> AsyncIterator[str]:
    """Run the proxy in its own process (as a real Service would be), yield its URL, stop it.

    Its own process keeps its CPU off the load generator's event loop, as the gateway's is.
    """
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loadtest.loadgen.cli",
        "roundrobin",
        "--port",
        "0",
        *replicas,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()
        if not line.startswith("listening on "):
            raise RuntimeError(f"the round-robin proxy did not start (exit {proc.returncode})")
        yield line.removeprefix("listening on ").strip()
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


async def serve(replicas: Sequence[str], host: str, port: int) -> None:
    runner = web.AppRunner(
        create_roundrobin_app(replicas), handler_cancellation=True, access_log=None
    )
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound = runner.addresses[0][1]
    print(f"listening on http://{host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()  # until the process is stopped
    finally:
        await runner.cleanup()
