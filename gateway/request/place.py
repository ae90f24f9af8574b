"""The placement step: the one place that decides which pool serves a request.

In the terms of the Gateway API Inference Extension's endpoint picker, placement filters and
picks pools, as a pool's picker (gateway/pick/) later filters and picks its replicas:

- the candidates: a request continuing a stored response has one, the pool holding it
  (gateway/request/holders.py), whatever its route and fallbacks say; any other has its route's
  pool (gateway/request/route.py chose it by the request's class), then the route's `fallback`
  pools in order;
- the filters: every pool's rules (`PoolCheck`, gateway/request/checks.py), run once per pool
  considered. The route's pool or the holder's refusing is the client's refusal: a fallback is
  for a full pool, not for a request its route's pool cannot serve. A fallback refusing is passed
  over;
- the picker (`Placement.verdicts`): the route's pool, unless it is full by a fallback's `when`
  (its saturation, or the request's predicted wait there), the request's tier may spill, and the
  fallback's own saturation is under its `below_saturation`: then the first such fallback the
  rules let take it.

The choice is made once, before the quota is charged and before any slot is asked for, so the
tenant's pool and model windows are those of the pool that serves the request, and a request is
admitted to one pool only. A spilled request is still demand for its primary: it is counted there
as one that could not be served (`Demand.refused`), so `llm_pool_desired_replicas` asks for the
replicas that would have kept it at home, and spilling stops once they serve. `llm-gateway
explain` runs the same `Placement.place` on the loads its command line assumes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from gateway.config.schema import PRIORITIES

if TYPE_CHECKING:
    from gateway.admit import LivePool
    from gateway.context.compiled import Fallback, Pool
    from gateway.context.ctx import Ctx
    from gateway.errors import GatewayError
    from gateway.observability.fast import Counter
    from gateway.request.checks import PoolCheck
    from gateway.request.holders import Holders


class PoolLoad(Protocol):
    """What placement reads of a pool: `LivePool` live, or `explain`'s assumed figures."""

    @property
    def saturation(self) -> float: ...

    def predicted_wait(self, workload: str) -> float | None: ...


# Why a fallback did not take a request, in the order they are asked; or the `label` of the
# pool's rule that refused it (`PoolCheck.label`).
TIER, PRIMARY_HAS_ROOM, FALLBACK_FULL = "tier", "primary_has_room", "fallback_full"

# Told each fallback considered, in order, with why it did not take the request (None: it did).
Heard = Callable[["Fallback", "str | None"], None]


def primary_full(fallback: Fallback, primary: PoolLoad, workload: str) -> bool:
    """Whether `fallback`'s `when` holds for a new request of class `workload` on `primary`."""
    if fallback.saturation_gte is not None and primary.saturation >= fallback.saturation_gte:
        return True
    if fallback.predicted_wait_gte_s is None:
        return False
    wait = primary.predicted_wait(workload)
    return wait is not None and wait >= fallback.predicted_wait_gte_s


class Placement:
    """A policy's placement: its pools, and each pool's rules (those that apply there)."""

    __slots__ = ("pools", "rules")

    def __init__(self, checks: tuple[PoolCheck, ...], pools: Mapping[str, Pool]) -> None:
        self.pools = pools
        self.rules = {name: tuple(c for c in checks if c.applies(p)) for name, p in pools.items()}

    def refusal(self, ctx: Ctx, pool: Pool) -> tuple[PoolCheck, GatewayError] | None:
        """The first of `pool`'s rules that refuses `ctx`, with its refusal; None: it may serve."""
        for check in self.rules[pool.name]:
            refused = check.check(ctx, pool)
            if refused is not None:
                return check, refused
        return None

    def admits(self, ctx: Ctx, pool: Pool) -> None:
        """Raise the refusal of `pool`'s first rule that refuses `ctx`."""
        refused = self.refusal(ctx, pool)
        if refused is not None:
            raise refused[1]

    def passed_over(
        self, ctx: Ctx, fallback: Fallback, loads: Mapping[str, PoolLoad]
    ) -> str | None:
        """Why `fallback` does not take `ctx` now, or None: it does."""
        assert ctx.pool is not None
        if ctx.priority not in fallback.tiers:
            return TIER
        if not primary_full(fallback, loads[ctx.pool.name], ctx.workload):
            return PRIMARY_HAS_ROOM
        if loads[fallback.pool.name].saturation >= fallback.below_saturation:
            return FALLBACK_FULL
        refused = self.refusal(ctx, fallback.pool)
        return refused[0].label if refused is not None else None

    def verdicts(
        self, ctx: Ctx, loads: Mapping[str, PoolLoad]
    ) -> Iterator[tuple[Fallback, str | None]]:
        """The route's fallbacks in order, each with why it does not take `ctx` now (None: it
        does), up to the first that does."""
        assert ctx.route is not None
        for fallback in ctx.route.fallbacks:
            why = self.passed_over(ctx, fallback, loads)
            yield fallback, why
            if why is None:
                return

    def place(
        self, ctx: Ctx, loads: Mapping[str, PoolLoad], heard: Heard | None = None
    ) -> Fallback | None:
        """Settle `ctx.pool`: the holder's pool, or the route's (`route` set it), each after its
        rules; or the first fallback that takes it, which it returns (`heard` is told each
        fallback considered). Raises the refusal of the pool that keeps the request."""
        if ctx.holder is not None:
            pool = self.pools[ctx.holder.pool]
            self.admits(ctx, pool)
            ctx.pool = pool
            return None
        assert ctx.pool is not None and ctx.route is not None
        self.admits(ctx, ctx.pool)
        if not ctx.route.fallbacks:
            return None
        for fallback, why in self.verdicts(ctx, loads):
            if heard is not None:
                heard(fallback, why)
            if why is None:
                ctx.spilled_from = ctx.pool.name
                ctx.pool, ctx.model = fallback.pool, fallback.pool.model  # the answer is its
                return fallback
        return None


async def place(
    ctx: Ctx,
    placement: Placement,
    live: Mapping[str, LivePool],
    holders: Holders,
    spilled: Counter,
) -> None:
    """The pipeline's placement: `Placement.place` on the live pools, once a holder's replica is
    known to be still in its pool (else the record is forgotten, and the client told); a move to
    a fallback is counted, and counted as demand its primary could not serve."""
    if ctx.holder is not None:
        assert ctx.continues is not None
        await holders.placed(ctx.continues, ctx.holder, live)
    fallback = placement.place(ctx, live)
    if fallback is not None:
        assert ctx.route is not None
        primary = live[ctx.spilled_from]
        primary.demand.arrivals += 1
        primary.demand.refused += 1
        spilled.labels(
            ctx.route.label, ctx.spilled_from, fallback.pool.name, PRIORITIES[ctx.priority]
        ).inc()
