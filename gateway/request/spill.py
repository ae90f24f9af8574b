"""The spill stage: a request whose route's pool is full goes to a fallback pool that has room.

The route's `fallback` list is tried in order; the first fallback whose conditions hold takes
the request: the request's tier may spill, the primary is full by the fallback's `when` (its
saturation, or the request's predicted wait there), the fallback's own saturation is under its
`below_saturation`, and the request fits the fallback's model (context length, LoRA adapter).
Otherwise the request stays with its route's pool and is queued, shed or refused there as
before.

The choice is made once, before the quota is charged and before any slot is asked for, so the
tenant's pool and model windows are those of the pool that serves the request, and a request is
admitted to one pool only. A spilled request is still demand for its primary: it is counted there
as one that could not be served (`Demand.refused`), so `llm_pool_desired_replicas` asks for the
replicas that would have kept it at home, and spilling stops once they serve.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from gateway.admit import LivePool
from gateway.config.schema import PRIORITIES
from gateway.context.ctx import Ctx

if TYPE_CHECKING:
    from gateway.context.compiled import Fallback
    from gateway.fleet.adapters import Adapters
    from gateway.observability.fast import Counter


class PoolLoad(Protocol):
    """What spilling reads of a pool: `LivePool` live, or `explain`'s assumed figures."""

    @property
    def saturation(self) -> float: ...

    def predicted_wait(self, workload: str) -> float | None: ...


def primary_full(fallback: Fallback, primary: PoolLoad, workload: str) -> bool:
    """Whether `fallback`'s `when` holds for a new request of class `workload` on `primary`."""
    if fallback.saturation_gte is not None and primary.saturation >= fallback.saturation_gte:
        return True
    if fallback.predicted_wait_gte_s is None:
        return False
    wait = primary.predicted_wait(workload)
    return wait is not None and wait >= fallback.predicted_wait_gte_s


def fits(ctx: Ctx, fallback: Fallback, adapters: Adapters) -> bool:
    """The fallback's model can serve the request: it fits the context, and a LoRA request goes
    only to a pool serving its adapter."""
    if ctx.adapter and fallback.pool.name not in adapters.pools(ctx.adapter):
        return False
    return ctx.fits_context(fallback.pool.model.spec.max_model_len)


# Why a fallback did not take a request, in the order they are checked.
TIER, PRIMARY_HAS_ROOM, FALLBACK_FULL, DOES_NOT_FIT = (
    "tier", "primary_has_room", "fallback_full", "does_not_fit"
)  # fmt: skip


def passed_over(
    ctx: Ctx, fallback: Fallback, loads: Mapping[str, PoolLoad], adapters: Adapters
) -> str | None:
    """Why `fallback` does not take `ctx` now, or None: it does."""
    assert ctx.pool is not None
    if ctx.priority not in fallback.tiers:
        return TIER
    if not primary_full(fallback, loads[ctx.pool.name], ctx.workload):
        return PRIMARY_HAS_ROOM
    if loads[fallback.pool.name].saturation >= fallback.below_saturation:
        return FALLBACK_FULL
    if not fits(ctx, fallback, adapters):
        return DOES_NOT_FIT
    return None


def choose(ctx: Ctx, loads: Mapping[str, PoolLoad], adapters: Adapters) -> Fallback | None:
    """The first fallback that takes `ctx` now, or None: it stays on its route's pool."""
    assert ctx.route is not None
    for fallback in ctx.route.fallbacks:
        if passed_over(ctx, fallback, loads, adapters) is None:
            return fallback
    return None


def spill(ctx: Ctx, slots: Mapping[str, LivePool], adapters: Adapters, spilled: Counter) -> None:
    """Move `ctx` to the fallback `choose` names, if any, and count the move."""
    if ctx.route is None or not ctx.route.fallbacks:
        return
    fallback = choose(ctx, slots, adapters)
    if fallback is None:
        return
    assert ctx.pool is not None
    primary = slots[ctx.pool.name]
    primary.demand.arrivals += 1
    primary.demand.refused += 1
    spilled.labels(
        ctx.route.label, ctx.pool.name, fallback.pool.name, PRIORITIES[ctx.priority]
    ).inc()
    move(ctx, fallback)


def move(ctx: Ctx, fallback: Fallback) -> None:
    """Hand `ctx` to `fallback`'s pool, and its model: the answer and the metrics are its."""
    assert ctx.pool is not None
    ctx.spilled_from = ctx.pool.name
    ctx.pool, ctx.model = fallback.pool, fallback.pool.model
