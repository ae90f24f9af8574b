"""A pool's slots: its replicas, the queue in front of them, and, with a ledger, their leases.

A replica takes a request while it is under `max_concurrency` in-flight requests, leaves the
slots `reserve` keeps for other classes, and, when set, stays under `max_inflight_tokens`. When no
replica has room the request waits in its pool's bounded queue (`fairqueue.py`). A request whose
predicted wait is confidently over `max_wait_s` is refused at once rather than left to time out.

Release is synchronous and sits in the `finally` of `slot()`, so a disconnect, a time-out or a
cancellation can never leak a slot. With a `SlotLedger` (`leases.py`) waiters are dispatched by
one task per pool that looks for a free slot every `POLL_S`, as every other gateway's does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from types import TracebackType

from gateway.admit import ejection, leases
from gateway.admit.claim import Claim
from gateway.admit.demand import Demand, HoldTimes
from gateway.admit.ejection import Ejector
from gateway.admit.fairqueue import Place, Queue
from gateway.admit.latency import Flight, LatencyModel
from gateway.admit.leases import Leases
from gateway.admit.limiter import Limiter
from gateway.admit.picking import Picker
from gateway.admit.preempt import CRITICAL, InFlight, Preemption
from gateway.admit.reconcile import Reconciler
from gateway.admit.replica import EngineGauges, Grant, Replica
from gateway.config.schema import PRIORITIES, PoolSpec
from gateway.context.ctx import Ctx
from gateway.context.objective import Objective, Prediction
from gateway.deadline import Deadline
from gateway.errors import (
    Ejection,
    GatewayError,
    NoReplica,
    QueueFull,
    QueueTimeout,
    QueueWaitTooLong,
    Shed,
    SloUnreachable,
)
from gateway.state.base import PoolReplica, SlotClaim, SlotLedger

log = logging.getLogger("gateway.admit")  # one logger for the whole stage: operators grep it
SHEDDABLE = PRIORITIES.index("sheddable")


class LivePool:
    """The replicas of one pool and the queue in front of them."""

    def __init__(
        self,
        name: str,
        spec: PoolSpec,
        picker: Picker,
        ledger: SlotLedger | None = None,
        spare_s: float = 0.0,
    ) -> None:
        self.name = name
        self.picker = picker
        self.ledger = ledger
        self.replicas = [
            Replica(url, spec.max_concurrency, spec.max_inflight_tokens) for url in spec.replicas
        ]
        self.queue = Queue()
        # None without a ledger, not a null one: the branches on it keep a lone gateway's slot
        # a synchronous take (`_take_here`), where any ledger, even a no-op, is an await.
        self.leases = (
            None
            if ledger is None
            else Leases(name, ledger, self._dispatch, self._degraded_changed, spare_s)
        )
        self.ejector = Ejector(name)
        self._dispatcher: asyncio.Task[None] | None = None
        self._closed = False
        self.retrying = 0  # retries in flight, against the retry budget
        self.demand = Demand()
        self.probed = asyncio.Event()  # its first round of health probes is over (or off)
        self.reconciler = Reconciler(name)
        self.sheds: Counter[str] = Counter()  # tier -> requests shed
        self.latency: LatencyModel | None = None  # with `slo`: each replica's predictions
        self.limiter: Limiter | None = None  # the adaptive caps, when the pool has them
        self.preemptions: Counter[str] = Counter()  # tier -> requests preempted
        self.preemption: Preemption | None = None  # only with `slo.preempt` enabled
        self._apply(spec)

    def _apply(self, spec: PoolSpec) -> None:
        self.spec = spec
        if spec.slo is None:
            self.latency = None
        elif self.latency is None or self.latency.seed != spec.slo.model:
            self.latency = LatencyModel(spec.slo.model)  # a new seed: what was learned goes
        self.demand.retune(spec.forecast)
        preempt = spec.slo.preempt if spec.slo is not None else None
        if preempt is None or not preempt.enabled:
            self.preemption = None  # the requests it registered leave it as they end (`Held`)
        elif self.preemption is None:
            self.preemption = Preemption(preempt)
        else:
            self.preemption.retune(preempt)
        groups = {workload: i + 1 for i, workload in enumerate(spec.reserve)}
        if groups != self.queue.groups:
            self.queue.regroup(groups)
        reserve = self._reservations = tuple(spec.reserve.items())
        if spec.slo is None or spec.slo.adaptive is None:
            self.limiter = None
        elif self.limiter is None:
            self.limiter = Limiter(self.name, spec)
        else:
            self.limiter.retune(spec)
        for replica in self.replicas:
            replica.reserve = reserve
            self._limit(replica)

    def _limit(self, replica: Replica) -> None:
        """The replica's caps in force, the policy's or its adaptive ones (`limiter.py`), and
        this gateway's part of them (`_cap`)."""
        if self.limiter is None:
            replica.max_concurrency = self.spec.max_concurrency
            replica.max_tokens = self.spec.max_inflight_tokens
        else:
            replica.max_concurrency, replica.max_tokens = self.limiter.caps(replica.url)
        replica.cap = self._cap(replica)

    def _cap(self, replica: Replica) -> int:
        """The slots this gateway may hold on `replica`: all of its `max_concurrency` while the
        ledger answers. While it fails open, the slots it already holds and a `1/gateways`
        share of those no gateway held when it last heard from the ledger: the others keep
        theirs and take no more than their share of the free ones either, so together they
        stay within the cap, though the slots held then stay where they were until the ledger
        is back. An even share of the cap would let a gateway that held less fill its share
        while one that held more still ran its surplus. A replica never leased here (new in a
        reload) gets the even share; the share never grows while the ledger stays down."""
        cap = replica.max_concurrency
        if not self.degraded or self.ledger is None:
            return cap
        gateways = self.ledger.gateways
        if replica.leased_elsewhere is None:
            return max(1, cap // gateways)
        held = len(replica.lease_ids)
        free = max(0, cap - replica.leased_elsewhere - held)
        return min(replica.cap, held + free // gateways)

    def update(self, spec: PoolSpec, picker: Picker) -> None:
        """Take a reloaded pool spec. Replicas that stay keep their counts and health; new ones
        join; those that left take no new request, and the requests they run release on them."""
        known = {r.url: r for r in self.replicas}
        self.replicas = [known.get(url) or Replica(url, 0, None) for url in spec.replicas]
        for url in known.keys() - set(spec.replicas):
            picker.forget(url)
        if self.leases is not None:  # without a ledger no replica holds a lease
            # Caps and reservations may change: a spare kept under the old ones may not fit.
            self.leases.give_back()
            self.leases.departed += [
                r for url, r in known.items() if url not in spec.replicas and r.lease_ids
            ]
        self.picker = picker
        self._apply(spec)
        self._dispatch()  # the caps may have grown

    # --- what the pool reads as: metrics, shedding, the retry budget ----------------------

    @property
    def capacity(self) -> int:
        """The caps of the replicas in the pool: an ejected one's slots leave with it."""
        return sum(r.max_concurrency for r in self.replicas if r.up)

    @property
    def replica_cap(self) -> float:
        """A replica's cap in force, on average over those in service: what the demand signal
        divides by, since with adaptive caps a replica serves its limit, not the policy's cap."""
        up = [r.max_concurrency for r in self.replicas if r.up]
        return sum(up) / len(up) if up else self.spec.max_concurrency

    @property
    def max_depth(self) -> int:
        """The queue shrinks with the pool: waiting for replicas that are gone only adds latency."""
        up = sum(r.up for r in self.replicas)
        return math.ceil(self.spec.queue.max_depth * up / max(1, len(self.replicas)))

    @property
    def waiting(self) -> int:
        return self.queue.waiting

    @property
    def waiting_by_tier(self) -> list[int]:
        return self.queue.waiting_by_tier

    @property
    def waiting_by_group(self) -> list[int]:
        return self.queue.waiting_by_group

    @property
    def holds(self) -> list[HoldTimes]:
        return self.queue.holds

    @property
    def degraded(self) -> bool:
        """The ledger fails open: each replica's cap is this gateway's share."""
        return self.leases is not None and self.leases.degraded

    @property
    def others_waiting(self) -> int:
        return 0 if self.leases is None else self.leases.others_waiting

    @property
    def ejections(self) -> Counter[tuple[str, Ejection]]:
        return self.ejector.ejections

    @property
    def inflight(self) -> int:
        return sum(r.inflight for r in self.replicas)

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

    def can_retry(self, avoid: frozenset[str]) -> bool:
        """Within the retry budget, and a replica in service that `avoid` leaves, to wait for
        (`Place`): busy or not, a slot frees on it sooner or later."""
        retry = self.spec.retry
        budget = max(retry.min_concurrent, retry.budget_percent / 100 * self.inflight)
        if self.retrying >= budget:
            return False
        return any(r.up and r.url not in avoid for r in self.replicas)

    # --- health (`ejection.py`) and the replicas' own figures ------------------------------

    def succeeded(self, replica: Replica) -> None:
        replica.failures = 0
        replica.checked = True

    def failed(self, replica: Replica, reason: Ejection) -> None:
        replica.checked = True
        self.ejector.failed(self.replicas, replica, reason, self.spec.health)

    def answered(self, grant: Grant, ctx: Ctx, failure: Ejection | None) -> None:
        """The replica answered the request it was granted for, or failed it (`failure`): its
        health counts it, and the picker is told, so a scorer may learn from the response."""
        replica = grant.replica
        if failure is None:
            self.succeeded(replica)
            tokens = ctx.output_tokens or 0  # the replica's word: a count past the bound, a lie
            tpot_s = None
            if ctx.first_token is not None and 1 < tokens <= self._most_output(ctx):
                tpot_s = (time.perf_counter() - ctx.first_token) / (tokens - 1)
                ejection.observe_tpot(replica, tpot_s)
                if self.latency is not None and isinstance(ctx.prefill, Flight):
                    self.latency.observe_tpot(ctx.prefill, tpot_s)
            if self.limiter is not None:
                self.limiter.answered(replica, ctx, tpot_s)
        else:
            self.failed(replica, failure)
        self.picker.observe(replica, grant.claim, ctx, failure)

    def adapt(self) -> None:
        """The adaptive caps' moves, on the health checker's tick: a cap that grew may let a
        waiter in."""
        if self.limiter is None:
            return
        moved = self.limiter.decide(self.replicas, time.perf_counter())
        for replica, _ in moved:
            self._limit(replica)
        if self.leases is not None:  # a spare kept under a cap that shrank may not fit it
            self.leases.give_back([replica for replica, grew in moved if not grew])
        if any(grew for _, grew in moved):
            self._dispatch()

    @staticmethod
    def _most_output(ctx: Ctx) -> int:
        return ctx.most_output(ctx.pool.model.spec.max_model_len) if ctx.pool else 0

    def check_speed(self) -> None:
        self.ejector.check_speed(self.replicas, self.spec.health)

    def readmit(self, replica: Replica) -> None:
        if self.ejector.readmit(replica):
            self.picker.forget(replica.url)  # it may have restarted while out: its cache is gone
            self._dispatch()

    def due_for_probe(self, replica: Replica) -> bool:
        return ejection.due_for_probe(replica)

    def reconcile(self, replica: Replica, gauges: EngineGauges) -> None:
        """The replica's own figures, read from its /metrics (`reconcile.py`)."""
        if self.reconciler.restarted(replica, gauges):
            log.info("pool %s: replica %s restarted (its counters fell)", self.name, replica.url)
            self.picker.forget(replica.url)
        if self.reconciler.observe(replica, gauges):
            self._dispatch()

    @property
    def drift(self) -> Counter[tuple[str, str]]:
        return self.reconciler.drift

    # --- the ledger (`leases.py`) ------------------------------------------------------------

    def _degraded_changed(self) -> None:
        for replica in self.replicas:
            replica.cap = self._cap(replica)
        if self.degraded:
            log.error("pool %s: the slot ledger is unreachable; the replicas' caps here: %s",
                      self.name, {r.url: r.cap for r in self.replicas})  # fmt: skip
        else:
            log.warning("pool %s: the slot ledger is back; caps are shared again", self.name)
            self._dispatch()

    async def share(self) -> None:
        """Renew this gateway's leases and trade queue depths with the others (`Leases.share`)."""
        if self.leases is not None:
            await self.leases.share(self.replicas, self.queue.waiting_by_tier)

    async def close(self) -> None:
        """Stop dispatching and let the releases under way reach the ledger."""
        self._closed = True
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        await self.picker.close()
        if self.leases is not None:
            await self.leases.drain()

    # --- taking and giving back slots ------------------------------------------------------

    def _pick(self, replicas: Sequence[Replica], claim: Claim) -> Replica | None:
        """The one place the picker is asked. A LoRA request goes only to replicas that list its
        adapter, if any does: vLLM answers 404 for an adapter it has not loaded (one with a
        runtime resolver may load it, so a pool where no replica lists it still tries). A
        request pinned to a replica (a stored response's holder) waits for that one's room."""
        if claim.replica:
            replicas = [r for r in replicas if r.url == claim.replica]
        if claim.adapter:
            having = [r for r in replicas if claim.adapter in r.adapters]
            if having:
                replicas = having
        if claim.objective is None or self.latency is None:
            return self.picker.pick(replicas, claim)
        return self._pick_by_headroom(replicas, claim, self.latency)

    def _pick_by_headroom(
        self, replicas: Sequence[Replica], claim: Claim, latency: LatencyModel
    ) -> Replica | None:
        """Of the replicas with room, the one predicted to leave the most headroom under the
        request's objective. When none would meet it, a sheddable request is refused now
        (`SloUnreachable`, with the best prediction): late, it would only cost the requests
        that can still meet theirs. Any other takes the one that misses by least: it waits in
        the queue only for room, as every request does, never for a prediction to improve."""
        objective = claim.objective
        assert objective is not None
        now = time.perf_counter()
        best = self._best([r for r in replicas if r.fits(claim)], claim, latency, now)
        if best is None:
            return None
        replica, room, predicted = best
        if room < 0 and claim.priority == SHEDDABLE:
            raise self._unreachable(objective, predicted, now)
        return replica

    def _best(
        self, replicas: Sequence[Replica], claim: Claim, latency: LatencyModel, at: float
    ) -> tuple[Replica, float, Prediction] | None:
        """Of `replicas`, the one predicted to leave `claim` the most headroom under its
        objective at time `at`, with that headroom and the prediction; None without replicas.
        Any replica beats none, even at a headroom of -inf (an objective no prediction can be
        measured against)."""
        objective = claim.objective
        assert objective is not None
        cached = self.picker.cached_share
        best: tuple[Replica, float, Prediction] | None = None
        for replica in replicas:
            prediction = latency.predict(replica, claim, cached(replica, claim))
            room = prediction.headroom(objective, at)
            if best is None or room > best[1]:
                best = (replica, room, prediction)
        return best

    def _unreachable(
        self, objective: Objective, predicted: Prediction, now: float, wait_s: float = 0.0
    ) -> SloUnreachable:
        asked, ttft = [], wait_s + predicted.ttft_s
        if objective.ttft_s != math.inf:
            asked.append(
                f"TTFT {1000 * (now + ttft - objective.deadline + objective.ttft_s):.0f} ms"
                f" against {1000 * objective.ttft_s:.0f} ms"
            )
        if objective.tpot_s != math.inf:
            asked.append(
                f"TPOT {1000 * predicted.tpot_s:.0f} ms against {1000 * objective.tpot_s:.0f} ms"
            )
        return SloUnreachable(
            f"pool {self.name}: no replica is predicted to meet this request's objective"
            f" (at best {', '.join(asked)}); sheddable requests are refused rather than served"
            " late",
            retry_after_s=max(self.spec.queue.retry_after_s, wait_s),
        )

    def _take_here(self, claim: Claim) -> Grant | None:
        """Without a shared ledger: a slot at once on one of the replicas, or None. Not a
        coroutine, so a request admitted at once pays for no await it does not need."""
        replica = self._pick(self.replicas, claim)
        if replica is None:
            return None
        replica.take(claim)
        return Grant(replica, claim)

    def _ask(self, replica: Replica, claim: Claim) -> SlotClaim:
        """The lease `claim` takes on `replica`: against its class's reservation, if it has one."""
        workload = claim.workload if claim.workload in self.queue.groups else ""
        return SlotClaim(
            PoolReplica(self.name, replica.url),
            workload,
            self._reservations,
            replica.max_concurrency,
        )

    def release(self, grant: Grant) -> None:
        grant.replica.untake(grant.claim)
        if grant.lease is None or self.leases is None:
            self._dispatch()
            return
        self.leases.release(grant.replica, grant.lease)

    def preempt(self, replica: Replica, claim: Claim) -> bool:
        """For a critical `claim` predicted to miss its objective on `replica`: cancel the
        newest sheddable request in flight there, within the pool's pace (`preempt.py`). True
        when one was cancelled: its slot comes back as it releases, so the caller then waits
        for it in the queue. The replica did nothing wrong: no ejection counts it."""
        preemption = self.preemption
        if preemption is None or claim.priority != CRITICAL:
            return False
        victim = preemption.preempt(replica.url)
        if victim is None:
            return False
        tier = PRIORITIES[victim.priority]
        self.preemptions[tier] += 1
        log.info("pool %s: a %s request that had run %.3fs on %s was preempted for a critical one",
                 self.name, tier, time.perf_counter() - victim.granted, replica.url)  # fmt: skip
        return True

    # --- dispatching, refusing, waiting ------------------------------------------------------

    def _dispatch(self) -> None:
        if not self.waiting:  # the common case, on every release
            return
        if self.leases is None:
            while True:
                for head, replicas in self.queue.heads(self.replicas):
                    try:
                        replica = self._pick(replicas, head.claim)
                    except SloUnreachable as exc:  # its turn came too late
                        self.queue.leave(head)
                        head.future.set_exception(exc)
                        break
                    if replica is not None:  # the granted waiter leaves the heap at its top
                        replica.take(head.claim)
                        self.queue.grant(head, Grant(replica, head.claim))
                        break
                else:
                    return  # strict order within a group: its head waits, nobody overtakes it
        if not self._closed and (self._dispatcher is None or self._dispatcher.done()):
            self._dispatcher = asyncio.get_running_loop().create_task(
                self._dispatch_leased(self.leases), name=f"dispatch:{self.name}"
            )

    async def _dispatch_leased(self, shared: Leases) -> None:
        while heads := self.queue.heads(self.replicas):
            for head, replicas in heads:
                if shared.outranked(head.priority):
                    continue
                try:
                    grant = await shared.take(self._pick, self._ask, head.claim, replicas)
                except Exception as exc:  # failed closed (or a bug): so does the head, alone
                    if not isinstance(exc, GatewayError):
                        log.exception("pool %s: dispatching a waiter failed", self.name)
                    if not head.future.done():
                        self.queue.leave(head)
                        head.future.set_exception(exc)
                    break
                if grant is not None:
                    if head.future.done():  # abandoned while its lease was asked for
                        self.release(grant)
                    else:
                        self.queue.grant(head, grant)
                    break
            else:
                await asyncio.sleep(leases.POLL_S * (0.5 + random.random()))

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

    def _fail_fast(self, claim: Claim, group: int) -> None:
        """Refuse now a request that would confidently wait past `max_wait_s` (`Queue.over_wait`);
        the point estimate of its wait is the Retry-After."""
        max_wait = self.spec.queue.max_wait_s
        over = self.queue.over_wait(claim, group, max_wait, lambda: self._draining(group))
        if over is not None:
            place, predicted = over
            raise QueueWaitTooLong(
                f"pool {self.name}: the predicted wait for a slot, {predicted:.0f}s"
                f" ({place} in line at the measured drain rate), is over {max_wait:g}s",
                retry_after_s=predicted,
            )

    def _preempt_for(self, claim: Claim, latency: LatencyModel) -> None:
        """A critical request, on its first attempt, predicted to miss its objective on every
        replica (room or not): the newest sheddable request on the one it misses by least is
        cancelled (`preempt`), so it runs there with a lighter batch, or takes the slot that
        frees. Once, not at each dispatch: a request waiting for that slot asks no more."""
        if claim.objective is None:
            return
        up = [r for r in self.replicas if r.up]
        best = self._best(up, claim, latency, time.perf_counter())
        if best is not None and best[1] < 0:
            self.preempt(best[0], claim)

    def _reachable_after_wait(
        self, claim: Claim, objective: Objective, latency: LatencyModel
    ) -> None:
        """A sheddable request with no room now: refused at once if, after its predicted wait
        for a slot, no replica is predicted to meet its objective (nothing is refused on a wait
        not yet measured)."""
        wait_s = self.predicted_wait(claim.workload)
        if wait_s is None:
            return
        now = time.perf_counter()
        up = [r for r in self.replicas if r.up]
        best = self._best(up, claim, latency, now + wait_s)
        if best is not None and best[1] < 0:
            raise self._unreachable(objective, best[2], now, wait_s)

    def predicted_wait(self, workload: str) -> float | None:
        """The wait a new request of class `workload` would have for a slot here: 0 with a slot
        free and nobody of its group waiting, else its place at the back of the line over the
        measured drain rate (fail-fast's point estimate); None before enough hold times."""
        group = self.queue.group(workload)
        waiting = self.queue.waiting_by_group[group]
        if waiting == 0 and self.saturation < 1.0:
            return 0.0
        measured = self.queue.holds[group].mean()
        if measured is None:
            return None
        return (waiting + 1) * measured[0] / self._draining(group)

    def _draining(self, group: int) -> float:
        """The slots that drain `group`'s queue: those its classes hold; with a ledger, every
        gateway's, in this queue's share of all the waiters."""
        slots: float = self.queue.in_use(group, self.replicas)
        if self.leases is not None and not self.degraded and not self.queue.groups:
            # Shared slots drain to every gateway's waiters: this queue gets its share of them.
            busy = sum(max(r.inflight, r.shared or 0) for r in self.replicas)
            here = self.waiting + 1
            slots = busy * here / (here + self.others_waiting)
        return max(1.0, slots)

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
        bounds = self.spec.queue
        place.deadline = asyncio.get_running_loop().time() + bounds.max_wait_s
        if self.spec.shed:
            self._shed(claim.priority)
        if claim.priority == CRITICAL and self.preemption is not None and self.latency:
            self._preempt_for(claim, self.latency)
        if self.queue.waiting_by_group[self.queue.group(claim.workload)] == 0 and (
            self.leases is None or not self.leases.outranked(claim.priority)
        ):  # else it queues behind them
            grant = (
                self._take_here(claim)
                if self.leases is None
                else await self.leases.take(self._pick, self._ask, claim, self.replicas)
            )
            if grant is not None:
                self.queue.stand(claim, place)
                return grant
        if claim.objective is not None and claim.priority == SHEDDABLE and self.latency:
            self._reachable_after_wait(claim, claim.objective, self.latency)
        if self.waiting >= self.max_depth:
            raise QueueFull(
                f"pool {self.name} is at capacity and its queue is full ({self.max_depth})",
                retry_after_s=bounds.retry_after_s,
            )
        if bounds.fail_fast:
            self._fail_fast(claim, self.queue.group(claim.workload))
        return None

    async def _wait(self, claim: Claim, place: Place) -> Grant:
        group = self.queue.group(claim.workload)  # after the awaits: a reload may regroup
        waiter = self.queue.enqueue(claim, group, place)
        self._dispatch()  # a higher priority than the current head may fit at once
        future = waiter.future
        granted = False
        try:
            with Deadline(place.deadline):
                grant = await future
            granted = True
            return grant
        except TimeoutError:
            bounds = self.spec.queue
            raise QueueTimeout(
                f"pool {self.name} had no free slot within {bounds.max_wait_s:g}s",
                retry_after_s=bounds.retry_after_s,
            ) from None
        finally:
            if not future.done():
                future.cancel()
            if future.cancelled():
                self.queue.leave(waiter)
                self._dispatch()  # the waiter behind an abandoned head may fit
            elif not granted and future.exception() is None:
                # Granted in the same tick as the time-out or cancellation: hand it back.
                self.release(future.result())

    def slot(self, ctx: Ctx, place: Place) -> Held:
        """Hold a slot for `ctx` over an `async with`; `place` is its standing, new on its first
        attempt."""
        return Held(self, ctx, place)


class Held:
    """A slot held over an `async with` (`LivePool.slot`).

    A class rather than an `@asynccontextmanager`: the event loop registers every async
    generator in a WeakSet for its shutdown, and that, with contextlib's wrapping, was about a
    third of what taking and giving back a slot cost per request.
    """

    __slots__ = ("_ctx", "_flight", "_grant", "_held", "_inflight", "_place", "_pool")
    _grant: Grant  # set once a slot is taken: `__aexit__` runs only after `__aenter__` returned

    def __init__(self, pool: LivePool, ctx: Ctx, place: Place) -> None:
        self._pool, self._ctx, self._place = pool, ctx, place
        self._held = 0.0
        self._flight: Flight | None = None
        # Where the request is registered for preemption, and by which registry: the pool's
        # may be replaced by a reload while it runs.
        self._inflight: tuple[Preemption, InFlight] | None = None

    async def __aenter__(self) -> Grant:
        pool, ctx, place = self._pool, self._ctx, self._place
        if ctx.affinity is None:  # a retry weighs what the first attempt worked out
            ctx.affinity = await pool.picker.affinity(ctx)
        claim = Claim.of(ctx, ctx.affinity)
        pool.demand.arrivals += place.tag is None
        started = time.perf_counter()
        grant: Grant | None = None
        try:
            grant = await pool.acquire(claim, place)
        except GatewayError as exc:
            # Refused for want of room: demand the autoscaler must see. Asked of the refusal,
            # not of a list of classes here, so a new such refusal counts where it is named.
            if exc.refusal.counts_as_demand:
                pool.demand.refused += 1
            raise
        finally:
            # The wait for a slot: ~0 for a request served at once; none at all for one refused
            # before it queued, which is no sample of how long the queue makes requests wait.
            if grant is not None or place.queued:
                waited = time.perf_counter() - started
                ctx.queue_wait = (ctx.queue_wait or 0.0) + waited
                pool.demand.queued_s += waited
        ctx.replica = grant.replica.url
        self._grant = grant
        self._held = ctx.granted = time.perf_counter()
        try:  # from here the slot is held: whatever fails gives it back (`__aexit__`)
            if pool.latency is not None:
                cached = pool.picker.cached_share(grant.replica, grant.claim)
                flight, ctx.predicted = pool.latency.admitted(
                    grant.replica, grant.claim, cached, ctx.stream
                )
                ctx.prefill = self._flight = flight
            pool.picker.granted(grant.replica, grant.claim)
            if (preemption := pool.preemption) is not None:
                inflight = preemption.enter(grant.replica.url, self._held, grant.claim.priority)
                self._inflight, ctx.cancel = (preemption, inflight), inflight.cancel
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return grant

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        pool, grant = self._pool, self._grant
        if self._inflight is not None:
            preemption, inflight = self._inflight
            preemption.leave(inflight)
            self._inflight = self._ctx.cancel = None  # a retry registers anew
        hold_s = time.perf_counter() - self._held
        pool.demand.busy_s += hold_s
        pool.queue.holds[pool.queue.group(grant.claim.workload)].add(hold_s)
        if self._flight is not None:  # on the model that took it, whatever a reload did since
            self._flight.replica.model.released(self._flight)
        pool.release(grant)
