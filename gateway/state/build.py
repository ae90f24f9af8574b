"""`build_state`: the policy's `state` section made into the objects the runtime holds.

The one place that chooses a backend, so the runtime (and tests that build a gateway) never name
one. A shared backend is an entry of `BACKENDS`, keyed by the `state.backend` value that selects
it (the schema's enum lists the same names); `FailoverState` wraps whichever is chosen.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.config.schema import StateSpec
from gateway.state.base import Backend, HolderRecord, SlotLedger, State
from gateway.state.failover import FailoverState
from gateway.state.memory import MemoryState
from gateway.state.redis import RedisState
from gateway.state.slices import SlicedState


def _redis(spec: StateSpec) -> Backend:
    redis = RedisState(
        spec.url,
        timeout_s=spec.timeout_s,
        lease_ttl_s=spec.lease_ttl_s,
        holder_ttl_s=spec.stored_response_ttl_s,
    )
    if spec.slices.fraction == 0:  # every request's charge its own script call, exactly
        return redis
    return SlicedState(redis, fraction=spec.slices.fraction, max_age_s=spec.slices.max_age_s)


# `state.backend` -> the shared backend it names; `memory` is no entry: a gateway alone shares
# nothing, so it has neither failover, nor ledger, nor holder record.
BACKENDS: dict[str, Callable[[StateSpec], Backend]] = {"redis": _redis}


def build_state(
    spec: StateSpec, workers: int = 1
) -> tuple[State, SlotLedger | None, HolderRecord | None]:
    """The policy's `state` section: quota windows in memory and neither slot ledger nor holder
    record (this gateway's own counts are every slot, its own record every holder), or all
    three in the shared backend with its failure policy. Each of a pod's `workers` processes is
    one more gateway sharing it: failing open, each keeps 1/(`gateways` x `workers`)."""
    if spec.backend == "memory":
        return MemoryState(), None, None
    failover = FailoverState(
        BACKENDS[spec.backend](spec),
        on_failure=spec.on_failure,
        gateways=spec.gateways * workers,
    )
    return failover, failover, failover
