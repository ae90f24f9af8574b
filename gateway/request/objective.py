"""The objective stage: the latency a request is promised, on a pool that admits by latency.

Each of a request's two objectives, time to first token and per output token, is the first
stated of: the client's header (`x-slo-ttft-ms` / `x-slo-tpot-ms`, or llm-d's
`x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms`, so its clients work unchanged; unless the pool's
`slo.headers` is off), its tenant's `slo`, its class's, its tier's default on the pool. A header
may ask for any objective: it orders only its own tenant's requests among themselves (the queue
stays fair between tenants, gateway/admit/fairqueue.py), and what an objective can cost others,
preemption, is the critical tier's, which the tenant's policy grants, not the header.

It runs once placement has chosen the pool; on a pool without `slo` it does nothing, so a policy
with no objectives pays one attribute read.
"""

from __future__ import annotations

import math

from multidict import CIMultiDictProxy

from gateway.context.ctx import Ctx
from gateway.context.objective import Bound, Objective
from gateway.errors import BadRequest

TTFT_HEADERS = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
TPOT_HEADERS = ("x-slo-tpot-ms", "x-llm-d-slo-tpot-ms")
SLO_HEADERS = frozenset(TTFT_HEADERS + TPOT_HEADERS)  # the client's: never sent upstream
_MAX_MS = 3_600_000.0  # an hour: a longer objective is no objective


def set_objective(ctx: Ctx) -> None:
    pool = ctx.pool
    if pool is None or (defaults := pool.objectives) is None:
        return
    asked = _asked(ctx.headers) if defaults.headers else (None, None)
    tenant = ctx.tenant.objectives if ctx.tenant is not None else (None, None)
    workload = defaults.by_class.get(ctx.workload, (None, None))
    tier = defaults.by_tier[ctx.priority]
    ttft = _first(asked[0], tenant[0], workload[0], tier[0])
    tpot = _first(asked[1], tenant[1], workload[1], tier[1])
    if ttft == math.inf and tpot == math.inf:
        return
    ctx.objective = Objective(ttft, tpot, ctx.arrived + ttft)


def _first(*stated: float | None) -> float:
    return next((s for s in stated if s is not None), math.inf)


def _asked(headers: CIMultiDictProxy[str]) -> Bound:
    return _header(headers, TTFT_HEADERS), _header(headers, TPOT_HEADERS)


def _header(headers: CIMultiDictProxy[str], names: tuple[str, str]) -> float | None:
    for name in names:
        value = headers.get(name)
        if value is None:
            continue
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not 0 < ms <= _MAX_MS:  # NaN too
            raise BadRequest(
                f"{name} must be a number of milliseconds over 0 and at most {_MAX_MS:.0f}",
                param=name,
                code="invalid_slo",
            )
        return ms / 1000
    return None
