"""The request pipeline: parse -> tokenize -> estimate -> classify -> route -> admit -> forward -> account.

Each stage is a small function in its own module that fills in its part of the `Ctx` or raises a
`GatewayError`; this module only calls them in order and owns the `finally` that accounts for
every request, however it ended.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid

import aiohttp
from aiohttp import web

from gateway.account import Accountant
from gateway.admit import PoolSlots
from gateway.classify import classify
from gateway.context import Ctx, Endpoint
from gateway.errors import (
    BodyTooLarge,
    ContextLengthExceeded,
    GatewayError,
    ReplicaRefused,
    ShuttingDown,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.estimate import estimate_output
from gateway.forward import CLIENT_CLOSED, forward
from gateway.health import HealthChecker
from gateway.parse import parse
from gateway.policy.compile import Policy
from gateway.route import find_candidates, route

log = logging.getLogger("gateway.pipeline")
_BROKEN_STREAM = frozenset({"upstream_error", "upstream_timeout"})  # failed after the first byte


async def count_input(ctx: Ctx) -> None:
    assert ctx.model is not None
    counter = ctx.model.counter
    if ctx.endpoint == "chat":
        ctx.input_tokens = ctx.longest_prompt = await counter.count_chat(ctx.body)
    else:
        counts = await counter.count_prompts(ctx.body["prompt"])
        ctx.input_tokens, ctx.longest_prompt = sum(counts), max(counts)


def check_context_length(ctx: Ctx) -> None:
    """Refuse early what vLLM would refuse anyway, before it takes a slot."""
    assert ctx.pool is not None
    limit = ctx.pool.model.spec.max_model_len
    needed = ctx.longest_prompt + (ctx.max_output or 0)
    if ctx.longest_prompt >= limit or needed > limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested"
            f" {needed} tokens ({ctx.longest_prompt} in the messages,"
            f" {ctx.max_output or 0} in the completion).",
            param="messages" if ctx.endpoint == "chat" else "prompt",
        )


async def decide(ctx: Ctx, policy: Policy) -> None:
    """Everything up to admission; also what `llm-gateway explain` runs."""
    find_candidates(ctx, policy.routes)
    await count_input(ctx)
    assert ctx.model is not None
    estimate_output(ctx, policy.estimator, ctx.model.spec.default_output_tokens)
    classify(ctx, policy.workloads)
    route(ctx)
    check_context_length(ctx)


_ID_PREFIX = uuid.uuid4().hex[:16]  # unique per process, so ids from several gateways never clash
_ID_SEQ = itertools.count(1)


def _request_id(request: web.Request) -> str:
    given = request.headers.get("x-request-id")
    if given and len(given) <= 128 and given.isascii() and given.isprintable():
        return given
    return f"{_ID_PREFIX}{next(_ID_SEQ):016x}"


class Gateway:
    """One policy's runtime: admission state, upstream sessions, accounting."""

    def __init__(self, policy: Policy, accountant: Accountant, slots: dict[str, PoolSlots]) -> None:
        self.policy = policy
        self.accountant = accountant
        self.slots = slots
        self.sessions: dict[str, aiohttp.ClientSession] = {}
        self.api_keys = {
            name: os.environ.get(pool.spec.api_key_env) if pool.spec.api_key_env else None
            for name, pool in policy.pools.items()
        }
        self.draining = False
        self._background: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        for name, pool in self.policy.pools.items():
            timeouts = pool.spec.timeouts
            connector = aiohttp.TCPConnector(
                limit=self.slots[name].capacity + 16, limit_per_host=0, keepalive_timeout=60
            )
            self.sessions[name] = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=timeouts.connect_s, sock_read=timeouts.read_s
                ),
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
            )
            checker = HealthChecker(self.slots[name], self.sessions[name])
            self._background.add(asyncio.create_task(checker.run(), name=f"health:{name}"))

    async def close(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        for session in self.sessions.values():
            await session.close()
        self.policy.close()

    async def _admit_and_forward(self, ctx: Ctx, request: web.Request) -> web.StreamResponse:
        """Hold a slot and forward; what a replica refused before taking it is retried on
        another replica of the pool, within the pool's retry budget, never after a byte was sent."""
        assert ctx.pool is not None
        name = ctx.pool.name
        slots, session, key = self.slots[name], self.sessions[name], self.api_keys[name]
        timeouts = ctx.pool.spec.timeouts
        avoid: frozenset[str] = frozenset()
        while True:
            retrying = bool(avoid)
            slots.retrying += retrying
            try:
                async with slots.slot(ctx, avoid) as replica:
                    tried = avoid | {replica.url}
                    retry_next = slots.can_retry(ctx.reserved_tokens, tried)
                    try:
                        resp = await forward(
                            ctx, request, session, replica.url, key, timeouts, retry_503=retry_next
                        )
                    except ReplicaRefused:
                        slots.failed(replica, "refused")
                        if not retry_next:
                            raise
                        avoid, ctx.retries = tried, ctx.retries + 1
                        continue
                    except UpstreamTimeout:
                        slots.failed(replica, "timeout")
                        raise
                    except UpstreamError:
                        slots.failed(replica, "upstream_error")
                        raise
                    if ctx.status >= 500 or ctx.reason in _BROKEN_STREAM:
                        slots.failed(replica, ctx.reason or "5xx")
                    else:
                        slots.succeeded(replica)
                    return resp
            finally:
                slots.retrying -= retrying

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        ctx = Ctx(
            request_id=_request_id(request),
            endpoint=endpoint,
            path=request.path,
            headers=request.headers,
            arrived=time.perf_counter(),
        )
        try:
            if self.draining:
                raise ShuttingDown("the gateway is shutting down", retry_after_s=1)
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                limit = self.policy.spec.server.max_body_bytes
                raise BodyTooLarge(f"request body is over the {limit}-byte limit") from None
            parse(ctx, request.content_type, raw)
            await decide(ctx, self.policy)
            return await self._admit_and_forward(ctx, request)
        except GatewayError as exc:
            ctx.status, ctx.reason = exc.status, exc.reason
            return exc.response({"x-request-id": ctx.request_id})
        except (asyncio.CancelledError, ConnectionResetError):
            ctx.status, ctx.reason = CLIENT_CLOSED, "client_disconnect"
            raise
        except Exception:
            log.exception("request %s failed", ctx.request_id)
            error = GatewayError("internal gateway error; see the gateway log")
            ctx.status, ctx.reason = error.status, error.reason
            return error.response({"x-request-id": ctx.request_id})
        finally:
            self.accountant.account(ctx, self.policy.estimator)
