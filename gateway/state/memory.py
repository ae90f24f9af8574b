"""The single-gateway `State`: sliding-window logs in this process, atomic because nothing awaits.

Each window is a deque of charges in time order, with its running total, so a call costs the
charges that expired since the last one (amortised O(1)) plus, only when refusing, a walk to
find when enough will have left. The clock is injectable so tests can move time instead of
sleeping through a minute; it must never go backwards (`time.monotonic`, the default).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence

from gateway.state.base import (
    WINDOW_S,
    Correction,
    Limit,
    Mode,
    Reservation,
    TenantWindow,
    Window,
    WindowFull,
)


class _Charge:
    __slots__ = ("amount", "at", "id")

    def __init__(self, charge_id: str, at: float, amount: int) -> None:
        self.id = charge_id
        self.at = at
        self.amount = amount


class _Log:
    __slots__ = ("by_id", "charges", "used")

    def __init__(self) -> None:
        self.charges: deque[_Charge] = deque()
        self.by_id: dict[str, _Charge] = {}
        self.used = 0

    def expire(self, now: float) -> None:
        horizon = now - WINDOW_S
        charges = self.charges
        while charges and charges[0].at <= horizon:
            gone = charges.popleft()
            self.used -= gone.amount
            del self.by_id[gone.id]

    def add(self, charge: _Charge) -> None:
        self.charges.append(charge)
        self.by_id[charge.id] = charge
        self.used += charge.amount

    def full(self, amount: int, limit: int) -> bool:
        return self.used + amount > limit

    def wait(self, amount: int, limit: int, now: float) -> float | None:
        """Seconds until `amount` fits in this full window; None: never, being over `limit`."""
        if amount > limit:
            return None
        excess = self.used + amount - limit
        for charge in self.charges:  # oldest first: the order in which they leave
            excess -= charge.amount
            if excess <= 0:
                return max(0.0, charge.at + WINDOW_S - now)
        raise AssertionError("the log holds less than `used`")  # amount <= limit: unreachable

    def window(self, limit: int, now: float) -> Window:
        reset = self.charges[-1].at + WINDOW_S - now if self.charges else 0.0
        return Window(limit=limit, remaining=max(0, limit - self.used), reset_s=reset)


class MemoryState:
    """Windows keyed as the caller names them; one log per key ever charged (keys are bounded:
    tenants of the policy times limit kinds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._logs: dict[TenantWindow, _Log] = {}
        self._ids = itertools.count(1)

    def mode(self) -> Mode:
        return "memory"

    def _log(self, key: TenantWindow, now: float) -> _Log:
        log = self._logs.get(key)
        if log is None:
            log = self._logs[key] = _Log()
        log.expire(now)
        return log

    async def reserve(self, limits: Sequence[Limit]) -> Reservation | WindowFull:
        now = self.clock()
        pairs = [(self._log(limit.key, now), limit) for limit in limits]
        refused = [i for i, (log, lim) in enumerate(pairs) if log.full(lim.amount, lim.limit)]
        if refused:
            waits = [pairs[i][0].wait(pairs[i][1].amount, pairs[i][1].limit, now) for i in refused]
            retry = None if None in waits else max(w for w in waits if w is not None)
            windows = tuple(log.window(lim.limit, now) for log, lim in pairs)
            return WindowFull(index=refused[0], retry_after_s=retry, windows=windows)
        charge_id = str(next(self._ids))
        for log, limit in pairs:
            log.add(_Charge(charge_id, now, limit.amount))
        windows = tuple(log.window(lim.limit, now) for log, lim in pairs)
        return Reservation(id=charge_id, windows=windows)

    async def peek(self, limits: Sequence[Limit]) -> tuple[Window, ...]:
        now = self.clock()
        return tuple(self._log(limit.key, now).window(limit.limit, now) for limit in limits)

    async def adjust(self, corrections: Sequence[Correction]) -> None:
        now = self.clock()
        for fix in corrections:
            log = self._log(fix.key, now)
            charge = log.by_id.get(fix.charge_id)
            if charge is not None:
                log.used += fix.actual - charge.amount
                charge.amount = fix.actual
            elif fix.actual > fix.reserved:
                log.add(_Charge(f"{fix.charge_id}+", now, fix.actual - fix.reserved))

    async def close(self) -> None:
        return None
