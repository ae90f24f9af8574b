"""Shared admission state behind three protocols (base.py): `State`, the quota windows, in memory
for one gateway or in a shared backend (Redis) for several; `SlotLedger`, the replicas' slots, and
`HolderRecord`, which replica stores each response, only for several.

Modules: base.py (the protocols, their values and `Backend`, what a shared store implements),
memory.py (`MemoryState`), redis.py (the Redis backend: its Lua, its keys, its failures),
slices.py (`SlicedState`: a backend's quota windows leased in slices, corrections batched),
failover.py (`FailoverState`: any backend behind `on_failure`), build.py (`build_state`: the
policy's `state` section made into them, the backends by name). Code outside this package imports
the protocols only (here, base.py) and build.py: which backend runs is never its business.
"""

from gateway.state.base import (
    WINDOW_S,
    Correction,
    Holder,
    HolderRecord,
    Limit,
    Mode,
    PoolReplica,
    Reservation,
    SlotClaim,
    SlotLedger,
    State,
    StateUnreachable,
    TenantWindow,
    Window,
    WindowFull,
)
from gateway.state.memory import MemoryState

__all__ = [
    "WINDOW_S",
    "Correction",
    "Holder",
    "HolderRecord",
    "Limit",
    "MemoryState",
    "Mode",
    "PoolReplica",
    "Reservation",
    "SlotClaim",
    "SlotLedger",
    "State",
    "StateUnreachable",
    "TenantWindow",
    "Window",
    "WindowFull",
]
