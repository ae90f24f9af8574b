"""The policy-wide pickers (`plugins.picker`), implementing admission's `Picker`
(gateway/admit/picking.py). A pool's `pick:` makes a weighted picker of its own
(`gateway/pick/weighted.py`); these are the ones it replaces.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.config.plugins import register

if TYPE_CHECKING:
    from gateway.admit.claim import Claim
    from gateway.admit.replica import Replica
    from gateway.context.affinity import Affinity
    from gateway.context.ctx import Ctx
    from gateway.errors import Ejection


class StatelessPicker:
    """A picker that weighs nothing of the request and learns nothing."""

    reads_gauges = False

    def __init__(self, params: object) -> None:
        pass

    async def affinity(self, ctx: Ctx) -> Affinity | None:
        return None

    def cached_share(self, replica: Replica, claim: Claim) -> float:
        return 0.0

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
