"""The `picker` extension point: which of a pool's replicas with room takes a request.

The pool calls `picker.pick(replicas, claim)` in one place (`LivePool._pick`); a picker only
orders replicas that fit, so the caps stay hard whatever it prefers. The pool tells it too when
a slot is held (`granted`) and when the replica answered (`observe`, `LivePool.answered`), so a
picker that learns from where requests went, or from how they came back, needs no other hook. A pool's `pick:` makes a
weighted picker of its own (`gateway/pick/`); these are the policy-wide ones it replaces.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from gateway.config.plugins import register

if TYPE_CHECKING:
    from gateway.admit.claim import Claim
    from gateway.admit.replica import Replica
    from gateway.errors import Ejection
    from gateway.pick.affinity import Affinity
    from gateway.request.context import Ctx


class Picker(Protocol):
    """Chooses among replicas that have room."""

    reads_gauges: bool
    """It rates the replicas' scraped gauges: the health checker reads them more often."""

    async def affinity(self, ctx: Ctx) -> Affinity | None:
        """What `pick` will weigh of the request, worked out once, before it queues."""

    def pick(self, replicas: Sequence[Replica], claim: Claim) -> Replica | None: ...

    def granted(self, replica: Replica, claim: Claim) -> None:
        """A slot on `replica` is held for `claim`: a picker that learns, learns here."""

    def observe(self, replica: Replica, claim: Claim, ctx: Ctx, failure: Ejection | None) -> None:
        """`replica` answered the request `claim` was held for (`failure`: how it failed, else
        None): a picker that learns from responses, learns here."""

    def forget(self, url: str) -> None:
        """The replica left, or came back after an ejection: what was learned of it is void."""

    async def close(self) -> None:
        """The pool stopped using it: what it runs in the background stops."""


class StatelessPicker:
    """A picker that weighs nothing of the request and learns nothing."""

    reads_gauges = False

    def __init__(self, params: object) -> None:
        pass

    async def affinity(self, ctx: Ctx) -> Affinity | None:
        return None

    def granted(self, replica: Replica, claim: Claim) -> None:
        pass

    def observe(self, replica: Replica, claim: Claim, ctx: Ctx, failure: Ejection | None) -> None:
        pass

    def forget(self, url: str) -> None:
        pass

    async def close(self) -> None:
        pass


@register("picker", "least-inflight")
class LeastInflightPicker(StatelessPicker):
    """Fewest requests in flight, then fewest in-flight tokens, then list order."""

    def pick(self, replicas: Sequence[Replica], claim: Claim) -> Replica | None:
        best: Replica | None = None
        best_key = (0, 0)
        for replica in replicas:
            if not replica.fits(claim):
                continue
            key = (replica.load, replica.inflight_tokens)
            if best is None or key < best_key:
                best, best_key = replica, key
        return best


@register("picker", "round-robin")
class RoundRobinPicker(StatelessPicker):
    """The next replica with room, in turn: a Kubernetes Service's best case, kept behind the
    same caps and queue, for comparing pickers."""

    def __init__(self, params: object) -> None:
        self._turn = itertools.count()

    def pick(self, replicas: Sequence[Replica], claim: Claim) -> Replica | None:
        if not replicas:
            return None
        start = next(self._turn)
        for i in range(len(replicas)):
            replica = replicas[(start + i) % len(replicas)]
            if replica.fits(claim):
                return replica
        return None
