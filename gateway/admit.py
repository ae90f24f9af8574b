"""Stage 6, admit: hold a slot on one replica while the request runs, or wait for one, or refuse.

A replica takes a request while it is under `max_concurrency` in-flight requests, leaves the
slots `reserve` keeps for other classes, and, when set, stays under `max_inflight_tokens`. When no
replica has room the request waits in its pool's bounded queue: strictly by tier, and within a
tier by weighted fair share of the tokens each tenant is served (start-time fair queuing), so a
tenant flooding the queue cannot starve another of its tier. A request whose predicted wait is
confidently over `max_wait_s` is refused at once rather than left to time out.

Release is synchronous and sits in the `finally` of `slot()`, so a disconnect, a time-out or a
cancellation can never leak a slot. With a `SlotLedger` (several gateways sharing the replicas
through Redis) every slot is also a lease there: taking one awaits the ledger, a release gives
the lease back in the background, and waiters are dispatched by one task per pool that looks
for a free slot every `POLL_S`, as every other gateway's does.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import random
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import asynccontextmanager
from operator import itemgetter
from typing import Any, NamedTuple, Protocol

from gateway.context import Ctx
from gateway.errors import GatewayError, NoReplica, QueueFull, QueueTimeout, QueueWaitTooLong, Shed
from gateway.policy.plugins import register
from gateway.policy.schema import PRIORITIES, PoolSpec
from gateway.state.base import SlotClaim, SlotLedger

log = logging.getLogger("gateway.admit")

# With a ledger, waiters look for a free slot this often (jittered). A release here does not
# wake them: the gateway that frees a slot must not win it back every time, or a gateway that
# held no slot when the overload began would wait while the others keep theirs. Polling at one
# rate gives every gateway with waiters the same chance at each freed slot.
POLL_S = 0.02


class Claim(NamedTuple):
    """What admission weighs of a request (a tuple: made for every request, it must be cheap)."""

    tokens: int  # input + expected output, held against `max_inflight_tokens`
    priority: int = 1  # index into PRIORITIES
    workload: str = ""  # its class, for the slots `reserve` keeps
    tenant: str = ""  # its fair-share flow within the tier ("" without tenants)
    weight: float = 1.0

    @classmethod
    def of(cls, ctx: Ctx) -> Claim:
        tenant = ctx.tenant
        if tenant is None:
            return cls(ctx.reserved_tokens, ctx.priority, ctx.workload)
        return cls(ctx.reserved_tokens, ctx.priority, ctx.workload, tenant.name, tenant.spec.weight)


class Replica:
    """One upstream vLLM server, what this gateway has running on it, and its health."""

    __slots__ = (
        "adapters",
        "blocked_until",
        "by_class",
        "cap",
        "drift_strikes",
        "ejected_until",
        "ejections",
        "failures",
        "inflight",
        "inflight_tokens",
        "key",
        "lease_ids",
        "leases",
        "max_concurrency",
        "max_tokens",
        "observed",
        "reserve",
        "shared",
        "slow_since",
        "tpot",
        "url",
    )

    def __init__(self, url: str, max_concurrency: int, max_tokens: int | None) -> None:
        self.url = url
        self.key = url  # the ledger's name for it, `{pool|url}`, set by its pool
        self.max_concurrency = max_concurrency
        self.cap = max_concurrency  # in force: less while a failing ledger leaves a share
        self.max_tokens = max_tokens
        self.reserve: tuple[tuple[str, int], ...] = ()  # (class, slots kept for it)
        self.inflight = 0
        self.inflight_tokens = 0
        self.by_class: dict[str, int] = {}  # in flight per class, against `reserve`
        self.failures = 0  # consecutive failed requests or probes
        self.ejections = 0  # times ejected so far: each ejection lasts longer
        self.ejected_until: float | None = None  # None: in the pool
        self.leases = 0  # slots handed out by `slot()` and not yet given back
        self.lease_ids: dict[str, str] = {}  # the ledger's leases held here -> reserved class
        self.shared: int | None = None  # leases on it across all gateways, as last seen
        self.blocked_until = 0.0  # the ledger refused a lease: not asked again before this
        self.observed: int | None = None  # the replica's own running + waiting, last scraped
        self.drift_strikes = 0  # scrapes in a row that found this gateway's count too high
        self.tpot: float | None = None  # moving average of its streams' time per output token
        self.slow_since: float | None = None  # since when it decodes slower than its peers
        # LoRA adapters it serves, as last discovered (gateway/adapters.py); empty: unknown.
        self.adapters: frozenset[str] = frozenset()

    @property
    def up(self) -> bool:
        return self.ejected_until is None

    def fits(self, claim: Claim) -> bool:
        if self.ejected_until is not None or self.inflight >= self.cap:
            return False
        if self.reserve:
            kept = 0  # slots other classes have reserved and do not use
            for workload, slots in self.reserve:
                if workload != claim.workload:
                    kept += max(0, slots - self.by_class.get(workload, 0))
            if self.inflight + kept >= self.cap:
                return False
        if self.blocked_until and time.monotonic() < self.blocked_until:
            return False
        # A request larger than the token cap on its own still runs, alone, on an idle replica.
        return (
            self.max_tokens is None
            or self.inflight == 0
            or self.inflight_tokens + claim.tokens <= self.max_tokens
        )


class Picker(Protocol):
    """Chooses among replicas that have room; one instance per policy."""

    def pick(self, replicas: Sequence[Replica], claim: Claim) -> Replica | None: ...


@register("picker", "least-inflight")
class LeastInflightPicker:
    """Fewest requests in flight, then fewest in-flight tokens, then list order."""

    def __init__(self, params: object) -> None:
        pass

    def pick(self, replicas: Sequence[Replica], claim: Claim) -> Replica | None:
        best: Replica | None = None
        best_key = (0, 0)
        for replica in replicas:
            if not replica.fits(claim):
                continue
            # What the replica itself last reported counts too, and its leases across gateways.
            load = max(replica.inflight, replica.observed or 0, replica.shared or 0)
            key = (load, replica.inflight_tokens)
            if best is None or key < best_key:
                best, best_key = replica, key
        return best


class Grant(NamedTuple):
    """A slot held: on which replica, for what, and its lease in the ledger (None: no ledger)."""

    replica: Replica
    claim: Claim
    lease: str | None = None


class Place:
    """A request's standing in its pool's queue, kept across its attempts.

    A replica that refuses a request before taking it (connection refused, reset before the
    headers, a 503: the pipeline's retry) sends it back to the queue where it stood: its start
    tag and arrival order, so whoever came after it stays behind it, and its deadline, the rest
    of its `max_wait_s`. There it waits for a slot on a replica it has not tried, however busy
    the pool is. A retry is the same request: it pays no second fair-share cost.
    """

    __slots__ = ("avoid", "deadline", "queued", "seq", "tag")

    def __init__(self) -> None:
        self.tag: float | None = None  # none until its first attempt is admitted or queued
        self.seq = 0
        self.deadline = 0.0  # loop time, when its `max_wait_s` ends
        self.queued = False  # it has waited in the queue (so its time there is a wait)
        self.avoid: frozenset[str] = frozenset()  # the replicas that refused it


class _Waiter:
    __slots__ = ("avoid", "claim", "future", "group", "priority", "queued", "seq", "tag")

    def __init__(
        self,
        claim: Claim,
        group: int,
        tag: float,
        place: Place,
        future: asyncio.Future[Grant],
    ) -> None:
        self.claim = claim
        self.group = group  # its class's reservation group: 0, or 1 + the reserved class's index
        self.priority = claim.priority
        self.tag = tag  # start tag: strict by tier, then fair share, then arrival
        self.seq = place.seq
        self.avoid = place.avoid  # a retry is never placed on a replica that refused it
        self.future = future
        self.queued = True  # counted in the queue; its future may be done before it leaves

    def __lt__(self, other: _Waiter) -> bool:
        return (self.priority, self.tag, self.seq) < (other.priority, other.tag, other.seq)


class HoldTimes:
    """How long the pool's last `SIZE` slots were held: by Little's law the queue drains at the
    slots in use over their mean hold time, which is what a wait is predicted from."""

    SIZE = 256
    MIN_SAMPLES = 20  # fewer: not enough history to refuse anybody early

    def __init__(self) -> None:
        self._ring: deque[float] = deque(maxlen=self.SIZE)
        self._sum = 0.0
        self._squares = 0.0

    def add(self, seconds: float) -> None:
        ring = self._ring
        if len(ring) == self.SIZE:
            old = ring[0]
            self._sum -= old
            self._squares -= old * old
        ring.append(seconds)
        self._sum += seconds
        self._squares += seconds * seconds

    def mean(self) -> tuple[float, float] | None:
        """The mean hold time and a confident lower bound of it (three standard errors below);
        None without enough history."""
        n = len(self._ring)
        if n < self.MIN_SAMPLES:
            return None
        mean = self._sum / n
        variance = max(0.0, self._squares / n - mean * mean)
        return mean, max(0.0, mean - 3 * math.sqrt(variance / n))


class Demand:
    """The cluster-level signal: how many replicas this pool's traffic needs, smoothed.

    By Little's law the slots in use on average are busy seconds per second; waiting and refused
    requests are demand too (a refused one would have held a slot for the mean hold time). Their
    sum over the per-replica cap is `llm_pool_desired_replicas`, which an HPA can target.
    """

    SMOOTHING = 0.2  # weight of the newest tick in the moving average

    def __init__(self) -> None:
        self.arrivals = 0
        self.refused = 0
        self.busy_s = 0.0
        self.queued_s = 0.0
        self.desired_replicas = 0.0
        self._last: tuple[float, int, int, float, float] | None = None

    def tick(self, cap: int) -> None:
        now = time.perf_counter()
        if self._last is not None:
            then, arrivals, refused, busy_s, queued_s = self._last
            dt = now - then
            if dt > 0:
                served = max(1, (self.arrivals - arrivals) - (self.refused - refused))
                hold_s = (self.busy_s - busy_s) / served
                slots = (self.busy_s - busy_s + self.queued_s - queued_s) / dt + (
                    self.refused - refused
                ) * hold_s / dt
                self.desired_replicas += self.SMOOTHING * (slots / cap - self.desired_replicas)
        self._last = (now, self.arrivals, self.refused, self.busy_s, self.queued_s)


class PoolSlots:
    """The replicas of one pool and the queue in front of them."""

    def __init__(
        self, name: str, spec: PoolSpec, picker: Picker, ledger: SlotLedger | None = None
    ) -> None:
        self.name = name
        self.picker = picker
        self.ledger = ledger
        self.replicas = [
            Replica(url, spec.max_concurrency, spec.max_inflight_tokens) for url in spec.replicas
        ]
        # One queue per reservation group: slots a class keeps are no use to the others, so a
        # waiter that fits them passes the head of another group, never one of its own.
        self._heaps: list[list[_Waiter]] = [[]]
        self._seq = itertools.count()
        self.waiting_by_group = [0]  # live waiters; the heaps also hold abandoned and granted ones
        self.waiting_by_tier = [0] * len(PRIORITIES)
        self._vtime = [0.0] * len(PRIORITIES)  # per tier: the start tag last dispatched
        # (tier, tenant) -> the virtual time its last request queued finishes: kept after it
        # is served (a tenant that keeps one request waiting at a time still pays for each),
        # and bounded by the policy's tenants.
        self._finish: dict[tuple[int, str], float] = {}
        self.holds = [HoldTimes()]  # per reservation group: they drain at their own pace
        self.others_by_tier = [0] * len(PRIORITIES)  # other gateways' waiters, as last shared
        self.degraded = False  # the ledger fails open: each replica's cap is this gateway's share
        self._dispatcher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._departed: list[Replica] = []  # left the pool with leases held: renewed till released
        self.retrying = 0  # retries in flight, against the retry budget
        self.ejections: Counter[tuple[str, str]] = Counter()  # (replica, reason) -> count
        self.demand = Demand()
        self.drift: Counter[tuple[str, str]] = Counter()  # (replica, kind) -> scrapes
        self.sheds: Counter[str] = Counter()  # tier -> requests shed
        self._groups: dict[str, int] = {}  # reserved class -> its group
        self._apply(spec)

    def _apply(self, spec: PoolSpec) -> None:
        self.spec = spec
        groups = {workload: i + 1 for i, workload in enumerate(spec.reserve)}
        if groups != self._groups:
            self._regroup(groups)
        reserve = self._reservations = tuple(spec.reserve.items())
        for replica in self.replicas:
            replica.key = f"{{{self.name}|{replica.url}}}"
            replica.max_concurrency = spec.max_concurrency
            replica.cap = self._cap()
            replica.max_tokens = spec.max_inflight_tokens
            replica.reserve = reserve

    def _regroup(self, groups: dict[str, int]) -> None:
        """New reservations (a reload): the waiters move to their classes' new queues."""
        self._groups = groups
        # Every waiter not yet left, even one whose future is done: its `_leave` is still to run.
        live = [w for heap in self._heaps for w in heap if w.queued]
        self._heaps = [[] for _ in range(len(groups) + 1)]
        self.waiting_by_group = [0] * len(self._heaps)
        self.holds = [HoldTimes() for _ in self._heaps]
        for waiter in live:
            waiter.group = groups.get(waiter.claim.workload, 0)
            self.waiting_by_group[waiter.group] += 1
            heapq.heappush(self._heaps[waiter.group], waiter)

    def _cap(self) -> int:
        cap = self.spec.max_concurrency
        if self.degraded and self.ledger is not None:
            return max(1, cap // self.ledger.gateways)
        return cap

    def update(self, spec: PoolSpec, picker: Picker) -> None:
        """Take a reloaded pool spec. Replicas that stay keep their counts and health; new ones
        join; those that left take no new request, and the requests they run release on them."""
        known = {r.url: r for r in self.replicas}
        self.replicas = [known.get(url) or Replica(url, 0, None) for url in spec.replicas]
        self._departed += [
            r for url, r in known.items() if url not in spec.replicas and r.lease_ids
        ]
        self.picker = picker
        self._apply(spec)
        self._dispatch()  # the caps may have grown

    @property
    def capacity(self) -> int:
        """The caps of the replicas in the pool: an ejected one's slots leave with it."""
        return sum(r.max_concurrency for r in self.replicas if r.up)

    @property
    def max_depth(self) -> int:
        """The queue shrinks with the pool: waiting for replicas that are gone only adds latency."""
        up = sum(r.up for r in self.replicas)
        return math.ceil(self.spec.queue.max_depth * up / max(1, len(self.replicas)))

    @property
    def waiting(self) -> int:
        return sum(self.waiting_by_group)

    @property
    def others_waiting(self) -> int:
        return sum(self.others_by_tier)

    def _outranked(self, priority: int) -> bool:
        """Another gateway has waiters of a higher tier (as last shared, while the ledger
        answers): a slot freed in the ledger is theirs, so tiers hold across gateways too."""
        return not self.degraded and any(self.others_by_tier[:priority])

    @property
    def inflight(self) -> int:
        return sum(r.inflight for r in self.replicas)

    # --- health: passive outlier detection and ejection -------------------------------------

    def succeeded(self, replica: Replica) -> None:
        replica.failures = 0

    def failed(self, replica: Replica, reason: str) -> None:
        """Count a failure; eject the replica after `consecutive_failures` in a row."""
        replica.failures += 1
        health = self.spec.health
        if self.due_for_probe(replica):  # failed its half-open trial: out again, for longer
            self._eject(replica, reason)
        elif replica.up and replica.failures >= health.consecutive_failures and self._may_eject():
            self._eject(replica, reason)

    def _eject(self, replica: Replica, reason: str) -> None:
        replica.ejections += 1
        ejection_s = self.spec.health.ejection_s * min(replica.ejections, 10)
        replica.ejected_until = time.monotonic() + ejection_s
        self.ejections[(replica.url, reason)] += 1
        log.warning("pool %s: replica %s ejected for %.0fs (%s, %d failures in a row)",
                    self.name, replica.url, ejection_s, reason, replica.failures)  # fmt: skip

    TPOT_SMOOTHING = 0.1

    def observe_tpot(self, replica: Replica, tpot_s: float) -> None:
        replica.tpot = (
            tpot_s
            if replica.tpot is None
            else replica.tpot + self.TPOT_SMOOTHING * (tpot_s - replica.tpot)
        )

    def check_speed(self) -> None:
        """Eject a replica that decodes slower than `slow_ratio` of its peers' median for
        `slow_window_s`: the instance level of the article's circuit breaking."""
        health = self.spec.health
        measured = sorted(r.tpot for r in self.replicas if r.up and r.tpot is not None)
        if len(measured) < 2:
            return
        median = (
            measured[len(measured) // 2]
            if len(measured) % 2
            else ((measured[len(measured) // 2 - 1] + measured[len(measured) // 2]) / 2)
        )
        now = time.monotonic()
        for replica in self.replicas:
            if not replica.up or replica.tpot is None or replica.tpot * health.slow_ratio <= median:
                replica.slow_since = None
                continue
            replica.slow_since = replica.slow_since or now
            if now - replica.slow_since >= health.slow_window_s:
                replica.slow_since, replica.tpot = None, None  # judged afresh once readmitted
                if self._may_eject():
                    self._eject(replica, "slow")

    def _may_eject(self) -> bool:
        ejected = sum(not r.up for r in self.replicas)
        share = int(len(self.replicas) * self.spec.health.max_ejection_percent / 100)
        return ejected < min(len(self.replicas) - 1, share)

    def readmit(self, replica: Replica) -> None:
        if not replica.up:
            replica.ejected_until = None
            replica.failures = 0
            log.info("pool %s: replica %s readmitted", self.name, replica.url)
            self._dispatch()

    def due_for_probe(self, replica: Replica) -> bool:
        """Ejected long enough to be tried again (half-open)."""
        return replica.ejected_until is not None and time.monotonic() >= replica.ejected_until

    # --- retries -----------------------------------------------------------------------------

    def can_retry(self, avoid: frozenset[str]) -> bool:
        """Within the retry budget, and a replica in service that `avoid` leaves, to wait for
        (`Place`): busy or not, a slot frees on it sooner or later."""
        retry = self.spec.retry
        budget = max(retry.min_concurrent, retry.budget_percent / 100 * self.inflight)
        if self.retrying >= budget:
            return False
        return any(r.up and r.url not in avoid for r in self.replicas)

    # --- taking and giving back slots ------------------------------------------------------

    def _take(self, replica: Replica, claim: Claim) -> None:
        replica.inflight += 1
        replica.leases += 1
        replica.inflight_tokens += claim.tokens
        by_class = replica.by_class
        by_class[claim.workload] = by_class.get(claim.workload, 0) + 1

    def _untake(self, replica: Replica, claim: Claim) -> None:
        replica.inflight -= 1
        replica.leases -= 1
        replica.inflight_tokens -= claim.tokens
        by_class = replica.by_class
        left = by_class[claim.workload] - 1
        if left:
            by_class[claim.workload] = left
        else:
            del by_class[claim.workload]

    async def _take_any(self, claim: Claim, replicas: Sequence[Replica]) -> Grant | None:
        """A slot at once on one of `replicas`, or None."""
        if self.ledger is None:
            replica = self.picker.pick(replicas, claim)
            if replica is None:
                return None
            self._take(replica, claim)
            return Grant(replica, claim)
        return await self._take_leased(self.ledger, claim, replicas)

    async def _take_leased(
        self, ledger: SlotLedger, claim: Claim, replicas: Sequence[Replica]
    ) -> Grant | None:
        """Pick as alone, then ask the ledger; a replica it refuses (full across gateways) is
        left alone for `POLL_S` and the next is tried. The local count is taken first, so
        concurrent requests of this gateway never overbook while the ledger answers."""
        while True:
            replica = self.picker.pick(replicas, claim)
            if replica is None:
                return None
            self._take(replica, claim)
            lease_id = ledger.lease_id()
            workload = claim.workload if claim.workload in self._groups else ""
            asked = SlotClaim(replica.key, workload, self._reservations, replica.max_concurrency)
            try:
                result = await ledger.lease(asked, lease_id)
            except BaseException:  # failed closed, or cancelled: the lease may have been written
                self._untake(replica, claim)
                self._spawn(self._unlease(ledger, replica.key, workload, lease_id))
                raise
            self._set_degraded(result is None)
            if result is None:  # failing open: counted here only, within this gateway's share
                if replica.inflight > replica.cap:
                    self._untake(replica, claim)
                    self._spawn(self._unlease(ledger, replica.key, workload, lease_id))
                    continue
            else:
                granted, replica.shared = result
                if not granted:
                    self._untake(replica, claim)
                    replica.blocked_until = time.monotonic() + POLL_S
                    continue
            replica.lease_ids[lease_id] = workload  # renewed from now on, written back if lost
            return Grant(replica, claim, lease_id)

    def release(self, grant: Grant) -> None:
        replica = grant.replica
        self._untake(replica, grant.claim)
        if grant.lease is None or self.ledger is None:
            self._dispatch()
            return
        workload = replica.lease_ids.pop(grant.lease, "")
        self._spawn(self._unlease(self.ledger, replica.key, workload, grant.lease))

    async def _unlease(self, ledger: SlotLedger, key: str, workload: str, lease: str) -> None:
        try:
            await ledger.unlease(key, workload, lease)
        finally:
            self._dispatch()  # free in the ledger now: waiters here may take it at their next poll

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run a release in the background: it must finish even if the request's task is
        cancelled, so it cannot be awaited in the request's `finally`."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _set_degraded(self, degraded: bool) -> None:
        if degraded == self.degraded:
            return
        self.degraded = degraded
        for replica in self.replicas:
            replica.cap = self._cap()
        if degraded:
            log.error("pool %s: the slot ledger is unreachable; each replica's cap here is %d",
                      self.name, self._cap())  # fmt: skip
        else:
            log.warning("pool %s: the slot ledger is back; caps are shared again", self.name)
            self._dispatch()

    async def share(self) -> None:
        """Renew this gateway's leases, learn each replica's leases across gateways, and trade
        queue depths, so saturation (and shedding) reads the same in every gateway."""
        ledger = self.ledger
        if ledger is None:
            return
        self._departed = [r for r in self._departed if r.lease_ids]
        replicas = [*self.replicas, *self._departed]  # a replica that left still runs some
        held = [[(workload, lease) for lease, workload in r.lease_ids.items()] for r in replicas]
        totals = await asyncio.gather(
            *(ledger.renew(r.key, leases) for r, leases in zip(replicas, held, strict=True))
        )
        for replica, leases, total in zip(replicas, held, totals, strict=True):
            if total is not None:
                replica.shared = total
            # Released while the renewal was under way: its release may have reached Redis
            # first and the renewal written it back.
            for workload, lease in leases:
                if lease not in replica.lease_ids:
                    self._spawn(self._unlease(ledger, replica.key, workload, lease))
        # As soon as the renewals say how the ledger is, not one round-trip later: the leases
        # they wrote back already count against the shared caps.
        self._set_degraded(not ledger.up)
        mine = list(self.waiting_by_tier)
        everyone = await ledger.share_waiting(self.name, mine)
        if everyone is not None:
            self.others_by_tier = [max(0, e - m) for e, m in zip(everyone, mine, strict=True)]

    async def close(self) -> None:
        """Stop dispatching and let the releases under way reach the ledger."""
        self._closed = True
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        while self._background:  # a release may spawn another (a raced renewal's)
            await asyncio.gather(*self._background, return_exceptions=True)

    def reconcile(self, replica: Replica, observed: int) -> None:
        """Compare this gateway's count with the replica's own figures (`vllm:num_requests_*`).

        More on the replica than here is normal when gateways share it: the picker weighs it.
        More here than on the replica, twice in a row, is drift: counted, logged, and corrected
        to the slots really held, so a lost release can never shrink a replica for good.
        """
        replica.observed = observed
        if replica.inflight <= observed:
            replica.drift_strikes = 0
            return
        replica.drift_strikes += 1
        self.drift[(replica.url, "gateway_high")] += 1
        if replica.drift_strikes >= 2 and replica.inflight > replica.leases:
            log.warning("pool %s: replica %s: %d in flight here, %d there, %d held: corrected",
                        self.name, replica.url, replica.inflight, observed, replica.leases)  # fmt: skip
            replica.inflight = replica.leases
            self._dispatch()

    # --- the queue ---------------------------------------------------------------------------

    def _start_tag(self, claim: Claim) -> float:
        """Where a tenant's next request starts in its tier's virtual time: where its last one
        finishes, or now if that is past (an idle tenant banks no credit)."""
        now = self._vtime[claim.priority]
        return max(now, self._finish.get((claim.priority, claim.tenant), now))

    def _enqueue(self, claim: Claim, group: int, place: Place) -> _Waiter:
        """Queue at `place`, or, the first time, with a start tag: then the request costs its
        tokens over its tenant's weight."""
        tier = claim.priority
        tag = place.tag
        if tag is None:
            tag = self._start_tag(claim)
            place.tag, place.seq = tag, next(self._seq)
            self._finish[(tier, claim.tenant)] = tag + max(1, claim.tokens) / claim.weight
        place.queued = True
        future: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(claim, group, tag, place, future)
        heapq.heappush(self._heaps[group], waiter)
        self.waiting_by_tier[tier] += 1
        self.waiting_by_group[group] += 1
        return waiter

    def _leave(self, waiter: _Waiter) -> None:
        waiter.queued = False
        self.waiting_by_tier[waiter.priority] -= 1
        self.waiting_by_group[waiter.group] -= 1

    def _grant(self, waiter: _Waiter, grant: Grant) -> None:
        self._leave(waiter)
        tier = waiter.priority
        self._vtime[tier] = max(self._vtime[tier], waiter.tag)
        waiter.future.set_result(grant)

    def _heads(self) -> list[tuple[_Waiter, Sequence[Replica]]]:
        """Who may be served next, in dispatch order, and on which replicas: the head of each
        group's queue, on any of them, and behind a head that avoids some (a retry), those
        after it up to the first that avoids none, each only on replicas every waiter before
        it avoids. So no waiter ever passes another to a slot that one could take."""
        heads: list[tuple[_Waiter, Sequence[Replica]]] = []
        for heap in self._heaps:
            while heap and heap[0].future.done():  # abandoned (timed out, cancelled) or granted
                heapq.heappop(heap)
            if heap and heap[0].avoid:
                heads += self._front(heap)
            elif heap:
                heads.append((heap[0], self.replicas))
        heads.sort(key=itemgetter(0))
        return heads

    def _front(self, heap: list[_Waiter]) -> list[tuple[_Waiter, Sequence[Replica]]]:
        """The front of a queue headed by retries (see `_heads`): popped in order and pushed
        back, a few at most, as retries in flight are bounded by the retry budget."""
        front: list[tuple[_Waiter, Sequence[Replica]]] = []
        popped = []
        left: Sequence[Replica] = self.replicas  # the replicas no waiter before this one takes
        while heap and left:
            waiter = heapq.heappop(heap)
            if waiter.future.done():
                continue
            popped.append(waiter)
            front.append((waiter, [r for r in left if r.url not in waiter.avoid]))
            left = [r for r in left if r.url in waiter.avoid]
        for waiter in popped:
            heapq.heappush(heap, waiter)
        return front

    def _dispatch(self) -> None:
        if not self.waiting:  # the common case, on every release
            return
        if self.ledger is None:
            while True:
                for head, replicas in self._heads():
                    replica = self.picker.pick(replicas, head.claim)
                    if replica is not None:  # the granted waiter leaves the heap at its top
                        self._take(replica, head.claim)
                        self._grant(head, Grant(replica, head.claim))
                        break
                else:
                    return  # strict order within a group: its head waits, nobody overtakes it
        if not self._closed and (self._dispatcher is None or self._dispatcher.done()):
            self._dispatcher = asyncio.get_running_loop().create_task(
                self._dispatch_leased(self.ledger), name=f"dispatch:{self.name}"
            )

    async def _dispatch_leased(self, ledger: SlotLedger) -> None:
        while heads := self._heads():
            for head, replicas in heads:
                if self._outranked(head.priority):
                    continue
                try:
                    grant = await self._take_leased(ledger, head.claim, replicas)
                except Exception as exc:  # failed closed (or a bug): so does the head, alone
                    if not isinstance(exc, GatewayError):
                        log.exception("pool %s: dispatching a waiter failed", self.name)
                    if not head.future.done():
                        self._leave(head)
                        head.future.set_exception(exc)
                    break
                if grant is not None:
                    if head.future.done():  # abandoned while its lease was asked for
                        self.release(grant)
                    else:
                        self._grant(head, grant)
                    break
            else:
                await asyncio.sleep(POLL_S * (0.5 + random.random()))

    @property
    def saturation(self) -> float:
        """(In flight + waiting) / capacity: 1.0 is every slot busy and nobody waiting. With a
        ledger, every gateway's slots and waiters count."""
        if self.ledger is None or self.degraded:  # against the caps in force here
            busy, waiting = self.inflight, self.waiting
            capacity = sum(r.cap for r in self.replicas if r.up)
        else:
            busy = sum(max(r.inflight, r.shared or 0) for r in self.replicas)
            waiting = self.waiting + self.others_waiting
            capacity = self.capacity
        return (busy + waiting) / max(1, capacity)

    def _shed(self, priority: int) -> None:
        tier = PRIORITIES[priority]
        threshold = self.spec.shed.get(tier)  # type: ignore[call-overload]
        if threshold is not None and (saturation := self.saturation) >= threshold:
            self.sheds[tier] += 1
            raise Shed(
                f"pool {self.name} is saturated ({saturation:.2f} >= {threshold:g}):"
                f" {tier} requests are shed first",
                retry_after_s=self.spec.queue.retry_after_s,
            )

    def _group_inflight(self, group: int) -> int:
        if len(self._heaps) == 1:
            return self.inflight
        if group:
            workload = next(w for w, g in self._groups.items() if g == group)
            return sum(r.by_class.get(workload, 0) for r in self.replicas)
        return self.inflight - sum(
            r.by_class.get(w, 0) for r in self.replicas for w in self._groups
        )

    def _fail_fast(self, claim: Claim, group: int) -> None:
        """Refuse now a request that would confidently wait past `max_wait_s`: its place in its
        group's queue (itself included) over the group's drain rate (its slots in use over
        their mean hold time; with a ledger, every gateway's, in this queue's share of all the
        waiters). The lower bound of the hold time decides, so a burst that would
        drain in time is never refused; the point estimate is the Retry-After."""
        measured = self.holds[group].mean()
        if measured is None:
            return
        mean, low = measured
        slots: float = self._group_inflight(group)
        if self.ledger is not None and not self.degraded and len(self._heaps) == 1:
            # Shared slots drain to every gateway's waiters: this queue gets its share of them.
            busy = sum(max(r.inflight, r.shared or 0) for r in self.replicas)
            here = self.waiting + 1
            slots = busy * here / (here + self.others_waiting)
        slots = max(1.0, slots)
        max_wait = self.spec.queue.max_wait_s
        place = self.waiting_by_group[group] + 1  # at most: fair share may put it further up
        if place * low / slots <= max_wait:
            return
        # Only now, when the bound says it may be refused, count who is really ahead of it.
        mine = (claim.priority, self._start_tag(claim))
        place = 1 + sum(
            1 for w in self._heaps[group] if not w.future.done() and (w.priority, w.tag) <= mine
        )
        if place * low / slots > max_wait:
            predicted = place * mean / slots
            raise QueueWaitTooLong(
                f"pool {self.name}: the predicted wait for a slot, {predicted:.0f}s"
                f" ({place} in line at the measured drain rate), is over {max_wait:g}s",
                retry_after_s=predicted,
            )

    async def acquire(self, claim: Claim, place: Place | None = None) -> Grant:
        """A slot for `claim`: at once, after a wait in the queue, or a refusal. A request with
        a `place` from an earlier attempt goes straight back to it (see `Place`)."""
        if place is None:
            place = Place()
        if place.tag is None:
            grant = await self._admit(claim, place)
            if grant is not None:
                return grant
        return await self._wait(claim, place)

    async def _admit(self, claim: Claim, place: Place) -> Grant | None:
        """A first attempt: a slot at once, a refusal (raised), or None: it is to wait."""
        if not self.replicas:
            raise NoReplica(f"pool {self.name} has no replica", retry_after_s=5)
        queue = self.spec.queue
        place.deadline = asyncio.get_running_loop().time() + queue.max_wait_s
        if self.spec.shed:
            self._shed(claim.priority)
        if self.waiting_by_group[self._groups.get(claim.workload, 0)] == 0 and (
            self.ledger is None or not self._outranked(claim.priority)
        ):  # else it queues behind them
            grant = await self._take_any(claim, self.replicas)
            if grant is not None:  # its standing, should a replica refuse it: unpaid
                place.tag, place.seq = self._start_tag(claim), next(self._seq)
                return grant
        if self.waiting >= self.max_depth:
            raise QueueFull(
                f"pool {self.name} is at capacity and its queue is full ({self.max_depth})",
                retry_after_s=queue.retry_after_s,
            )
        if queue.fail_fast:
            self._fail_fast(claim, self._groups.get(claim.workload, 0))
        return None

    async def _wait(self, claim: Claim, place: Place) -> Grant:
        group = self._groups.get(claim.workload, 0)  # after the awaits: a reload may regroup
        waiter = self._enqueue(claim, group, place)
        self._dispatch()  # a higher priority than the current head may fit at once
        future = waiter.future
        granted = False
        try:
            async with asyncio.timeout_at(place.deadline):
                grant = await future
            granted = True
            return grant
        except TimeoutError:
            queue = self.spec.queue
            raise QueueTimeout(
                f"pool {self.name} had no free slot within {queue.max_wait_s:g}s",
                retry_after_s=queue.retry_after_s,
            ) from None
        finally:
            if not future.done():
                future.cancel()
            if future.cancelled():
                self._leave(waiter)
                self._dispatch()  # the waiter behind an abandoned head may fit
            elif not granted and future.exception() is None:
                # Granted in the same tick as the time-out or cancellation: hand it back.
                self.release(future.result())

    @asynccontextmanager
    async def slot(self, ctx: Ctx, place: Place) -> AsyncIterator[Grant]:
        """Hold a slot for `ctx`; `place` is its standing, new on its first attempt."""
        claim = Claim.of(ctx)
        self.demand.arrivals += place.tag is None
        started = time.perf_counter()
        grant: Grant | None = None
        try:
            grant = await self.acquire(claim, place)
        except (QueueFull, QueueTimeout, QueueWaitTooLong, Shed):
            self.demand.refused += 1
            raise
        finally:
            # The wait for a slot: ~0 for a request served at once; none at all for one refused
            # before it queued, which is no sample of how long the queue makes requests wait.
            if grant is not None or place.queued:
                waited = time.perf_counter() - started
                ctx.queue_wait = (ctx.queue_wait or 0.0) + waited
                self.demand.queued_s += waited
        ctx.replica = grant.replica.url
        held = time.perf_counter()
        try:
            yield grant
        finally:
            hold_s = time.perf_counter() - held
            self.demand.busy_s += hold_s
            self.holds[self._groups.get(grant.claim.workload, 0)].add(hold_s)
            self.release(grant)
