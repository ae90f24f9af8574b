"""The weighted picker a pool's `pick:` configures: filters, weighted scorers, then the best.

As in the Gateway API inference extension's scheduler: the replicas a request may take are
filtered (room under the caps, then load balance), each scorer rates the rest 0..1, the weighted
sums are compared, and ties go to the least loaded. Caps stay hard: a replica without room is
never rated. Affinity never piles load on one replica: only replicas running at most
`max_load_spread` x `max_concurrency` requests more than the least loaded one that fits are
rated at all (Ray Serve's "prefix affinity only while the load is balanced", as a bound), so
however strong a replica's cache match, its load stays within that spread of its peers'.

The picker knows its scorers only through the `Scorer` hooks (`scorers.py`), never by class:
each scorer fills its own field of the request's `Affinity` in `prepare`, and the hooks a scorer
leaves at their no-op default are not called per request. What a request costs here is what its
scorers do, nothing for the ones a pool does not configure.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from gateway.config.plugins import PluginError, create
from gateway.config.schema import PickSpec
from gateway.context.affinity import Affinity
from gateway.pick.scorers import Scorer, spread_limit

if TYPE_CHECKING:
    from gateway.admit import Claim, Replica
    from gateway.context.ctx import Ctx
    from gateway.errors import Ejection
    from gateway.pick.precise import PrecisePrefixScorer
    from gateway.pick.scorers import PrefixScorer


def _overrides(scorer: Scorer, hook: str) -> bool:
    return getattr(type(scorer), hook) is not getattr(Scorer, hook)


class WeightedPicker:
    def __init__(self, spec: PickSpec) -> None:
        self.spec = spec
        self.named: dict[str, Scorer] = {
            name: create("scorer", name, parameters)
            for name, (_, parameters) in spec.weighted().items()
        }
        self.scorers: list[tuple[float, Scorer]] = [
            (weight, self.named[name]) for name, (weight, _) in spec.weighted().items()
        ]
        parts: dict[str, Scorer] = {}
        for name, scorer in self.named.items():
            if scorer.part is None:
                continue
            if scorer.part not in Affinity._fields:
                raise PluginError(f"{name}: no request field {scorer.part!r} to prepare")
            if scorer.part in parts:
                raise PluginError(f"{name}: another scorer prepares {scorer.part!r} already")
            parts[scorer.part] = scorer
        # The scorer (or None) preparing each field of `Affinity`, in its order.
        self._blocks, self._session, self._tokens = (parts.get(f) for f in Affinity._fields)
        self._followers = tuple(s for s in self.named.values() if _overrides(s, "follow"))
        self._observers = tuple(s for s in self.named.values() if _overrides(s, "observe"))
        self._spread = spec.max_load_spread
        self.reads_gauges = any(s.reads_gauges for s in self.named.values())

    async def affinity(self, ctx: Ctx) -> Affinity | None:
        # One expression a field, each its scorer's (`awaits`: a coroutine, else a plain call).
        b, s, t = self._blocks, self._session, self._tokens
        return Affinity(
            () if b is None else await b.prepare(ctx) if b.awaits else b.prepare(ctx),
            None if s is None else await s.prepare(ctx) if s.awaits else s.prepare(ctx),
            () if t is None else await t.prepare(ctx) if t.awaits else t.prepare(ctx),
        )

    def pick(self, replicas: Sequence[Replica], claim: Claim) -> Replica | None:
        for follower in self._followers:
            follower.follow(replicas)
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
        """The `prefix` scorer, if configured: the metrics read what it learned."""
        return cast("PrefixScorer | None", self.named.get("prefix"))

    @property
    def precise(self) -> PrecisePrefixScorer | None:
        """The `precise_prefix` scorer, if configured: the metrics read its feeds."""
        return cast("PrecisePrefixScorer | None", self.named.get("precise_prefix"))

    def cached_share(self, replica: Replica, claim: Claim) -> float:
        """The precise prefix scorer's view (the replica's own KV events), else the
        approximate one's; 0 with neither."""
        scorer = self.named.get("precise_prefix") or self.named.get("prefix")
        if scorer is None:
            return 0.0
        return scorer.score((replica,), claim, time.monotonic())[0]

    def granted(self, replica: Replica, claim: Claim) -> None:
        for _, scorer in self.scorers:
            scorer.granted(replica, claim)

    def observe(self, replica: Replica, claim: Claim, ctx: Ctx, failure: Ejection | None) -> None:
        for observer in self._observers:
            observer.observe(replica, claim, ctx, failure)

    def forget(self, url: str) -> None:
        for _, scorer in self.scorers:
            scorer.forget(url)

    async def close(self) -> None:
        for scorer in self.named.values():
            await scorer.close()
