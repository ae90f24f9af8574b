"""The pool's side of a shared `SlotLedger` (several gateways sharing the replicas through Redis).

Every slot is also a lease there: taking one awaits the ledger, a release gives the lease back
in the background, and `share` renews the leases held here and trades queue depths. When the
ledger fails open the pool runs degraded: each replica's cap is this gateway's share of it.

A freed lease may stay a while as a spare (`spare_s`): still a lease in the ledger, renewed with
the others, that the next request of its class on that replica takes without a call. The caps
hold across gateways as before, since every slot in use is still a lease there; a spare only
holds room. So it never holds room another gateway waits for: spares are kept only while no
other gateway has waiters (as last shared) and the ledger answers, and go back at once when
that changes. Idle ones go back in one call per replica, by a sweep that runs while any is kept.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from gateway.admit.claim import Claim
from gateway.admit.replica import Grant, Replica
from gateway.config.schema import PRIORITIES
from gateway.errors import StateUnavailable
from gateway.state.base import PoolReplica, SlotClaim, SlotLedger, StateUnreachable

# With a ledger, waiters look for a free slot this often (jittered). A release here does not
# wake them: the gateway that frees a slot must not win it back every time, or a gateway that
# held no slot when the overload began would wait while the others keep theirs. Polling at one
# rate gives every gateway with waiters the same chance at each freed slot.
POLL_S = 0.02

Pick = Callable[[Sequence[Replica], Claim], Replica | None]


class Leases:
    """This gateway's leases in the ledger, and what it last learnt of the other gateways.

    `freed` is called when a lease is back in the ledger (waiters here may take it at their
    next poll); `degraded_changed` when the ledger stops or starts answering.
    """

    def __init__(
        self,
        pool: str,
        ledger: SlotLedger,
        freed: Callable[[], None],
        degraded_changed: Callable[[], None],
        spare_s: float = 0.0,
    ) -> None:
        self.pool = pool
        self.ledger = ledger
        self._freed = freed
        self._degraded_changed = degraded_changed
        self.degraded = False  # the ledger fails open: each replica's cap is this gateway's share
        self.others_by_tier = [0] * len(PRIORITIES)  # other gateways' waiters, as last shared
        self.departed: list[Replica] = []  # left the pool with leases held: renewed till released
        self._background: set[asyncio.Task[Any]] = set()
        self.spare_s = spare_s  # longest a spare stays idle; 0: none kept
        self._sparing: set[Replica] = set()  # replicas with spares here
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def others_waiting(self) -> int:
        return sum(self.others_by_tier)

    def outranked(self, priority: int) -> bool:
        """Another gateway has waiters of a higher tier (as last shared, while the ledger
        answers): a slot freed in the ledger is theirs, so tiers hold across gateways too."""
        return not self.degraded and any(self.others_by_tier[:priority])

    async def take(
        self,
        pick: Pick,
        ask: Callable[[Replica, Claim], SlotClaim],
        claim: Claim,
        replicas: Sequence[Replica],
    ) -> Grant | None:
        """Pick as alone, then ask the ledger; a replica it refuses (full across gateways) is
        left alone for `POLL_S` and the next is tried. The local count is taken first, so
        concurrent requests of this gateway never overbook while the ledger answers. `ask`
        says what a lease on a replica is, as the pool's policy stands at that moment."""
        ledger = self.ledger
        while True:
            replica = pick(replicas, claim)
            if replica is None:
                return None
            replica.take(claim)
            asked = ask(replica, claim)
            workload = asked.workload
            if replica.spares and (spare := replica.reuse(workload)) is not None:
                return Grant(replica, claim, spare)  # in the ledger all along: no call
            lease_id = ledger.lease_id()
            try:
                result = await ledger.lease(asked, lease_id)
            except BaseException as exc:  # failed closed, or cancelled: it may have been written
                replica.untake(claim)
                self._spawn(self._unlease(replica, [(workload, lease_id)]))
                if isinstance(exc, StateUnreachable):  # the client's 503, as the quota stage's
                    raise StateUnavailable(exc.message, retry_after_s=exc.retry_after_s) from exc
                raise
            self.set_degraded(result is None)
            if result is None:  # failing open: counted here only, within this gateway's share
                if replica.inflight > replica.cap:
                    replica.untake(claim)
                    self._spawn(self._unlease(replica, [(workload, lease_id)]))
                    continue
            else:
                granted, replica.shared = result
                # This one is in the count, not yet among `lease_ids`; one released here that
                # Redis has not heard of yet counts as elsewhere: a failing ledger leaves less.
                mine = len(replica.lease_ids) + (1 if granted else 0)
                replica.leased_elsewhere = max(0, replica.shared - mine)
                if not granted:
                    replica.untake(claim)
                    if replica.spares:  # its room is held here, idle, for another class
                        await self._give_back_now(replica)
                        continue
                    replica.blocked_until = time.monotonic() + POLL_S
                    continue
            replica.lease_ids[lease_id] = workload  # renewed from now on, written back if lost
            return Grant(replica, claim, lease_id)

    def release(self, replica: Replica, lease: str) -> None:
        """Keep the lease as a spare when that costs no other gateway anything, else give it
        back (a replica that left the pool takes no new request: its leases go back)."""
        if self._sparing_now() and lease in replica.lease_ids and replica not in self.departed:
            replica.spares[lease] = time.monotonic()
            self._sparing.add(replica)
            if self._sweeper is None or self._sweeper.done():
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
            self._freed()  # a waiter here takes it at its next poll
            return
        workload = replica.lease_ids.pop(lease, "")
        self._spawn(self._unlease(replica, [(workload, lease)]))

    def _sparing_now(self) -> bool:
        return (
            self.spare_s > 0
            and not self.degraded
            and not self._closed
            and not any(self.others_by_tier)
        )

    def give_back(
        self, replicas: Sequence[Replica] | None = None, idle_since: float = math.inf
    ) -> None:
        """Give back the spares of `replicas` (None: every replica) kept since before
        `idle_since` (by default all of them), in one ledger call per replica."""
        for replica in list(self._sparing) if replicas is None else replicas:
            spares = replica.spares
            gone = [lease for lease, since in spares.items() if since < idle_since]
            for lease in gone:
                del spares[lease]
            if not spares:  # taken by requests (`Replica.reuse`) or given back now
                self._sparing.discard(replica)
            if not gone:
                continue
            self._spawn(
                self._unlease(replica, [(replica.lease_ids.pop(lease), lease) for lease in gone])
            )

    async def _give_back_now(self, replica: Replica) -> None:
        """`replica`'s spares back in the ledger before this returns: a request here of
        another class waits for that room, and would otherwise wait for the sweep."""
        gone = list(replica.spares)
        replica.spares.clear()
        self._sparing.discard(replica)
        leases = [(replica.lease_ids.pop(lease), lease) for lease in gone]
        # Shielded: a client that leaves meanwhile must not cut the release short.
        await asyncio.shield(self._spawn(self._unlease(replica, leases)))

    async def _sweep(self) -> None:
        """While spares are kept, every half of `spare_s` give back those idle for at least
        half of it: each goes back within `spare_s` of its last use, with its neighbours."""
        half = self.spare_s / 2
        while self._sparing:
            await asyncio.sleep(half)
            self.give_back(idle_since=time.monotonic() - half)

    def _named(self, replica: Replica) -> PoolReplica:
        """The ledger's name for `replica`: a member of this pool (departed ones too)."""
        return PoolReplica(self.pool, replica.url)

    async def _unlease(self, replica: Replica, leases: Sequence[tuple[str, str]]) -> None:
        try:
            await self.ledger.unlease(self._named(replica), leases)
        finally:
            self._freed()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a release in the background: it must finish even if the request's task is
        cancelled, so it cannot be awaited in the request's `finally`."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def set_degraded(self, degraded: bool) -> None:
        if degraded != self.degraded:
            self.degraded = degraded
            if degraded:  # before the caps: this gateway's share counts the leases it holds
                self.give_back()
            self._degraded_changed()

    async def share(self, replicas: Sequence[Replica], waiting_by_tier: Sequence[int]) -> None:
        """Renew this gateway's leases, learn each replica's leases across gateways, and trade
        queue depths (`waiting_by_tier`, read once the renewals are done), so saturation (and
        shedding) reads the same in every gateway."""
        ledger = self.ledger
        self.departed = [r for r in self.departed if r.lease_ids]
        replicas = [*replicas, *self.departed]  # a replica that left still runs some
        held = [[(workload, lease) for lease, workload in r.lease_ids.items()] for r in replicas]
        totals = await asyncio.gather(
            *(
                ledger.renew(self._named(r), leases)
                for r, leases in zip(replicas, held, strict=True)
            )
        )
        for replica, leases, total in zip(replicas, held, totals, strict=True):
            if total is not None:
                replica.shared = total
                replica.leased_elsewhere = max(0, total - len(leases))
            # Released while the renewal was under way: its release may have reached Redis
            # first and the renewal written it back.
            raced = [
                (workload, lease) for workload, lease in leases if lease not in replica.lease_ids
            ]
            if raced:
                self._spawn(self._unlease(replica, raced))
        # As soon as the renewals say how the ledger is, not one round-trip later: the leases
        # they wrote back already count against the shared caps.
        self.set_degraded(not ledger.up)
        mine = list(waiting_by_tier)
        everyone = await ledger.share_waiting(self.pool, mine)
        if everyone is not None:
            self.others_by_tier = [max(0, e - m) for e, m in zip(everyone, mine, strict=True)]
            if any(self.others_by_tier):  # the room the spares hold is theirs to poll for
                self.give_back()

    async def drain(self) -> None:
        """Give back the spares, keep no more, and let the releases under way reach the ledger."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        self.give_back()
        while self._background:  # a release may spawn another (a raced renewal's)
            await asyncio.gather(*self._background, return_exceptions=True)
