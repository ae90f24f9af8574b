"""A pool's queue: strictly by tier, and within a tier by weighted fair share of the tokens each
tenant is served (start-time fair queuing), so a tenant flooding the queue cannot starve another
of its tier. Within a tenant's flow of a tier, requests with a latency objective go in deadline
order (EDF; those without one last): a tenant's tight deadlines reorder only its own turns, as
llm-d's flow control orders each flow's queue and shares between flows. One queue per reservation
group: slots a class keeps are no use to the others, so a
waiter that fits them passes the head of another group, never one of its own, but for a head that
needs an idle replica (`Queue.heads`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable, Sequence

from gateway.admit.claim import Claim
from gateway.admit.demand import HoldTimes
from gateway.admit.replica import Grant, Replica
from gateway.config.schema import PRIORITIES


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


class Waiter:
    """A request in the queue: what it claims, the future its grant arrives on, and its ticket,
    the place in the heap it is served from (swapped within its flow, `Queue._earliest`)."""

    __slots__ = ("avoid", "claim", "deadline", "future", "group", "priority", "queued", "ticket")

    def __init__(
        self, claim: Claim, group: int, place: Place, future: asyncio.Future[Grant]
    ) -> None:
        self.claim = claim
        self.group = group  # its class's reservation group: 0, or 1 + the reserved class's index
        self.priority = claim.priority
        self.avoid = place.avoid  # a retry is never placed on a replica that refused it
        self.future = future
        self.queued = True  # counted in the queue; its future may be done before it leaves
        objective = claim.objective
        self.deadline = math.inf if objective is None else objective.deadline
        self.ticket: Ticket

    @property
    def tag(self) -> float:
        return self.ticket.tag

    @property
    def flow(self) -> tuple[int, str, int]:
        return (self.priority, self.claim.tenant, self.group)


class Ticket:
    """A place in a group's heap: strict by tier, then fair share (the start tag), then
    arrival; held by one waiter of its flow at a time."""

    __slots__ = ("priority", "seq", "tag", "waiter")

    def __init__(self, waiter: Waiter, tag: float, seq: int) -> None:
        self.priority = waiter.priority
        self.tag = tag
        self.seq = seq
        self.waiter = waiter
        waiter.ticket = self

    def __lt__(self, other: Ticket) -> bool:
        return (self.priority, self.tag, self.seq) < (other.priority, other.tag, other.seq)


class Queue:
    """The waiters of one pool, their fair-share tags, and each group's hold times."""

    def __init__(self) -> None:
        self.heaps: list[list[Ticket]] = [[]]
        self._seq = itertools.count()
        self.waiting_by_group = [0]  # live waiters; the heaps also hold abandoned and granted ones
        self.waiting_by_tier = [0] * len(PRIORITIES)
        self._vtime = [0.0] * len(PRIORITIES)  # per tier: the start tag last dispatched
        # (tier, tenant) -> the virtual time its last request queued finishes: kept after it
        # is served (a tenant that keeps one request waiting at a time still pays for each),
        # and bounded by the policy's tenants.
        self._finish: dict[tuple[int, str], float] = {}
        self.holds = [HoldTimes()]  # per reservation group: they drain at their own pace
        self.groups: dict[str, int] = {}  # reserved class -> its group
        # (tier, tenant, group) -> its waiters with an objective, by deadline (`_earliest`)
        self._edf: dict[tuple[int, str, int], list[tuple[float, int, Waiter]]] = {}

    @property
    def waiting(self) -> int:
        return sum(self.waiting_by_group)

    def group(self, workload: str) -> int:
        return self.groups.get(workload, 0)

    def regroup(self, groups: dict[str, int]) -> None:
        """New reservations (a reload): the waiters move to their classes' new queues."""
        self.groups = groups
        # Every waiter not yet left, even one whose future is done: its `leave` is still to run.
        live = [t for heap in self.heaps for t in heap if t.waiter.queued]
        self.heaps = [[] for _ in range(len(groups) + 1)]
        self.waiting_by_group = [0] * len(self.heaps)
        self.holds = [HoldTimes() for _ in self.heaps]
        self._edf.clear()
        for ticket in live:
            waiter = ticket.waiter
            waiter.group = groups.get(waiter.claim.workload, 0)
            self.waiting_by_group[waiter.group] += 1
            heapq.heappush(self.heaps[waiter.group], ticket)
            if waiter.deadline != math.inf:
                self._by_deadline(waiter)

    def start_tag(self, claim: Claim) -> float:
        """Where a tenant's next request starts in its tier's virtual time: where its last one
        finishes, or now if that is past (an idle tenant banks no credit)."""
        now = self._vtime[claim.priority]
        return max(now, self._finish.get((claim.priority, claim.tenant), now))

    def stand(self, claim: Claim, place: Place) -> None:
        """Give a request served at once its standing, should a replica refuse it: unpaid."""
        place.tag, place.seq = self.start_tag(claim), next(self._seq)

    def enqueue(self, claim: Claim, group: int, place: Place) -> Waiter:
        """Queue at `place`, or, the first time, with a start tag: then the request costs its
        tokens over its tenant's weight."""
        tier = claim.priority
        tag = place.tag
        if tag is None:
            tag = self.start_tag(claim)
            place.tag, place.seq = tag, next(self._seq)
            self._finish[(tier, claim.tenant)] = tag + max(1, claim.tokens) / claim.weight
        place.queued = True
        future: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        waiter = Waiter(claim, group, place, future)
        heapq.heappush(self.heaps[group], Ticket(waiter, tag, place.seq))
        if claim.objective is not None:
            self._by_deadline(waiter)
        self.waiting_by_tier[tier] += 1
        self.waiting_by_group[group] += 1
        return waiter

    def leave(self, waiter: Waiter) -> None:
        waiter.queued = False
        self.waiting_by_tier[waiter.priority] -= 1
        self.waiting_by_group[waiter.group] -= 1
        if waiter.deadline != math.inf and (flow := self._edf.get(waiter.flow)) is not None:
            while flow and not flow[0][2].queued:  # mostly served in deadline order: at the top
                heapq.heappop(flow)
            if not flow:
                del self._edf[waiter.flow]

    def grant(self, waiter: Waiter, grant: Grant) -> None:
        self.leave(waiter)
        tier = waiter.priority
        self._vtime[tier] = max(self._vtime[tier], waiter.tag)
        waiter.future.set_result(grant)

    def ahead(self, claim: Claim, group: int) -> int:
        """The place `claim` would take in its group's queue, itself included: behind every live
        waiter of a higher tier or an earlier start tag."""
        mine = (claim.priority, self.start_tag(claim))
        return 1 + sum(
            1
            for t in self.heaps[group]
            if not t.waiter.future.done() and (t.priority, t.tag) <= mine
        )

    def in_use(self, group: int, replicas: Sequence[Replica]) -> int:
        """The slots `group`'s classes hold on `replicas`: what drains its queue."""
        if group:
            workload = next(w for w, g in self.groups.items() if g == group)
            return sum(r.by_class.get(workload, 0) for r in replicas)
        inflight = sum(r.inflight for r in replicas)
        return inflight - sum(r.by_class.get(w, 0) for r in replicas for w in self.groups)

    def over_wait(
        self, claim: Claim, group: int, max_wait: float, draining: Callable[[], float]
    ) -> tuple[int, float] | None:
        """`claim`'s place in its group's queue and its predicted wait, if it would confidently
        wait past `max_wait`: its place (itself included) over the group's drain rate, the
        `draining()` slots over their mean hold time. The lower bound of the hold time decides,
        so a burst that would drain in time is never refused."""
        measured = self.holds[group].mean()
        if measured is None:
            return None
        mean, low = measured
        slots = draining()
        place = self.waiting_by_group[group] + 1  # at most: fair share may put it further up
        if place * low / slots <= max_wait:
            return None
        # Only now, when the bound says it may be refused, count who is really ahead of it.
        place = self.ahead(claim, group)
        if place * low / slots > max_wait:
            return place, place * mean / slots
        return None

    def heads(self, replicas: Sequence[Replica]) -> list[tuple[Waiter, Sequence[Replica]]]:
        """Who may be served next, in dispatch order, and on which of `replicas`: the head of
        each group's queue, on any of them, and behind a head that avoids some (a retry), those
        after it up to the first that avoids none, each only on replicas every waiter before
        it avoids. So no waiter ever passes another to a slot that one could take, but for a
        head that only an idle replica can take (`_passing`)."""
        heads: list[tuple[Waiter, Sequence[Replica]]] = []
        for heap in self.heaps:
            while heap and heap[0].waiter.future.done():  # abandoned, timed out, or granted
                heapq.heappop(heap)
            if heap and self._edf:
                self._earliest(heap[0])
            if heap and heap[0].waiter.avoid:
                heads += self._front(heap, replicas)
            elif heap and (passing := self._passing(heap, replicas)):
                heads += passing
            elif heap:
                heads.append((heap[0].waiter, replicas))
        heads.sort(key=lambda head: head[0].ticket)
        return heads

    def _by_deadline(self, waiter: Waiter) -> None:
        heapq.heappush(self._edf.setdefault(waiter.flow, []), (waiter.deadline, id(waiter), waiter))

    def _earliest(self, head: Ticket) -> None:
        """Deadline order within a flow: the head's ticket goes to the waiter of its flow (its
        tier, tenant and group) whose deadline is earliest, which gives it its own, later one.
        Between flows the tickets keep their fair-share order, so a tenant's tight deadlines
        reorder only its own requests. A retry keeps its place (it avoids some replicas)."""
        waiter = head.waiter
        flow = self._edf.get(waiter.flow)
        if flow is None or waiter.avoid:
            return
        while flow and not flow[0][2].queued:
            heapq.heappop(flow)
        if not flow:
            del self._edf[waiter.flow]
            return
        first = flow[0][2]
        if first.deadline >= waiter.deadline or first.future.done() or first.avoid:
            return
        other = first.ticket
        head.waiter, other.waiter = first, waiter
        first.ticket, waiter.ticket = head, other

    @staticmethod
    def _passing(
        heap: list[Ticket], replicas: Sequence[Replica]
    ) -> list[tuple[Waiter, Sequence[Replica]]]:
        """A head over the token cap on its own runs only on an idle replica: held strictly in
        order, every request behind it waits for a replica to drain, though the others have
        room. So while none is idle the replica nearest idle (fewest in-flight tokens) is kept
        for the head, taking nothing new, and those behind it may pass it to slots they fit on
        the others; the head is still first in line for any replica that goes idle. With one
        replica in service nothing passes: it is the head's. Empty for any other head."""
        head = heap[0].waiter
        up = [r for r in replicas if r.up]
        if len(up) < 2 or not all(r.needs_alone(head.claim) and r.inflight for r in up):
            return []
        kept = min(up, key=lambda r: (r.inflight_tokens, r.inflight))
        others = [r for r in up if r is not kept]
        free = sum(max(0, r.cap - r.inflight) for r in others)  # at most this many pass now
        popped: list[Ticket] = []  # in order, and pushed back: the heap also holds served ones
        front: list[tuple[Waiter, Sequence[Replica]]] = []
        while heap and len(front) <= free:
            popped.append(ticket := heapq.heappop(heap))
            if not ticket.waiter.future.done():
                front.append((ticket.waiter, others if front else replicas))
        for ticket in popped:
            heapq.heappush(heap, ticket)
        return front

    @staticmethod
    def _front(
        heap: list[Ticket], replicas: Sequence[Replica]
    ) -> list[tuple[Waiter, Sequence[Replica]]]:
        """The front of a queue headed by retries (see `heads`): popped in order and pushed
        back, a few at most, as retries in flight are bounded by the retry budget."""
        front: list[tuple[Waiter, Sequence[Replica]]] = []
        popped = []
        left = replicas  # the replicas no waiter before this one takes
        while heap and left:
            ticket = heapq.heappop(heap)
            waiter = ticket.waiter
            if waiter.future.done():
                continue
            popped.append(ticket)
            front.append((waiter, [r for r in left if r.url not in waiter.avoid]))
            left = [r for r in left if r.url in waiter.avoid]
        for ticket in popped:
            heapq.heappush(heap, ticket)
        return front
