"""`SlicedState`: a shared store's quota windows leased to this gateway in slices, so most
reservations and every correction cost no call of their own.

A request's reservation takes its amount from this gateway's live slice of each window it
charges, synchronously. Only when some window's slice lacks room does one call (`grant`) ask
the store for new slices of those windows: per window the most in `[need, need + extra]` that
fits (`extra` = ceil(limit x `fraction`)), so near the limit a slice is just the request's own
charge, exactly what a reservation without slices takes, and nothing that fits is refused for
want of room this gateway held: the slice it replaces is cut back to what it handed out in the
same script, before the new one is counted. A refusal is the store's `WindowFull`.

Why no window ever holds more than its limit: a slice hands out for at most `max_age_s` after
its grant (measured from before the call was sent, so never later than the store's own
grant time plus `max_age_s`), and its charge is stamped `grant + max_age_s` (its latest
possible use), so the store counts it from the grant until `max_age_s + WINDOW_S` after.
Take any interval `[a, a + WINDOW_S)` and the requests admitted in it; let the latest-granted
slice any of them used be granted at `g`: `g <= ` its request's time `< a + WINDOW_S`. Every
other slice used there was granted at `g' <= g` and handed out at some `t >= a`, so its stamp
`g' + max_age_s >= t >= a > g - WINDOW_S`: at `g` the store still counted it (base.py: a charge
stamped `s` counts until `s + WINDOW_S`), at no less than its requests hold (a slice is cut
back only once it stops handing out, and only to what it handed). So the grant at `g` fit all
of them, and every request admitted in the interval, under the limit. Corrections change a slice's charge as they change a
request's: while it hands out, a refund is room this gateway reuses and an excess raises the
charge; after, the charge is rewritten to what its requests really used; once it has left
the window an excess is charged anew and a refund is nothing (`State.adjust`).

What slices cost: each gateway holds back from the others up to one slice (`extra`) of each
window it charges, for at most `max_age_s`; the headers' `remaining` is the store's at the
grant plus the slice's free part, so another gateway's use since is not in it.

Corrections are not sent one by one: `adjust` records them (no await) and a flusher task,
every `flush_s`, sends every slice whose charge must change, and the excesses of slices gone,
in one call (`Backend.adjust`: one script per tenant, in one pipeline). A flush the store does
not take is sent again by the next for every slice (a slice's charge is written outright);
an excess of a slice gone, a new charge each time it is sent, is logged as a lost correction,
as `FailoverState` logs its own, and not retried.
Slot and holder calls pass through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.state.base import (
    WINDOW_S,
    Backend,
    Correction,
    Holder,
    Limit,
    PoolReplica,
    Reservation,
    SliceAsk,
    SliceGrant,
    SlotClaim,
    TenantWindow,
    Window,
    WindowFull,
)

log = logging.getLogger("gateway.state")
_SEP = " "  # between a reservation's slice ids (the store's ids have none)
# Grants a reservation makes before it counts the store as failing: a slice that stopped while a
# grant ran sends the request's windows to one grant together, which stops none unless the
# call itself outlives a slice.
_ATTEMPTS = 3


class Sliceable(Backend, Protocol):
    """A store that grants slices (redis.py's `RedisState`)."""

    def slice_id(self) -> str:
        """A new charge id, unique across gateways."""
        ...

    async def grant(
        self, asks: Sequence[SliceAsk], slice_id: str, max_age_s: float
    ) -> SliceGrant | WindowFull:
        """Each asked slice, all or none, charged under `slice_id` stamped `max_age_s` ahead;
        raises one of `failures` when unreachable."""
        ...


@dataclass(slots=True, eq=False)
class _Slice:
    """One window's slice: `charged` is what the store holds under `id` (as last written),
    `handed` what this gateway's requests hold of it now."""

    id: str
    key: TenantWindow
    charged: int
    handed: int
    until: float  # local monotonic time it stops handing out
    forget_at: float  # its charge has left every window: a correction after is a new charge
    limit: int
    remaining: int  # the store's, right after the grant
    reset_at: float
    live: bool = True

    def free(self) -> int:
        return self.charged - self.handed if self.live else 0

    def target(self) -> int:
        """What the store should hold: all of it while it hands out (more, after an excess);
        what its requests use once it stopped."""
        return max(self.charged, self.handed) if self.live else self.handed

    def window(self, now: float) -> Window:
        return Window(self.limit, max(0, self.remaining + self.free()), self.reset_at - now)


def _granted(held: _Slice) -> float:
    """When a slice was granted, as its stop time tells: every slice hands out as long."""
    return held.until


def lost(corrections: Sequence[Correction], exc: BaseException) -> None:
    """The warning for corrections a store did not take, a flush's or `FailoverState`'s own
    (neither is retried: an excess sent twice would be charged twice)."""
    what = ", ".join(
        f"{fix.charge_id} in {fix.key.tenant}'s {fix.key.window}" for fix in corrections
    )
    log.warning("correction of charges %s lost: %r", what, exc)


class SlicedState:
    """A `Sliceable` store's windows leased in slices; see the module docstring."""

    def __init__(
        self,
        shared: Sliceable,
        *,
        fraction: float,
        max_age_s: float,
        flush_s: float = 0.05,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shared = shared
        self.failures = shared.failures
        self.fraction = fraction
        self.max_age_s = max_age_s
        self.flush_s = flush_s
        self.monotonic = monotonic
        self._live: dict[TenantWindow, _Slice] = {}
        self._known: dict[tuple[str, TenantWindow], _Slice] = {}  # until it left every window
        self._forget: deque[_Slice] = deque()  # in grant order, so in `forget_at` order
        self._dirty: set[_Slice] = set()  # slices whose charge must change
        self._gone: list[Correction] = []  # excesses of slices forgotten
        # Slices of grant calls that failed, which the store may have made all the same: each
        # set to nothing (a store that never made one takes that as nothing).
        self._unsure: list[Correction] = []
        # grants under way, each done with the failure it met (None: an answer)
        self._granting: dict[TenantWindow, asyncio.Future[BaseException | None]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._flushing: asyncio.Future[None] | None = None  # the flusher's flush under way
        self._closed = False

    # --- the quota windows ---------------------------------------------------------------

    def _current(self, key: TenantWindow, now: float) -> _Slice | None:
        held = self._live.get(key)
        if held is not None and held.until <= now:
            self._retire(held)
            return None
        return held

    def _retire(self, held: _Slice) -> None:
        held.live = False
        if self._live.get(held.key) is held:
            del self._live[held.key]
        self._touched(held)

    def _touched(self, held: _Slice) -> None:
        if held.target() != held.charged:
            self._dirty.add(held)

    def _start(self) -> None:
        """The flusher, from the first call that may leave it work (a running loop is needed)."""
        if self._flusher is None and not self._closed:
            self._flusher = asyncio.create_task(self._flush_every())

    async def reserve(self, limits: Sequence[Limit]) -> Reservation | WindowFull:
        self._start()
        need: dict[TenantWindow, tuple[int, int]] = {}  # key -> (amount, limit)
        for lim in limits:
            amount = need.get(lim.key, (0, 0))[0]
            need[lim.key] = (amount + lim.amount, lim.limit)
        for attempt in range(_ATTEMPTS):
            held, short = await self._take(need, everything=attempt > 0)
            if not short:
                break
            asks = [self._ask(key, *need[key], self.monotonic()) for key in short]
            refused = await self._grant(asks, need, held)
            if refused is not None:
                self._give_back(held, need)
                return self._refusal(refused, limits, asks, self.monotonic())
            # A slice taken before the grant may have stopped while it ran: a request admitted
            # after its stamp would be outside what Redis counts for it. All back, and all of
            # the request's windows in one grant, whose slices start together.
            now = self.monotonic()
            if all(current.until > now for current in held.values()):
                break
            self._give_back(held, need)
        else:
            raise TimeoutError(
                f"quota slice grants took longer than a slice's life ({self.max_age_s:g} s)"
                f" {_ATTEMPTS} times in a row"
            )
        ids = _SEP.join(dict.fromkeys(held[lim.key].id for lim in limits))
        now = self.monotonic()
        return Reservation(ids, tuple(held[lim.key].window(now) for lim in limits))

    async def _take(
        self, need: dict[TenantWindow, tuple[int, int]], everything: bool
    ) -> tuple[dict[TenantWindow, _Slice], list[TenantWindow]]:
        """Each window's amount taken from its live slice where it has room; the windows whose
        slice has none (`everything`: every window), to grant. A burst that finds a window's slice short waits for the one
        grant already asked rather than each asking its own: concurrent grants would each hold
        a slice back. A grant the store failed fails its waiters too, at once, rather than each
        waiting out a time-out of its own in turn."""
        while True:
            now = self.monotonic()
            held: dict[TenantWindow, _Slice] = {}
            short: list[TenantWindow] = []
            for key, (amount, _) in need.items():
                current = None if everything else self._current(key, now)
                if current is not None and current.free() >= amount:
                    held[key] = current
                else:
                    short.append(key)
            asked = [self._granting[key] for key in short if key in self._granting]
            if not asked:
                break
            await asyncio.wait(asked)
            for failed in (grant.result() for grant in asked):
                if failed is not None:
                    raise failed
        for key, current in held.items():
            current.handed += need[key][0]
        return held, short

    def _ask(self, key: TenantWindow, amount: int, limit: int, now: float) -> SliceAsk:
        """A new slice of `key`'s window; the current one stops handing out, to be cut back to
        what it handed by the grant's own script."""
        current = self._current(key, now)
        old = None
        if current is not None:
            self._retire(current)
            old = (current.id, current.handed)
        return SliceAsk(key, amount, math.ceil(limit * self.fraction), limit, old)

    async def _grant(
        self,
        asks: Sequence[SliceAsk],
        need: dict[TenantWindow, tuple[int, int]],
        held: dict[TenantWindow, _Slice],
    ) -> WindowFull | None:
        """One grant call for `asks`, the slices granted made live and added to `held`; the
        store's refusal, if it refused. Other requests for these windows wait for it."""
        granting: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        for ask in asks:
            self._granting[ask.key] = granting
        sent = self.monotonic()
        failed: BaseException | None = None
        slice_id = self.shared.slice_id()
        try:
            result = await self.shared.grant(asks, slice_id, self.max_age_s)
        except BaseException as exc:
            self._give_back(held, need)
            failed = exc if isinstance(exc, self.failures) else None
            self._unsure.extend(Correction(ask.key, slice_id, 0, 0) for ask in asks)
            raise
        finally:
            for ask in asks:
                if self._granting.get(ask.key) is granting:
                    del self._granting[ask.key]
            granting.set_result(failed)
        self._cut_back(asks)
        if isinstance(result, WindowFull):
            return result
        self._install(result, asks, need, sent, held)
        return None

    def _give_back(
        self, held: dict[TenantWindow, _Slice], need: dict[TenantWindow, tuple[int, int]]
    ) -> None:
        for key, current in held.items():
            current.handed -= need[key][0]
            self._touched(current)

    def _cut_back(self, asks: Sequence[SliceAsk]) -> None:
        """The slices a grant replaced, cut back by its script to what they had handed out."""
        for ask in asks:
            if ask.old is not None and (old := self._known.get((ask.old[0], ask.key))):
                old.charged = ask.old[1]
                self._touched(old)

    def _install(
        self,
        grant: SliceGrant,
        asks: Sequence[SliceAsk],
        need: dict[TenantWindow, tuple[int, int]],
        sent: float,
        held: dict[TenantWindow, _Slice],
    ) -> None:
        """The granted slices made live, their life counted from `sent`, before the call. None
        is live for these windows: `_ask` retired each, and other requests waited for this."""
        now = self.monotonic()
        for ask, amount, window in zip(asks, grant.amounts, grant.windows, strict=True):
            fresh = _Slice(
                id=grant.id,
                key=ask.key,
                charged=amount,
                handed=need[ask.key][0],
                until=sent + self.max_age_s,
                forget_at=sent + self.max_age_s + WINDOW_S + 1.0,
                limit=window.limit,
                remaining=window.remaining,
                reset_at=now + window.reset_s,
            )
            self._live[ask.key] = fresh
            self._known[fresh.id, ask.key] = fresh
            self._forget.append(fresh)
            held[ask.key] = fresh

    def _refusal(
        self, full: WindowFull, limits: Sequence[Limit], asks: Sequence[SliceAsk], now: float
    ) -> WindowFull:
        """The store's refusal, its index and windows made the caller's (one per limit)."""
        asked = {ask.key: window for ask, window in zip(asks, full.windows, strict=True)}
        refused = asks[full.index].key
        windows = []
        for lim in limits:
            window = asked.get(lim.key)
            if window is None:
                current = self._live.get(lim.key)
                window = current.window(now) if current is not None else Window(lim.limit, 0, 0.0)
            windows.append(window)
        index = next(i for i, lim in enumerate(limits) if lim.key == refused)
        return WindowFull(index, full.retry_after_s, tuple(windows))

    async def peek(self, limits: Sequence[Limit]) -> tuple[Window, ...]:
        """The store's windows, plus the free part of this gateway's live slices."""
        windows = await self.shared.peek(limits)
        now = self.monotonic()
        out = []
        for lim, window in zip(limits, windows, strict=True):
            current = self._current(lim.key, now)
            free = current.free() if current is not None else 0
            out.append(Window(window.limit, window.remaining + free, window.reset_s))
        return tuple(out)

    async def adjust(self, corrections: Sequence[Correction]) -> None:
        """Recorded against each charge's slice, sent by the next flush; never awaits."""
        self._start()
        for fix in corrections:
            held = self._slice_of(fix)
            if held is not None:
                held.handed += fix.actual - fix.reserved
                self._touched(held)
            elif fix.actual > fix.reserved:  # its slice has left the window: the excess is new
                self._gone.append(
                    Correction(fix.key, self._fresh_id(), 0, fix.actual - fix.reserved)
                )

    def _fresh_id(self) -> str:
        return f"{self.shared.slice_id()}x"

    def _slice_of(self, fix: Correction) -> _Slice | None:
        """The slice of `fix.key` its request took: of the slices its reservation names, the
        newest holding that window. An older one may hold it too (a grant of several windows
        whose slice of this one ran short before the others), and served the request another."""
        named = (self._known.get((slice_id, fix.key)) for slice_id in fix.charge_id.split(_SEP))
        return max((held for held in named if held is not None), key=_granted, default=None)

    async def flush(self) -> None:
        """Stop the slices past their age, forget those whose charge left every window, and
        send every pending correction in one call."""
        now = self.monotonic()
        for held in [h for h in self._live.values() if h.until <= now]:
            self._retire(held)
        while self._forget and self._forget[0].forget_at <= now:
            gone = self._forget.popleft()
            self._known.pop((gone.id, gone.key), None)
        excesses, self._gone = self._gone, []
        unsure, self._unsure = self._unsure, []
        moved: list[tuple[_Slice, int]] = []  # each slice corrected, and what the store held
        for held in self._dirty:
            target = held.target()
            if target != held.charged:
                moved.append((held, held.charged))
                held.charged = target
        self._dirty.clear()
        fixes = [
            *excesses,
            *unsure,
            *(Correction(h.key, h.id, before, h.charged) for h, before in moved),
        ]
        if not fixes:
            return
        try:
            await self.shared.adjust(fixes)
        except self.failures as exc:
            # A slice's charge is rewritten outright: the next flush sends it again, from what
            # the store last took. The excess of a slice gone is a new charge, which sent
            # twice (the failed call may have made it) would count twice: lost.
            # A grant the store may have made stays charged till its window passes: the
            # tenant's room, never another's.
            for held, before in moved:
                held.charged = before
                self._touched(held)
            if excesses:
                lost(excesses, exc)

    async def _flush_every(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            # Shielded: a flush under way has taken its corrections off the books, so `close`
            # cancelling the flusher lets it finish rather than lose them.
            self._flushing = asyncio.ensure_future(self.flush())
            try:
                await asyncio.shield(self._flushing)
            except Exception:
                log.exception("flushing quota slices failed")

    async def close(self) -> None:
        """Stop the flusher (a flush under way ends first), give back every live slice's
        unused part, then close the store."""
        self._closed = True
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        if self._flushing is not None and not self._flushing.done():
            try:
                await self._flushing
            except Exception:
                log.exception("flushing quota slices failed")
        for held in list(self._live.values()):
            self._retire(held)
        await self.flush()
        await self.shared.close()

    # --- slots and holders pass through ----------------------------------------------------

    def lease_id(self) -> str:
        return self.shared.lease_id()

    async def lease(self, claim: SlotClaim, lease_id: str) -> tuple[bool, int] | None:
        return await self.shared.lease(claim, lease_id)

    async def renew(
        self,
        replica: PoolReplica,
        held: Sequence[tuple[str, str]],
        released: Sequence[tuple[str, str]] = (),
    ) -> int | None:
        return await self.shared.renew(replica, held, released)

    async def unlease(self, replica: PoolReplica, leases: Sequence[tuple[str, str]]) -> None:
        await self.shared.unlease(replica, leases)

    async def share_waiting(self, pool: str, waiting: Sequence[int]) -> tuple[int, ...] | None:
        return await self.shared.share_waiting(pool, waiting)

    async def record(self, response_id: str, holder: Holder) -> None:
        await self.shared.record(response_id, holder)

    async def holder(self, response_id: str) -> Holder | None:
        return await self.shared.holder(response_id)

    async def forget(self, response_id: str) -> None:
        await self.shared.forget(response_id)
