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
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from gateway.context import Ctx
from gateway.errors import NoReplica, QueueFull, QueueTimeout
from gateway.policy.plugins import register
from gateway.policy.schema import PoolSpec


class Replica:
    """One upstream vLLM server and what this gateway has running on it."""

    __slots__ = ("inflight", "inflight_tokens", "max_concurrency", "max_tokens", "url")

    def __init__(self, url: str, max_concurrency: int, max_tokens: int | None) -> None:
        self.url = url
        self.max_concurrency = max_concurrency
        self.max_tokens = max_tokens
        self.inflight = 0
        self.inflight_tokens = 0

    def fits(self, tokens: int) -> bool:
        if self.inflight >= self.max_concurrency:
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
        for replica in replicas:
            if replica.fits(tokens) and (
                best is None
                or (replica.inflight, replica.inflight_tokens)
                < (best.inflight, best.inflight_tokens)
            ):
                best = replica
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

    @property
    def capacity(self) -> int:
        return sum(r.max_concurrency for r in self.replicas)

    def _take(self, replica: Replica, tokens: int) -> Replica:
        replica.inflight += 1
        replica.inflight_tokens += tokens
        return replica

    def release(self, replica: Replica, tokens: int) -> None:
        replica.inflight -= 1
        replica.inflight_tokens -= tokens
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

    async def acquire(self, priority: int, tokens: int) -> Replica:
        if not self.replicas:
            raise NoReplica(f"pool {self.name} has no replica", retry_after_s=5)
        if self.waiting == 0:
            replica = self.picker.pick(self.replicas, tokens)
            if replica is not None:
                return self._take(replica, tokens)
        queue = self.spec.queue
        if self.waiting >= queue.max_depth:
            raise QueueFull(
                f"pool {self.name} is at capacity and its queue is full ({queue.max_depth})",
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
    async def slot(self, ctx: Ctx) -> AsyncIterator[Replica]:
        tokens = ctx.reserved_tokens
        started = time.perf_counter()
        try:
            replica = await self.acquire(ctx.priority, tokens)
        finally:
            ctx.queue_wait = time.perf_counter() - started
        ctx.replica = replica.url
        try:
            yield replica
        finally:
            self.release(replica, tokens)
