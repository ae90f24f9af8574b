"""The request path: authenticate -> parse -> holder -> candidates -> estimate -> early quota ->
count -> workload -> route -> place -> quota -> admit -> forward -> account.

Each stage is a small function in its own module that fills in its part of the `Ctx` or raises a
`GatewayError`; this module only calls them in order, retries what a replica refused before it
took the request, and owns the `finally` that accounts for every request, however it ended.
`decide` is the part up to admission, shared with `llm-gateway explain`. The process around it
(policy, reloads, background tasks) is gateway/runtime.py. The stages are the same for every
endpoint: what differs is the request's `Api` (gateway/api/), which this module only hands on,
in the `Ctx`, and asks to write the refusal in its clients' shape.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from aiohttp import web

from gateway.admit import Place
from gateway.api import Api
from gateway.context.ctx import Ctx
from gateway.errors import (
    Ejection,
    GatewayError,
    ReplicaRefused,
    ShuttingDown,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.policy.compile import Policy
from gateway.request import body
from gateway.request.authenticate import authenticate
from gateway.request.count import check_images, count_input
from gateway.request.estimate import estimate_output, force_length
from gateway.request.forward import check_forwardable, client_left, forward
from gateway.request.objective import set_objective
from gateway.request.parse import parse_request
from gateway.request.place import Heard, PoolLoad, place
from gateway.request.quota import Charge, bound_output
from gateway.request.route import find_candidates, route, route_unread
from gateway.request.workload import classify

if TYPE_CHECKING:
    from gateway.runtime import Gateway, Runtime

log = logging.getLogger("gateway.pipeline")


def before_count(ctx: Ctx, policy: Policy) -> None:
    """What is known of a request before its prompt is counted: its candidate routes (hence its
    model), its images' validity, its output bound (the gateway's, for a TPM-limited tenant's
    request that gives none) and its expected output (the estimator reads the body and the
    tenant, never the count). Enough for the tenant's windows to refuse it
    (`Quotas.reserve_early`) before the tokenizer spends time on it."""
    find_candidates(ctx, policy.routes, policy.adapters)
    assert ctx.model is not None
    if ctx.images:
        check_images(ctx)
    bound_output(ctx, ctx.model.spec.default_output_tokens)
    estimate_output(ctx, policy.estimator, ctx.model.spec.default_output_tokens)


async def count_and_route(ctx: Ctx, policy: Policy) -> None:
    """Count the prompt, then what depends on the count: the class, the route."""
    await count_input(ctx)
    assert ctx.model is not None
    force_length(ctx, ctx.model.spec.max_model_len)
    classify(ctx, policy.workloads)
    route(ctx)


async def decide(
    ctx: Ctx, policy: Policy, loads: Mapping[str, PoolLoad], heard: Heard | None = None
) -> None:
    """Where a request without a stored response goes, at the pools' `loads`, or its refusal:
    what `llm-gateway explain` runs (the server's path has the tenant's early charge between,
    and a holder's replica to find)."""
    before_count(ctx, policy)
    await count_and_route(ctx, policy)
    policy.placement.place(ctx, loads, heard)


def _request_ids(request: web.Request) -> tuple[str, str]:
    """The request's id, which the client is echoed and the logs name: the client's
    `x-request-id` when it sent a usable one, else the gateway's own; and the id the replica is
    sent, the gateway's own always. vLLM makes that its engine's request id: a client's would
    let a tenant collide with another's request, and a counter would let it guess one."""
    own = os.urandom(16).hex()  # 128 random bits: unique, and no other id tells it
    given = request.headers.get("x-request-id")
    if given and len(given) <= 128 and given.isascii() and given.isprintable():
        return given, own
    return own, own


async def admit_and_forward(ctx: Ctx, request: web.Request, runtime: Runtime) -> web.StreamResponse:
    """Hold a slot and forward. What a replica refused before taking it goes back to its
    place in the queue, to wait for a replica it has not tried (`admit.Place`), within the
    pool's retry budget and the request's `max_wait_s`; never after a byte was sent."""
    assert ctx.pool is not None
    name = ctx.pool.name
    slots, upstream, key = runtime.slots[name], runtime.upstreams[name], runtime.api_keys[name]
    timeouts = ctx.pool.spec.timeouts
    queued = Place()
    while True:
        retrying = bool(queued.avoid)
        slots.retrying += retrying
        try:
            async with slots.slot(ctx, queued) as grant:
                replica = grant.replica
                tried = queued.avoid | {replica.url}
                retry_next = slots.can_retry(tried)
                try:
                    resp = await forward(
                        ctx,
                        request,
                        upstream,
                        replica.url,
                        key,
                        timeouts,
                        runtime.max_response_bytes,
                        retry_503=retry_next,
                        rename_model=runtime.rename_model,
                    )
                except ReplicaRefused:
                    slots.answered(grant, ctx, Ejection.REFUSED)
                    if not (retry_next and slots.can_retry(tried)):
                        raise
                    # Back in the queue it is served by no replica (nor charged as if it
                    # were) until another grant names one.
                    queued.avoid, ctx.retries, ctx.replica = tried, ctx.retries + 1, ""
                    continue
                except UpstreamTimeout:
                    slots.answered(grant, ctx, Ejection.TIMEOUT)
                    raise
                except UpstreamError:
                    slots.answered(grant, ctx, Ejection.UPSTREAM_ERROR)
                    raise
                # A stream the replica broke after its first byte, or its own 5xx.
                broke = ctx.refusal.ejection if ctx.refusal is not None else None
                if broke is not None or ctx.status >= 500:
                    slots.answered(grant, ctx, broke or Ejection.STATUS_5XX)
                else:
                    slots.answered(grant, ctx, None)
                return resp
        finally:
            slots.retrying -= retrying


async def handle(gateway: Gateway, request: web.Request, api: Api) -> web.StreamResponse:
    """One request from its arrival to its accounting: the stages in order, each filling its part
    of the `Ctx` or raising a `GatewayError` that becomes the client's refusal; `finally` accounts
    for every request and settles its charge, however it ended."""
    request_id, upstream_id = _request_ids(request)
    ctx = Ctx(
        request_id=request_id,
        upstream_id=upstream_id,
        api=api,
        path=request.path,
        headers=request.headers,
        arrived=time.perf_counter(),
    )
    runtime = gateway.runtime
    policy = runtime.policy
    if gateway.tracing is not None:
        ctx.trace = gateway.tracing.begin(ctx, request.method)
    charge: Charge | None = None
    try:
        try:
            if gateway.draining:
                raise ShuttingDown("the gateway is shutting down", retry_after_s=1)
            authenticate(ctx, policy.tenants)  # before the body: strangers cost no read
            check_forwardable(request.raw_headers)
            raw = await body.read(request, policy.spec.server.max_body_bytes)
            if api.reads_body:
                threads = policy.tokenizer_threads
                await parse_request(
                    ctx, request.headers.get("Content-Type", ""), raw, policy.spec.server,
                    threads.small if threads is not None else None,
                )  # fmt: skip
                await gateway.holders.look_up(ctx)
                before_count(ctx, policy)
                # Cheap refusals first: the tenant's windows before the tokenizer (`decide`'s
                # order, with the early charge between). From here `charge` is what `finally`
                # settles, whatever ends the request (a refusal, or the client leaving mid-count).
                charge = await gateway.quotas.reserve_early(ctx)
                counting = time.perf_counter()
                await count_and_route(ctx, policy)
                ctx.counted = (counting, time.perf_counter())
            else:  # a passthrough path: routed by its path, its body unread, relayed as it comes
                ctx.raw, ctx.stream = raw, True
                route_unread(ctx, policy.passthrough)
            await place(
                ctx, policy.placement, runtime.slots, gateway.holders,
                gateway.accountant.metrics.spillover,
            )  # fmt: skip
            set_objective(ctx)
            charge = await gateway.quotas.reserve(ctx, charge)
            resp = await admit_and_forward(ctx, request, runtime)
            await gateway.holders.remember(ctx)
        except GatewayError as exc:
            ctx.status, ctx.refusal, ctx.code = exc.status, exc.refusal, exc.code
            await gateway.quotas.describe(ctx)
            resp = api.error_response(
                exc, {"x-request-id": ctx.request_id, **ctx.ratelimit_headers}
            )
            ctx.status = resp.status  # the API's own (Anthropic's 529 for a full pool)
        except ConnectionResetError:
            raise  # the client left: below, not a failure of the gateway's
        except Exception:
            log.exception("request %s failed", ctx.request_id)
            error = GatewayError("internal gateway error; see the gateway log")
            ctx.status, ctx.refusal, ctx.code = error.status, error.refusal, error.code
            await gateway.quotas.describe(ctx)
            resp = api.error_response(
                error, {"x-request-id": ctx.request_id, **ctx.ratelimit_headers}
            )
        if not resp.prepared:  # a whole answer or a refusal: the client gets it before the
            try:  # accounting runs, which then times its sending too
                await resp.prepare(request)
                await resp.write_eof()
            except ConnectionResetError:  # it left as its answer went out: not our error
                client_left(ctx)
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        client_left(ctx)
        raise
    finally:
        gateway.accountant.account(ctx, policy.estimator)
        if charge is not None:  # after account, which completes the output count
            gateway.quotas.settle(ctx, charge)
        if ctx.trace is not None:  # after account, which ends the request and reads its usage
            ctx.trace.finish(ctx)
