"""Shared admission state behind three protocols (base.py): `State`, the quota windows, in memory
for one gateway or in Redis for several; `SlotLedger`, the replicas' slots, and `HolderRecord`,
which replica stores each response, only for several.

Modules: base.py (the protocols and their values), memory.py (`MemoryState`), redis.py (the Redis
backends and their Lua), failover.py (`FailoverState`: Redis behind `on_failure`), build.py
(`build_state`: the policy's `state` section made into them).
"""

from gateway.state.base import (
    WINDOW_S,
    Correction,
    Holder,
    HolderRecord,
    Limit,
    Reservation,
    SlotClaim,
    SlotLedger,
    State,
    StateUnreachable,
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
    "Reservation",
    "SlotClaim",
    "SlotLedger",
    "State",
    "StateUnreachable",
    "Window",
    "WindowFull",
]
