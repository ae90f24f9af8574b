"""The route stage: pick the pool for a request (first matching route wins).

Routing runs in two steps because the tokenizer depends on the model a request goes to, while the
class depends on the token count: `candidates` keeps the routes whose model, endpoint and header
conditions match (known from the request alone), which also names the tokenizer; `route` then picks
the first candidate that accepts the request's class.

A request naming a LoRA adapter is routed as one for its base model, among the pools serving the
adapter only (a route naming the adapter itself matches too), so the base model's tokenizer
counts it, and it keeps the adapter's name upstream (`Ctx.adapter`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gateway.config.schema import PRIORITIES, RouteSpec
from gateway.context.compiled import Fallback, Pool, Route
from gateway.context.ctx import Ctx
from gateway.context.match import all_of, names, request_checks
from gateway.errors import ModelNotFound, NoRoute

if TYPE_CHECKING:
    from gateway.fleet.adapters import Adapters


def compile_route(index: int, spec: RouteSpec, pools: Mapping[str, Pool]) -> Route:
    match = spec.match
    checks = request_checks(None, match.endpoint, match.header)
    class_ok = names(match.class_) if match.class_ is not None else None
    return Route(
        index=index,
        pool=pools[spec.pool],
        accepts_model=names(match.model) if match.model is not None else lambda name: True,
        accepts_request=all_of(checks),
        accepts_class=(lambda ctx: class_ok(ctx.workload)) if class_ok else (lambda ctx: True),
        fallbacks=tuple(
            Fallback(
                pool=pools[f.pool],
                saturation_gte=f.when.saturation_gte,
                predicted_wait_gte_s=f.when.predicted_wait_gte_s,
                below_saturation=f.below_saturation,
                tiers=frozenset(PRIORITIES.index(t) for t in f.tiers),
            )
            for f in spec.fallback
        ),
        passthrough=tuple(spec.passthrough),
    )


def route_unread(ctx: Ctx, passthrough: Mapping[str, Route]) -> None:
    """The route and pool of a request to a passthrough path: the route naming the path, for
    whatever model; its body is not read, so the pool's model stands for the requested one."""
    route = passthrough[ctx.path]
    ctx.candidates = (route,)
    ctx.route, ctx.pool, ctx.model = route, route.pool, route.pool.model
    ctx.requested_model = route.pool.spec.model


def find_candidates(ctx: Ctx, routes: tuple[Route, ...], adapters: Adapters) -> None:
    name = ctx.requested_model
    pools = adapters.pools(name)
    if pools:
        ctx.adapter = name
        ctx.candidates = tuple(
            r
            for r in routes
            if r.pool.name in pools
            and (r.accepts_model(r.pool.spec.model) or r.accepts_model(name))
            and r.accepts_request(ctx)
        )
    else:
        ctx.candidates = tuple(
            r for r in routes if r.accepts_model(name) and r.accepts_request(ctx)
        )
    if not ctx.candidates:
        raise ModelNotFound(f"The model `{ctx.requested_model}` does not exist.", param="model")
    ctx.model = ctx.candidates[0].pool.model


def route(ctx: Ctx) -> None:
    for candidate in ctx.candidates:
        if candidate.accepts_class(ctx):
            ctx.route = candidate
            ctx.pool = candidate.pool
            return
    raise NoRoute(
        f"no route serves model `{ctx.requested_model}` for requests of class `{ctx.workload}`"
    )
