"""Preemption (`slo.preempt`, off by default): the requests in flight on each replica, so a
critical request that would miss its objective may cancel the newest sheddable one there.

The newest is the victim because it has run the least: cancelling it loses the least work,
and a sheddable request that just started has delivered its client the least. Cancelling ends
its exchange (`gateway.upstream.Cancel`), not its task: the forward stage then tells its client
(`preempted`) and its slot is released as any request's, which is the room the critical one
waits for. A token bucket per pool paces it, so a burst of critical requests cannot turn a
pool's sheddable traffic into work thrown away.

The registry exists only on a pool with preemption enabled; elsewhere a slot costs nothing more.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.config.schema import PRIORITIES, PreemptSpec
from gateway.upstream import Cancel

CRITICAL = PRIORITIES.index("critical")
SHEDDABLE = PRIORITIES.index("sheddable")


class InFlight:
    """A request holding a slot on a replica: when it was granted, its tier, its cancel handle."""

    __slots__ = ("cancel", "granted", "priority", "replica")

    def __init__(self, replica: str, granted: float, priority: int) -> None:
        self.replica = replica
        self.granted = granted  # time.perf_counter()
        self.priority = priority
        self.cancel = Cancel()


class Pace:
    """A token bucket: `burst` at once, refilled at `rate` a second of `clock`."""

    __slots__ = ("burst", "clock", "rate", "tokens", "updated")

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.clock: Callable[[], float] = time.monotonic
        self.tokens = float(burst)
        self.updated = self.clock()

    def retune(self, rate: float, burst: int) -> None:
        self._refill()
        self.rate, self.burst = rate, burst
        self.tokens = min(self.tokens, burst)

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def ready(self) -> bool:
        self._refill()
        return self.tokens >= 1.0

    def spend(self) -> None:
        self.tokens -= 1.0


class Preemption:
    """One pool's registry of the requests in flight per replica, and its pace."""

    def __init__(self, spec: PreemptSpec) -> None:
        self.pace = Pace(spec.max_per_s, spec.burst)
        # replica URL -> its requests in flight, in the order they were granted (newest last)
        self._running: dict[str, dict[InFlight, None]] = {}

    def retune(self, spec: PreemptSpec) -> None:
        self.pace.retune(spec.max_per_s, spec.burst)

    def enter(self, replica: str, granted: float, priority: int) -> InFlight:
        """A slot was granted on `replica`: the request is in flight there until `leave`."""
        inflight = InFlight(replica, granted, priority)
        running = self._running.get(replica)
        if running is None:
            running = self._running[replica] = {}
        running[inflight] = None
        return inflight

    def leave(self, inflight: InFlight) -> None:
        running = self._running[inflight.replica]
        del running[inflight]
        if not running:  # a replica that left the pool leaves nothing behind
            del self._running[inflight.replica]

    def running(self, replica: str) -> int:
        return len(self._running.get(replica, ()))

    def victim(self, replica: str) -> InFlight | None:
        """The newest sheddable request in flight on `replica` that a cancel would still end,
        or None: never a standard or critical one."""
        for inflight in reversed(self._running.get(replica, {})):
            if inflight.priority == SHEDDABLE and not inflight.cancel.over:
                return inflight
        return None

    def preempt(self, replica: str) -> InFlight | None:
        """Cancel `victim(replica)`, within the pace; the one cancelled, or None."""
        if not self.pace.ready():
            return None
        inflight = self.victim(replica)
        if inflight is None or not inflight.cancel.cancel():
            return None
        self.pace.spend()
        return inflight
