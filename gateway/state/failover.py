"""`FailoverState`: a shared `Backend` behind the policy's `on_failure`, one object serving as the
`State`, the `SlotLedger` and the `HolderRecord` of a gateway that shares them.

Kept apart from the backends (redis.py) because it is policy, not storage, and the same for every
backend: when the backend is tried again, what failing open falls back to (a `MemoryState` at
1/`gateways` of each limit; the pool's share of each cap) and failing closed raises
(`StateUnreachable`, which the stages calling the state turn into the client's 503). Which
exceptions mean "unreachable" is the backend's to say (`Backend.failures`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal, TypeVar

from gateway.state.base import (
    Backend,
    Correction,
    Holder,
    Limit,
    Mode,
    PoolReplica,
    Reservation,
    SlotClaim,
    StateUnreachable,
    Window,
    WindowFull,
)
from gateway.state.memory import MemoryState
from gateway.state.slices import lost

log = logging.getLogger("gateway.state")  # one logger for state/, the name operators grep
_LOCAL = "local:"
RETRY_S = 1.0  # after a failure, the backend is tried again by the first call this long after it
T = TypeVar("T")


class _Down:
    """What `FailoverState._shared` gives for a call the backend did not answer."""


DOWN = _Down()


class FailoverState:
    """A shared `Backend` with a policy for when it fails.

    `open`: fall back to a `MemoryState` whose limits are 1/`gateways` of the global ones, so
    the gateways together stay near the global limit while each counts alone. `closed`: raise
    `StateUnreachable` (the client's 503) rather than admit uncounted. After a failure the
    backend is tried again once `retry_s` has passed (by the next call, no background task), so
    requests do not each wait out a time-out on a dead backend, and shared limits resume without
    a restart. Charges made locally carry a `local:` id and are corrected locally.
    """

    MAX_LOST = 100_000  # per replica: past it, leases left behind expire with their TTL

    def __init__(
        self,
        shared: Backend,
        *,
        on_failure: Literal["open", "closed"],
        gateways: int,
        retry_s: float = RETRY_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shared = shared
        self.local = MemoryState()
        self.on_failure = on_failure
        self.gateways = gateways
        self.retry_s = retry_s
        self.monotonic = monotonic
        self.up = True
        self._retry_at = 0.0
        self._lost: dict[PoolReplica, dict[str, str]] = {}  # replica -> lease id -> class

    def mode(self) -> Mode:
        if self.up:
            return "shared"
        return "local" if self.on_failure == "open" else "refusing"

    def _usable(self) -> bool:
        return self.up or self.monotonic() >= self._retry_at

    def _failed(self, exc: BaseException) -> None:
        self._retry_at = self.monotonic() + self.retry_s
        if self.up:
            self.up = False
            mode = f"local limits at 1/{self.gateways}" if self.on_failure == "open" else "503"
            log.error("shared state failed: %r; now serving with %s", exc, mode)

    def _recovered(self) -> None:
        if not self.up:
            self.up = True
            log.warning("shared state is back; shared limits apply again")

    def _refuse(self) -> StateUnreachable:
        return StateUnreachable(
            "the gateway's shared quota state is unreachable; try again shortly",
            retry_after_s=self.retry_s,
        )

    def _scaled(self, limits: Sequence[Limit]) -> list[Limit]:
        return [
            Limit(lim.key, lim.amount, max(1, math.floor(lim.limit / self.gateways)))
            for lim in limits
        ]

    async def _shared(self, call: Coroutine[Any, Any, T]) -> T | _Down:
        """`call` on the backend, unless it is known down (then it is not even sent); a failure
        switches to the failure policy, and any answer (a renewal's too) ends it, so shared
        state resumes even while no request asks."""
        if not self._usable():
            call.close()
            return DOWN
        try:
            result = await call
        except self.shared.failures as exc:
            self._failed(exc)
            return DOWN
        self._recovered()
        return result

    async def reserve(self, limits: Sequence[Limit]) -> Reservation | WindowFull:
        result = await self._shared(self.shared.reserve(limits))
        if not isinstance(result, _Down):
            return result
        if self.on_failure == "closed":
            raise self._refuse()
        result = await self.local.reserve(self._scaled(limits))
        if isinstance(result, Reservation):
            return Reservation(id=_LOCAL + result.id, windows=result.windows)
        return result

    async def peek(self, limits: Sequence[Limit]) -> tuple[Window, ...]:
        windows = await self._shared(self.shared.peek(limits))
        if not isinstance(windows, _Down):
            return windows
        if self.on_failure == "closed":
            raise self._refuse()
        return await self.local.peek(self._scaled(limits))

    async def adjust(self, corrections: Sequence[Correction]) -> None:
        """Each correction where its charge was made: `local:` ones here, the rest shared."""
        local = [
            Correction(fix.key, fix.charge_id[len(_LOCAL) :], fix.reserved, fix.actual)
            for fix in corrections
            if fix.charge_id.startswith(_LOCAL)
        ]
        if local:
            await self.local.adjust(local)
        shared = [fix for fix in corrections if not fix.charge_id.startswith(_LOCAL)]
        if not shared:
            return
        try:
            await self.shared.adjust(shared)
        # called once: a lost correction is logged, never retried
        except self.shared.failures as exc:
            self._failed(exc)
            lost(shared, exc)

    # --- replica slots: failing open counts locally (the caller keeps 1/gateways of a cap) ---

    def lease_id(self) -> str:
        return self.shared.lease_id()

    async def lease(self, claim: SlotClaim, lease_id: str) -> tuple[bool, int] | None:
        result = await self._shared(self.shared.lease(claim, lease_id))
        if not isinstance(result, _Down):
            return result
        if self.on_failure == "closed":
            raise self._refuse()
        return None

    def _lose(self, replica: PoolReplica, workload: str, lease_id: str) -> None:
        """A release the backend did not get (or a lease a failed call may have written): the next
        renewal of the replica drops it, rather than it outliving its request by a TTL."""
        lost = self._lost.setdefault(replica, {})
        if len(lost) < self.MAX_LOST:
            lost[lease_id] = workload

    async def renew(
        self,
        replica: PoolReplica,
        held: Sequence[tuple[str, str]],
        released: Sequence[tuple[str, str]] = (),
    ) -> int | None:
        lost = self._lost.pop(replica, {})
        gone = [*released, *((workload, lease) for lease, workload in lost.items())]
        total = await self._shared(self.shared.renew(replica, held, gone))
        if isinstance(total, _Down):
            for workload, lease in gone:
                self._lose(replica, workload, lease)
            return None
        return total

    async def unlease(self, replica: PoolReplica, leases: Sequence[tuple[str, str]]) -> None:
        if isinstance(await self._shared(self.shared.unlease(replica, leases)), _Down):
            for workload, lease_id in leases:
                self._lose(replica, workload, lease_id)

    async def share_waiting(self, pool: str, waiting: Sequence[int]) -> tuple[int, ...] | None:
        everyone = await self._shared(self.shared.share_waiting(pool, waiting))
        return None if isinstance(everyone, _Down) else everyone

    # --- stored responses' holders: unreachable is unknown, never refused (the gateway still
    # has its own record), so the failure policy does not apply ---

    async def record(self, response_id: str, holder: Holder) -> None:
        await self._shared(self.shared.record(response_id, holder))

    async def holder(self, response_id: str) -> Holder | None:
        found = await self._shared(self.shared.holder(response_id))
        return None if isinstance(found, _Down) else found

    async def forget(self, response_id: str) -> None:
        await self._shared(self.shared.forget(response_id))

    async def close(self) -> None:
        await self.shared.close()
