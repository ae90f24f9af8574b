"""Stage 6, admit: hold a slot on one replica while the request runs, or wait for one, or refuse.

A replica takes a request while it is under `max_concurrency` in-flight requests and, when set,
`max_inflight_tokens` (input + expected output of what it runs). When no replica has room, the
request waits in its pool's bounded queue, ordered by priority, FIFO within a priority. Release is
synchronous and sits in the `finally` of `slot()`, so a disconnect, a time-out or a cancellation
can never leak a slot; a released slot goes straight to the head of the queue.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from gateway.context import Ctx
from gateway.errors import NoReplica, QueueFull, QueueTimeout, Shed
from gateway.policy.plugins import register
from gateway.policy.schema import PRIORITIES, PoolSpec

log = logging.getLogger("gateway.admit")


class Replica:
    """One upstream vLLM server, what this gateway has running on it, and its health."""

    __slots__ = (
        "drift_strikes",
        "ejected_until",
        "ejections",
        "failures",
        "inflight",
        "inflight_tokens",
        "leases",
        "max_concurrency",
        "max_tokens",
        "observed",
        "slow_since",
        "tpot",
        "url",
    )

    def __init__(self, url: str, max_concurrency: int, max_tokens: int | None) -> None:
        self.url = url
        self.max_concurrency = max_concurrency
        self.max_tokens = max_tokens
        self.inflight = 0
        self.inflight_tokens = 0
        self.failures = 0  # consecutive failed requests or probes
        self.ejections = 0  # times ejected so far: each ejection lasts longer
        self.ejected_until: float | None = None  # None: in the pool
        self.leases = 0  # slots handed out by `slot()` and not yet given back
        self.observed: int | None = None  # the replica's own running + waiting, last scraped
        self.drift_strikes = 0  # scrapes in a row that found this gateway's count too high
        self.tpot: float | None = None  # moving average of its streams' time per output token
        self.slow_since: float | None = None  # since when it decodes slower than its peers

    @property
    def up(self) -> bool:
        return self.ejected_until is None

    def fits(self, tokens: int) -> bool:
        if self.ejected_until is not None or self.inflight >= self.max_concurrency:
            return False
        # A request larger than the token cap on its own still runs, alone, on an idle replica.
        return (
            self.max_tokens is None
            or self.inflight == 0
            or self.inflight_tokens + tokens <= self.max_tokens
        )


class Picker(Protocol):
    """Chooses among replicas that have room; one instance per policy."""

    def pick(self, replicas: Sequence[Replica], tokens: int) -> Replica | None: ...


@register("picker", "least-inflight")
class LeastInflightPicker:
    """Fewest requests in flight, then fewest in-flight tokens, then list order."""

    def __init__(self, params: object) -> None:
        pass

    def pick(self, replicas: Sequence[Replica], tokens: int) -> Replica | None:
        best: Replica | None = None
        best_key = (0, 0)
        for replica in replicas:
            if not replica.fits(tokens):
                continue
            # What the replica itself last reported counts too: other gateways may share it.
            load = max(replica.inflight, replica.observed or 0)
            key = (load, replica.inflight_tokens)
            if best is None or key < best_key:
                best, best_key = replica, key
        return best


class _Waiter:
    __slots__ = ("future", "priority", "seq", "tokens")

    def __init__(self, priority: int, seq: int, tokens: int, future: asyncio.Future[Replica]):
        self.priority = priority
        self.seq = seq
        self.tokens = tokens
        self.future = future

    def __lt__(self, other: _Waiter) -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)


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

    def __init__(self, name: str, spec: PoolSpec, picker: Picker) -> None:
        self.name = name
        self.spec = spec
        self.picker = picker
        self.replicas = [
            Replica(url, spec.max_concurrency, spec.max_inflight_tokens) for url in spec.replicas
        ]
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self.waiting = 0  # live waiters; the heap may also hold abandoned ones
        self.retrying = 0  # retries in flight, against the retry budget
        self.ejections: Counter[tuple[str, str]] = Counter()  # (replica, reason) -> count
        self.demand = Demand()
        self.drift: Counter[tuple[str, str]] = Counter()  # (replica, kind) -> scrapes
        self.sheds: Counter[str] = Counter()  # tier -> requests shed

    def update(self, spec: PoolSpec, picker: Picker) -> None:
        """Take a reloaded pool spec. Replicas that stay keep their counts and health; new ones
        join; those that left take no new request, and the requests they run release on them."""
        known = {r.url: r for r in self.replicas}
        self.replicas = [known.get(url) or Replica(url, 0, None) for url in spec.replicas]
        for replica in self.replicas:
            replica.max_concurrency = spec.max_concurrency
            replica.max_tokens = spec.max_inflight_tokens
        self.spec = spec
        self.picker = picker
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

    def can_retry(self, tokens: int, avoid: frozenset[str]) -> bool:
        """Within the retry budget, and another replica has a free slot right now."""
        retry = self.spec.retry
        budget = max(retry.min_concurrent, retry.budget_percent / 100 * self.inflight)
        if self.retrying >= budget:
            return False
        others = [r for r in self.replicas if r.url not in avoid]
        return self.picker.pick(others, tokens) is not None

    def take_other(self, tokens: int, avoid: frozenset[str]) -> Replica:
        """A slot on a replica not in `avoid`, at once; `can_retry` said there is one."""
        replica = self.picker.pick([r for r in self.replicas if r.url not in avoid], tokens)
        if replica is None:
            raise NoReplica(f"pool {self.name} has no other free replica", retry_after_s=1)
        return self._take(replica, tokens)

    def _take(self, replica: Replica, tokens: int) -> Replica:
        replica.inflight += 1
        replica.leases += 1
        replica.inflight_tokens += tokens
        return replica

    def release(self, replica: Replica, tokens: int) -> None:
        replica.inflight -= 1
        replica.leases -= 1
        replica.inflight_tokens -= tokens
        self._dispatch()

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

    def _dispatch(self) -> None:
        heap = self._heap
        while heap:
            head = heap[0]
            if head.future.done():  # abandoned (timed out or cancelled): drop it
                heapq.heappop(heap)
                continue
            replica = self.picker.pick(self.replicas, head.tokens)
            if replica is None:
                return  # strict order: the head waits, nobody overtakes it
            heapq.heappop(heap)
            self.waiting -= 1
            head.future.set_result(self._take(replica, head.tokens))

    @property
    def saturation(self) -> float:
        """(In flight + waiting) / capacity: 1.0 is every slot busy and nobody waiting."""
        return (self.inflight + self.waiting) / max(1, self.capacity)

    def _shed(self, priority: int) -> None:
        tier = PRIORITIES[priority]
        threshold = self.spec.shed.get(tier)  # type: ignore[call-overload]
        if threshold is not None and self.saturation >= threshold:
            self.sheds[tier] += 1
            raise Shed(
                f"pool {self.name} is saturated ({self.saturation:.2f} >= {threshold:g}):"
                f" {tier} requests are shed first",
                retry_after_s=self.spec.queue.retry_after_s,
            )

    async def acquire(self, priority: int, tokens: int) -> Replica:
        if not self.replicas:
            raise NoReplica(f"pool {self.name} has no replica", retry_after_s=5)
        if self.spec.shed:
            self._shed(priority)
        if self.waiting == 0:
            replica = self.picker.pick(self.replicas, tokens)
            if replica is not None:
                return self._take(replica, tokens)
        queue = self.spec.queue
        if self.waiting >= self.max_depth:
            raise QueueFull(
                f"pool {self.name} is at capacity and its queue is full ({self.max_depth})",
                retry_after_s=queue.retry_after_s,
            )
        future: asyncio.Future[Replica] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, _Waiter(priority, next(self._seq), tokens, future))
        self.waiting += 1
        self._dispatch()  # a higher priority than the current head may fit at once
        granted = False
        try:
            async with asyncio.timeout(queue.max_wait_s):
                replica = await future
            granted = True
            return replica
        except TimeoutError:
            raise QueueTimeout(
                f"pool {self.name} had no free slot within {queue.max_wait_s:g}s",
                retry_after_s=queue.retry_after_s,
            ) from None
        finally:
            if not future.done():
                future.cancel()
            if future.cancelled():
                self.waiting -= 1
                self._dispatch()  # the waiter behind an abandoned head may fit
            elif not granted:
                # Granted in the same tick as the time-out or cancellation: hand it back.
                self.release(future.result(), tokens)

    @asynccontextmanager
    async def slot(self, ctx: Ctx, avoid: frozenset[str] = frozenset()) -> AsyncIterator[Replica]:
        """Hold a slot for `ctx`; with `avoid` (a retry), only on another replica and at once."""
        tokens = ctx.reserved_tokens
        if avoid:
            replica = self.take_other(tokens, avoid)
        else:
            started = time.perf_counter()
            self.demand.arrivals += 1
            try:
                replica = await self.acquire(ctx.priority, tokens)
            except (QueueFull, QueueTimeout, Shed):
                self.demand.refused += 1
                raise
            finally:
                ctx.queue_wait = time.perf_counter() - started
                self.demand.queued_s += ctx.queue_wait
        ctx.replica = replica.url
        held = time.perf_counter()
        try:
            yield replica
        finally:
            self.demand.busy_s += time.perf_counter() - held
            self.release(replica, tokens)
