"""`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`, sent to the replica that
stores the response (gateway/request/holders.py).

They read or change what one replica holds and generate nothing: no slot is taken and nothing
is charged, but the caller is authenticated and must be the tenant whose request made the
response; to anyone else it does not exist. The replica's answer (JSON, vLLM's error included)
is relayed as it came, within the gateway's response-size limit and its pool's time-outs.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from gateway.api import RESPONSES
from gateway.context.ctx import Ctx
from gateway.errors import ResponseTooLarge, UpstreamError, UpstreamTimeout
from gateway.request.authenticate import authenticate
from gateway.runtime import Gateway

_PARAM = "response_id"
_RELAYED = ("Content-Type",)
_CHUNK = 65536


async def relay(gateway: Gateway, request: web.Request) -> web.Response:
    """Send the request as it came to the replica holding `{response_id}`; relay its answer."""
    ctx = Ctx("", RESPONSES, request.path, request.headers, time.perf_counter())
    runtime = gateway.runtime
    authenticate(ctx, runtime.policy.tenants)
    response_id = request.match_info[_PARAM]
    holder = await gateway.holders.find(response_id, ctx, _PARAM)
    await gateway.holders.placed(response_id, holder, runtime.slots, _PARAM)
    key = runtime.api_keys[holder.pool]
    timeouts = runtime.policy.pools[holder.pool].spec.timeouts
    limit = runtime.max_response_bytes
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = holder.replica + request.path_qs
    try:
        async with (
            asyncio.timeout(timeouts.total_s),
            gateway.sessions[holder.pool].request(request.method, url, headers=headers) as up,
        ):
            body = bytearray()  # `read(n)` returns what has arrived, up to n: read to the end
            while chunk := await up.content.read(_CHUNK):
                body += chunk
                if len(body) > limit:
                    raise ResponseTooLarge(
                        f"the replica's answer is over the gateway's {limit}-byte limit"
                    )
            kept = {name: up.headers[name] for name in _RELAYED if name in up.headers}
            return web.Response(status=up.status, body=bytes(body), headers=kept)
    except TimeoutError:
        raise UpstreamTimeout("the replica did not answer in time") from None
    except aiohttp.ClientError:
        raise UpstreamError("the replica failed before answering") from None
