"""The aiohttp application: routes, each in one wrapper for limits and errors, and the gateway's
lifespan."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from importlib.metadata import version as package_version
from typing import IO, Any

import orjson
from aiohttp import web

from gateway.admit import Replica
from gateway.api import BY_PATH, MESSAGES, Api, anthropic
from gateway.api.json_body import decode_checked
from gateway.api.passthrough import PASSTHROUGH
from gateway.config.load import PolicyError
from gateway.config.schema import ServerSpec
from gateway.errors import (
    AdminDisabled,
    GatewayError,
    InvalidPolicy,
    MethodNotAllowed,
    NotFound,
    Starting,
    Unauthorized,
    error_body,
)
from gateway.pipeline import handle
from gateway.policy.compile import Policy
from gateway.request import body
from gateway.request.authenticate import identify
from gateway.request.parse import by_size
from gateway.runtime import Gateway
from gateway.server import logs, vllm_endpoints
from gateway.server.exposition import collected, exposition
from gateway.server.limits import RequestLimits, handler_args
from gateway.server.model_cards import model_cards
from gateway.server.stored_responses import relay
from gateway.server.workers import ask_parent_to_reload

log = logging.getLogger("gateway.server")

GATEWAY = web.AppKey("gateway", Gateway)
VERSION = package_version("llm-admission-gateway")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _clip(text: str, limit: int = 200) -> str:
    """What of a client's identifier is echoed: a 16 KB path is not worth sending back."""
    return text if len(text) <= limit else text[:limit] + "…"


Render = Callable[[GatewayError, dict[str, str] | None], web.Response]


def _openai(error: GatewayError, headers: dict[str, str] | None = None) -> web.Response:
    return error.response(headers)


def renderer(path: str) -> Render:
    """How refusals on `path` are written: Anthropic's shape under `/v1/messages` (the API's
    own paths, and any other there: a 404 for `/v1/messages/batches` too), else OpenAI's."""
    return anthropic.error_response if path.startswith(MESSAGES.path) else _openai


def guarded(handler: Handler, server: ServerSpec | None, render: Render = _openai) -> Handler:
    """`handler` as its route runs it: within the policy's header and body limits (`server`;
    None on the metrics port, which reads no body), every refusal in the route's error shape
    (`render`: OpenAI's, or its API's).

    One wrapper per route instead of aiohttp middlewares: an application with none skips
    aiohttp's per-request middleware chain (a cached lookup, a coroutine layer per middleware
    and one more per application; `Application._handle`)."""

    async def guard(request: web.Request) -> web.StreamResponse:
        limits: RequestLimits | None = None
        try:
            if server is not None:
                limits = RequestLimits(request, server)
            response = await handler(request)
        except GatewayError as exc:
            response = render(exc, None)
        except web.HTTPException as exc:  # aiohttp's own, should a handler let one through
            body = error_body(exc.reason, "invalid_request_error", exc.status)
            response = web.Response(status=exc.status, body=body, content_type="application/json")
        finally:
            if limits is not None:
                limits.cancel()
        if limits is not None and limits.expired:
            response.force_close()
        return response

    return guard


async def not_found(request: web.Request) -> web.Response:
    method, path = _clip(request.method), _clip(request.path)
    error = NotFound(f"{method} {path} is not served by this gateway")
    return renderer(request.path)(error, None)


async def passthrough_or_not_found(gateway: Gateway, request: web.Request) -> web.StreamResponse:
    """A path none of the gateway's routes serve: a `POST` to a path a policy route names for its
    pool (`routes[].passthrough`, looked up in the running policy, so a reload changes them) is
    admitted and forwarded; anything else is a 404 (a 405 for another method there)."""
    if request.path not in gateway.policy.passthrough:
        return await not_found(request)
    if request.method != "POST":
        return await method_not_allowed({"POST"})(request)
    return await handle(gateway, request, PASSTHROUGH)


def method_not_allowed(allowed: set[str], render: Render = _openai) -> Handler:
    allow = ",".join(sorted(allowed))

    async def refuse(request: web.Request) -> web.Response:
        method, path = _clip(request.method), _clip(request.path)
        error = MethodNotAllowed(f"{method} is not allowed on {path}")
        return render(error, {"Allow": allow})

    return refuse


def add_routes(
    app: web.Application,
    server: ServerSpec | None,
    routes: dict[str, dict[str, Handler]],
    unrouted: Handler = not_found,
) -> None:
    """`routes` (path -> method -> handler), each guarded; any other method on those paths is a
    405 naming the allowed ones, and any other path goes to `unrouted` (a 404), both in the
    path's error shape (`renderer`; the router's own answers are plain text)."""
    for path, methods in routes.items():
        render = renderer(path)
        for method, handler in methods.items():
            app.router.add_route(method, path, guarded(handler, server, render))
            if method == "GET":
                app.router.add_route("HEAD", path, guarded(handler, server, render))
        allowed = {*methods, *(("HEAD",) if "GET" in methods else ())}
        refuse = method_not_allowed(allowed, render)
        app.router.add_route("*", path, guarded(refuse, server, render))
    app.router.add_route("*", "/{path:.*}", guarded(unrouted, server))


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


async def list_models(request: web.Request) -> web.Response:
    policy = request.app[GATEWAY].policy
    identify(request.headers, policy.tenants)  # with tenants, strangers learn nothing here either
    return _json({"object": "list", "data": model_cards(policy)})


async def _metered(
    request: web.Request,
    check: Callable[[dict[str, Any], ServerSpec], dict[str, Any]],
    answer: Callable[[Policy, dict[str, Any]], Awaitable[tuple[object, int]]],
    api: Api | None = None,
) -> web.Response:
    """A `/tokenize`, `/detokenize` or `count_tokens` call: the key checked and one request and
    a token charged to the tenant's windows before the body is read (a tenant out of either
    costs no read, no decode and no tokenizer time), then the body decoded within the limits
    every request has, checked by `check` (both on the tokenizer threads when the body is large,
    as a request's parse is) and answered, and the token charge corrected to the tokens the
    answer handled (a refusal: none). Every answer to a limited tenant carries its
    `x-ratelimit-*` headers."""
    gateway = request.app[GATEWAY]
    policy = gateway.policy
    tenant = identify(request.headers, policy.tenants)
    ratelimit: dict[str, str] = {}
    charge = None
    handled = 1  # a client that leaves mid-count keeps the token reserved before it
    try:
        if tenant is not None:
            charge = await gateway.quotas.reserve_counting(tenant, ratelimit, api)
        raw = await body.read(request, policy.spec.server.max_body_bytes)
        threads = policy.tokenizer_threads
        decoded = await by_size(
            raw, threads.small if threads is not None else None, decode_checked,
            request.headers.get("Content-Type", ""), raw, policy.spec.server, check,
        )  # fmt: skip
        data, handled = await answer(policy, decoded)
        response = _json(data)
    except GatewayError as exc:
        handled = 0
        response = exc.response() if api is None else api.error_response(exc)
    finally:
        if charge is not None:
            gateway.quotas.settle_counted(charge, handled)
    response.headers.update(ratelimit)
    return response


async def tokenize(request: web.Request) -> web.Response:
    return await _metered(
        request,
        vllm_endpoints.check_tokenize,
        lambda policy, checked: vllm_endpoints.tokenize(policy, checked, request.headers),
    )


async def detokenize(request: web.Request) -> web.Response:
    return await _metered(
        request,
        vllm_endpoints.check_detokenize,
        lambda policy, checked: vllm_endpoints.detokenize(policy, checked, request.headers),
    )


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's `POST /v1/messages/count_tokens`, answered from the model's tokenizer as
    `/tokenize` is, metered and refused as `/v1/messages` is."""
    return await _metered(
        request,
        vllm_endpoints.check_count_tokens,
        lambda policy, checked: vllm_endpoints.count_tokens(policy, checked, request.headers),
        MESSAGES,
    )


async def version(request: web.Request) -> web.Response:
    """vLLM's `{"version": ...}`, with the gateway's own version: it is the gateway answering,
    and a replica's vLLM version would be one of several during a rolling upgrade. Open with
    tenants too, as vLLM serves it: tools that check a server's version before they send (and
    probes) carry no key, and the answer names no tenant, model or replica."""
    return _json({"version": VERSION})


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def health(request: web.Request) -> web.Response:
    """vLLM's liveness answer (200, empty body), so probes and tools written for vLLM work as is."""
    return web.Response(status=200)


def _replica_state(replica: Replica) -> str:
    """`healthy` only once it answered, and while the last probe or request to it succeeded."""
    if not replica.up:
        return "ejected"
    if not replica.checked:
        return "unchecked"
    return "failing" if replica.failures else "healthy"


async def readyz(request: web.Request, *, public: bool) -> web.Response:
    """Ready while a policy is loaded, any pool has a replica in it, failing or not, and no
    shutdown has begun: every gateway sees the same replicas, so a readiness that followed their
    health would take all of them out of the Service at once (docs/operations.md, Readiness).
    The body says how many of each pool's replicas are healthy, failing (its last probe or
    request failed; kept in, a pool never ejects its last one), ejected, and unchecked (no probe or request has
    answered since it joined: probes are off, or it came with DNS or a reload); and each replica's state by URL only
    where `/metrics` is served (`Gateway.metrics_public`), whose labels name them already."""
    gateway = request.app[GATEWAY]
    named = not public or gateway.metrics_public
    pools: dict[str, dict[str, Any]] = {}
    for name, slots in gateway.slots.items():
        states = {r.url: _replica_state(r) for r in slots.replicas}
        pool: dict[str, Any] = {
            state: sum(s == state for s in states.values())
            for state in ("healthy", "failing", "ejected", "unchecked")
        }
        if named:
            pool["replicas"] = states
        pools[name] = pool
    ready = not gateway.draining and any(
        r.up for slots in gateway.slots.values() for r in slots.replicas
    )
    body = {"ready": ready, "draining": gateway.draining, "pools": pools}
    return _json(body, 200 if ready else 503)


async def admin_reload(request: web.Request) -> web.Response:
    """Reload the policy file now: 200 with the new hash, 422 listing every problem of the file,
    or 500 `reload_failed` should anything else go wrong (`Gateway.reload`)."""
    gateway = request.app[GATEWAY]
    env = gateway.policy.spec.admin.token_env
    token = os.environ.get(env)
    if not token:
        raise AdminDisabled(f"admin endpoints are off: set {env} to enable them")
    # Any case of the scheme, as for tenant keys (RFC 9110, 11.1); only the token is compared,
    # in constant time. surrogateescape: a non-UTF-8 byte is a wrong token, not a crash.
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    given_bytes = given.strip().encode("utf-8", "surrogateescape")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(given_bytes, token.encode())):
        raise Unauthorized("admin calls need `Authorization: Bearer <admin token>`")
    try:
        # Shielded: a client that leaves mid-reload must not cancel it halfway (after the
        # swap, before the removed pools' connections and sessions are closed).
        reloading = asyncio.ensure_future(gateway.reload())
        reloading.add_done_callback(lambda t: t.cancelled() or t.exception())  # logged by reload
        policy = await asyncio.shield(reloading)
    except PolicyError as exc:
        raise InvalidPolicy(str(exc)) from None
    if gateway.workers > 1:  # this worker alone answered: the others reload too
        ask_parent_to_reload()
    return _json({"reloaded": True, "hash": policy.digest, "pools": sorted(policy.pools)})


async def metrics(request: web.Request, *, public: bool) -> web.Response:
    """The gateway's metrics (`exposition`); on the public port, a 404 as soon as the running
    policy has tenants (`Gateway.metrics_public`)."""
    if public and not request.app[GATEWAY].metrics_public:
        return await not_found(request)
    registry = request.app[GATEWAY].accountant.metrics.registry
    return await exposition(request, await collected(registry.collectors))


def create_app(
    policy: Policy, *, access_log: IO[bytes] | None = None, workers: int = 1
) -> web.Application:
    """Build the gateway app for a compiled policy; `access_log` gets one JSON line per request;
    `workers`: the processes of its pod (`serve --workers`), this one included."""
    logs.install()
    gateway = Gateway(policy, access_log if policy.spec.server.access_log else None, workers)
    server = policy.spec.server
    app = web.Application(client_max_size=server.max_body_bytes, handler_args=handler_args(server))
    app[GATEWAY] = gateway

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        await gateway.open()
        yield
        await gateway.close()

    app.cleanup_ctx.append(lifespan)
    routes: dict[str, dict[str, Handler]] = {
        # Each API's path (gateway/api/), bound to the gateway and its `Api` here: no lookup,
        # and no coroutine layer, per request.
        **{path: {"POST": partial(handle, gateway, api=api)} for path, api in BY_PATH.items()},
        "/v1/messages/count_tokens": {"POST": count_tokens},
        "/v1/responses/{response_id}": {"GET": partial(relay, gateway)},
        "/v1/responses/{response_id}/cancel": {"POST": partial(relay, gateway)},
        "/v1/models": {"GET": list_models},
        "/tokenize": {"POST": tokenize},
        "/detokenize": {"POST": detokenize},
        "/version": {"GET": version},
        "/healthz": {"GET": healthz},
        "/health": {"GET": health},
        "/readyz": {"GET": partial(readyz, public=True)},
        "/admin/reload": {"POST": admin_reload},
    }
    if server.metrics_port is None:
        routes["/metrics"] = {"GET": partial(metrics, public=True)}
    add_routes(app, server, routes, partial(passthrough_or_not_found, gateway))
    return app


def create_starting_app() -> web.Application:
    """What the listener serves while the policy and its tokenizers load (`llm-gateway serve`):
    alive (`/healthz`, `/health`), not ready (`/readyz` 503, `"starting": true`), and any other
    request refused 503 `starting` in its API's shape. Liveness so holds however long a load
    takes, and a pod joins its Service only once it counts as it will: loaded and warm."""

    async def not_ready(request: web.Request) -> web.Response:
        return _json({"ready": False, "starting": True, "draining": False, "pools": {}}, 503)

    async def refuse(request: web.Request) -> web.Response:
        error = Starting(
            "the gateway is starting: its policy and tokenizers are loading", retry_after_s=1.0
        )
        return renderer(request.path)(error, None)

    app = web.Application()
    for path, handler in (("/healthz", healthz), ("/health", health), ("/readyz", not_ready)):
        app.router.add_get(path, handler, allow_head=False)
    app.router.add_route("*", "/{anything:.*}", refuse)
    return app


def create_metrics_app(app: web.Application) -> web.Application:
    """`/metrics` for `server.metrics_port`, reading the gateway `app` serves, and `/readyz` with
    each replica named: replica URLs stay off the public port."""
    metrics_app = web.Application()
    metrics_app[GATEWAY] = app[GATEWAY]
    routes: dict[str, dict[str, Handler]] = {
        "/metrics": {"GET": partial(metrics, public=False)},
        "/readyz": {"GET": partial(readyz, public=False)},
    }
    add_routes(metrics_app, None, routes)
    return metrics_app
