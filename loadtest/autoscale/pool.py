"""The simulated Deployment: replicas the HPA asks for, each on its own loopback address.

A replica asked for at simulated time t starts listening (a simulated vLLM server on
127.0.1.N, all on one port, as pods of a headless Service) at t + startup_s, and only then is
published in DNS, as Kubernetes publishes only ready endpoints. Scaling down takes replicas
that are still starting first, then the newest ready ones (a ReplicaSet deletes unready pods
first); a removed replica leaves DNS at once and is stopped once the gateway has re-resolved
and it has nothing in flight: it is drained, not cut off.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from loadtest.sim import Profile, Replica, ReplicaOptions, start_replica

FIRST_HOST = ipaddress.ip_address("127.0.1.1")  # fresh addresses: a new pod gets a new IP
POOL_STRIDE = 256  # the next pool's addresses start a /24 further: 127.0.2.1, 127.0.3.1, ...
DRAIN_POLL_S = 0.05  # wall seconds between "anything still in flight?" checks


@dataclass
class Member:
    """One pod's life in simulated seconds: asked for, ready (serving), removed, gone."""

    pool: str
    host: str
    asked_s: float
    ready_s: float
    started_s: float | None = None  # when it actually began to listen (>= ready_s)
    removed_s: float | None = None
    gone_s: float | None = None
    replica: Replica | None = field(default=None, repr=False)

    @property
    def serving(self) -> bool:
        return self.replica is not None and self.removed_s is None


class SimPool:
    def __init__(
        self,
        name: str,
        first_host: ipaddress.IPv4Address | ipaddress.IPv6Address,
        profile: Profile,
        options: ReplicaOptions,
        port: int,
        startup_s: float,
        clock: Callable[[], float],
        drain_wait_s: float,
        drain_limit_s: float,
    ) -> None:
        """`clock()` is simulated seconds; `drain_wait_s` (wall) is how long a removed
        replica keeps listening at least (the gateway's DNS period, twice), `drain_limit_s`
        (wall) the most its in-flight requests get. Replicas get addresses from `first_host` up."""
        self.name, self.first_host = name, first_host
        self.profile, self.options, self.port = profile, options, port
        self.startup_s, self.clock = startup_s, clock
        self.drain_wait_s, self.drain_limit_s = drain_wait_s, drain_limit_s
        self.members: list[Member] = []
        self._drains: set[asyncio.Task[None]] = set()

    def _next_host(self) -> str:
        return str(self.first_host + len(self.members))

    @property
    def current(self) -> int:
        """The Deployment's replicas: every pod not being removed, ready or not."""
        return sum(m.removed_s is None for m in self.members)

    @property
    def ready(self) -> int:
        return sum(m.serving for m in self.members)

    def addresses(self) -> list[str]:
        """What the headless Service publishes: the ready replicas."""
        return [m.host for m in self.members if m.serving]

    async def start_ready(self, count: int) -> None:
        """`count` replicas that are already up at time 0 (the pool before the run)."""
        for _ in range(count):
            member = Member(self.name, self._next_host(), 0.0, 0.0)
            self.members.append(member)
            await self._start(member, at_s=0.0)  # the clock starts with the load, after this

    async def _start(self, member: Member, at_s: float | None = None) -> None:
        member.replica = await start_replica(
            self.profile, self.options, host=member.host, port=self.port
        )
        member.started_s = self.clock() if at_s is None else at_s

    def scale_to(self, replicas: int) -> None:
        now = self.clock()
        for _ in range(replicas - self.current):
            self.members.append(Member(self.name, self._next_host(), now, now + self.startup_s))
        for _ in range(self.current - replicas):
            live = [m for m in self.members if m.removed_s is None]
            starting = [m for m in live if m.replica is None]
            victim = (starting or live)[-1]
            victim.removed_s = now
            if victim.replica is None:
                victim.gone_s = now  # a pod deleted before it was ready never served
            else:
                task = asyncio.create_task(self._drain(victim))
                self._drains.add(task)
                task.add_done_callback(self._drains.discard)

    async def step(self) -> None:
        """Start the replicas whose start-up time has passed."""
        now = self.clock()
        for member in self.members:
            if member.replica is None and member.removed_s is None and member.ready_s <= now:
                await self._start(member)

    async def _drain(self, member: Member) -> None:
        assert member.replica is not None
        engine = member.replica.engine
        await asyncio.sleep(self.drain_wait_s)
        for _ in range(math.ceil(self.drain_limit_s / DRAIN_POLL_S)):  # the engine has no event
            if not engine.scheduler.has_work():
                break
            await asyncio.sleep(DRAIN_POLL_S)
        await member.replica.close()
        member.gone_s = self.clock()

    async def close(self) -> None:
        """Stop everything: drains in progress end now, live replicas are closed."""
        for task in list(self._drains):
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        now = self.clock()
        for member in self.members:
            if member.gone_s is None:
                if member.replica is not None:
                    await member.replica.close()
                member.gone_s = now
