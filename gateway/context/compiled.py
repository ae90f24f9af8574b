"""The compiled policy's records a request is put on: the tenant it is charged to, the route it
matched, the pool and model that serve it.

Plain records: the compiled policy (gateway/policy/compile.py) makes them, the stages read them
from the `Ctx`. A pool's picker is the admission machinery's, not the request's, and is kept by
the policy (`Policy.pickers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.config.schema import ModelSpec, PoolSpec, TenantSpec
from gateway.context.match import Check
from gateway.context.objective import Bound, Defaults
from gateway.tokenizer.counters import TokenCounter


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    spec: TenantSpec
    tier: int  # index into PRIORITIES: the highest priority its requests may have
    objectives: Bound = (None, None)  # its `slo` in seconds, for gateway/request/objective.py


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    spec: ModelSpec
    counter: TokenCounter


@dataclass(frozen=True, slots=True)
class Pool:
    name: str
    spec: PoolSpec
    model: Model
    objectives: Defaults | None = None  # with `slo`: its objectives where a request states none


@dataclass(frozen=True, slots=True)
class Fallback:
    """A pool the route spills to (`gateway/request/place.py`), with its conditions compiled."""

    pool: Pool
    saturation_gte: float | None
    predicted_wait_gte_s: float | None
    below_saturation: float
    tiers: frozenset[int]  # priority indexes that may spill


@dataclass(frozen=True, slots=True)
class Route:
    index: int
    pool: Pool
    accepts_model: Callable[[str], bool]
    accepts_request: Check  # its endpoint and header conditions
    accepts_class: Check
    fallbacks: tuple[Fallback, ...] = ()
    passthrough: tuple[str, ...] = ()  # more paths its pool serves, bodies unread

    @property
    def label(self) -> str:
        return f"routes[{self.index}]"
