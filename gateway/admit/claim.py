"""What admission weighs of a request."""

from __future__ import annotations

from typing import NamedTuple

from gateway.context.affinity import Affinity
from gateway.context.ctx import Ctx
from gateway.context.objective import Objective


class Claim(NamedTuple):
    """What admission weighs of a request (a tuple: made for every request, it must be cheap)."""

    tokens: int  # input + expected output, held against `max_inflight_tokens`
    priority: int = 1  # index into PRIORITIES
    workload: str = ""  # its class, for the slots `reserve` keeps
    tenant: str = ""  # its fair-share flow within the tier ("" without tenants)
    weight: float = 1.0
    affinity: Affinity | None = None  # what the pool's scorers weigh; None: its picker needs none
    adapter: str = ""  # the LoRA adapter asked for; "": the base model
    replica: str = ""  # the one replica it may run on (a stored response's holder); "": any
    objective: Objective | None = None  # its latency objective, on a pool with `slo`
    input_tokens: int = 0  # its prompt: the prefill a latency model weighs

    @classmethod
    def of(cls, ctx: Ctx, affinity: Affinity | None = None) -> Claim:
        tenant = ctx.tenant
        replica = ctx.holder.replica if ctx.holder is not None else ""
        if tenant is None:
            return cls(
                ctx.held_tokens,
                ctx.priority,
                ctx.workload,
                affinity=affinity,
                adapter=ctx.adapter,
                replica=replica,
                objective=ctx.objective,
                input_tokens=ctx.input_tokens,
            )
        return cls(
            ctx.held_tokens,
            ctx.priority,
            ctx.workload,
            tenant.name,
            tenant.spec.weight,
            affinity,
            ctx.adapter,
            replica,
            ctx.objective,
            ctx.input_tokens,
        )
