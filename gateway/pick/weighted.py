"""The weighted picker a pool's `pick:` configures: filters, weighted scorers, then the best.

As in the Gateway API inference extension's scheduler: the replicas a request may take are
filtered (room under the caps, then load balance), each scorer rates the rest 0..1, the weighted
sums are compared, and ties go to the least loaded. Caps stay hard: a replica without room is
never rated. Affinity never piles load on one replica: only replicas running at most
`max_load_spread` x `max_concurrency` requests more than the least loaded one that fits are
rated at all (Ray Serve's "prefix affinity only while the load is balanced", as a bound), so
however strong a replica's cache match, its load stays within that spread of its peers'.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.pick.affinity import Affinity
from gateway.pick.precise import PrecisePrefixScorer
from gateway.pick.scorers import PrefixScorer, Scorer, SessionScorer, spread_limit
from gateway.policy.plugins import create
from gateway.policy.schema import PickSpec

if TYPE_CHECKING:
    from gateway.admit import Claim, Replica
    from gateway.context import Ctx


class WeightedPicker:
    def __init__(self, spec: PickSpec) -> None:
        self.spec = spec
        self.scorers: list[tuple[float, Scorer]] = [
            (weight, create("scorer", name, parameters))
            for name, (weight, parameters) in spec.weighted().items()
        ]
        self._prefix = next((s for _, s in self.scorers if isinstance(s, PrefixScorer)), None)
        self._session = next((s for _, s in self.scorers if isinstance(s, SessionScorer)), None)
        self._precise = next(
            (s for _, s in self.scorers if isinstance(s, PrecisePrefixScorer)), None
        )
        self._spread = spec.max_load_spread
        self.reads_gauges = any(s.reads_gauges for _, s in self.scorers)

    async def affinity(self, ctx: Ctx) -> Affinity | None:
        return Affinity(
            self._prefix.blocks(ctx) if self._prefix is not None else (),
            self._session.session(ctx) if self._session is not None else None,
            await self._precise.token_blocks(ctx) if self._precise is not None else (),
        )

    def pick(self, replicas: Sequence[Replica], claim: Claim) -> Replica | None:
        if self._precise is not None:
            self._precise.follow(replicas)
        fitting = [r for r in replicas if r.fits(claim)]
        if len(fitting) <= 1:
            return fitting[0] if fitting else None
        loads = [r.load for r in fitting]
        most = min(loads) + spread_limit(self._spread, fitting[0].max_concurrency)
        balanced = [r for r, load in zip(fitting, loads, strict=True) if load <= most]
        if len(balanced) == 1:
            return balanced[0]
        now = time.monotonic()
        totals = [0.0] * len(balanced)
        for weight, scorer in self.scorers:
            for i, score in enumerate(scorer.score(balanced, claim, now)):
                totals[i] += weight * score
        best = max(
            range(len(balanced)),
            key=lambda i: (totals[i], -balanced[i].load, -balanced[i].inflight_tokens),
        )
        return balanced[best]

    @property
    def prefix(self) -> PrefixScorer | None:
        return self._prefix

    @property
    def precise(self) -> PrecisePrefixScorer | None:
        return self._precise

    def granted(self, replica: Replica, claim: Claim) -> None:
        for _, scorer in self.scorers:
            scorer.granted(replica, claim)

    def forget(self, url: str) -> None:
        for _, scorer in self.scorers:
            scorer.forget(url)

    async def close(self) -> None:
        if self._precise is not None:
            await self._precise.close()
