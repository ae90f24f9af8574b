"""Shared admission state behind one protocol: in memory for one gateway, Redis for several."""

from gateway.state.base import (
    WINDOW_S,
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
