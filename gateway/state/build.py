"""`build_state`: the policy's `state` section made into the objects the runtime holds.

The one place that chooses a backend, so the runtime (and tests that build a gateway) never name
one: a new backend is a new branch here.
"""

from __future__ import annotations

from gateway.config.schema import StateSpec
from gateway.state.base import HolderRecord, SlotLedger, State
from gateway.state.failover import FailoverState
from gateway.state.memory import MemoryState
from gateway.state.redis import RedisState


def build_state(spec: StateSpec) -> tuple[State, SlotLedger | None, HolderRecord | None]:
    """The policy's `state` section: quota windows in memory and neither slot ledger nor holder
    record (this gateway's own counts are every slot, its own record every holder), or all
    three in Redis with its failure policy."""
    if spec.backend == "memory":
        return MemoryState(), None, None
    shared = RedisState(
        spec.url,
        timeout_s=spec.timeout_s,
        lease_ttl_s=spec.lease_ttl_s,
        holder_ttl_s=spec.stored_response_ttl_s,
    )
    failover = FailoverState(shared, on_failure=spec.on_failure, gateways=spec.gateways)
    return failover, failover, failover
