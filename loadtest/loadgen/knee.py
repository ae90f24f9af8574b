"""The knee: the load past which throughput stops growing in proportion while latency rises.

The algorithm, over closed-loop levels sorted by users u with request throughput x:

1. For each step from level a to the next level b, the marginal efficiency is
       e = (Δx / x_a) / (Δu / u_a)
   1.0 means throughput grew in proportion to users; 0 means it did not grow at all.
2. The step's latency growth is the larger of P95 E2E and P95 TPOT growth, b / a - 1.
3. The first step with e < `min_efficiency` (default 0.5) and latency growth
   >= `min_latency_growth` (default 0.2) is the knee, at level a: past it, more users bring
   queueing and tail latency, not throughput.
4. The recommended per-replica `max_concurrency` is the knee level (the last level before the
   knee step) divided by the replicas behind the target, rounded down. With no knee in the sweep
   it is the highest level tested, and the report says the sweep should go higher.

Both conditions are needed: throughput flattening alone can be noise at low latency, and latency
rising alone, while throughput still grows in proportion, is the price of batching, not a wall.
The knee is not interpolated between levels: the cap is a level that was actually measured.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import yaml

from loadtest.loadgen.stats import Point, ratio


@dataclass(frozen=True)
class KneeParams:
    min_efficiency: float = 0.5
    min_latency_growth: float = 0.2


@dataclass(frozen=True, slots=True)
class Step:
    load_from: float
    load_to: float
    efficiency: float | None
    e2e_growth: float | None
    tpot_growth: float | None

    @property
    def latency_growth(self) -> float | None:
        known = [g for g in (self.e2e_growth, self.tpot_growth) if g is not None]
        return max(known, default=None)


@dataclass(frozen=True)
class Knee:
    knee: float | None  # the level past which throughput stops growing; None: not in the sweep
    max_concurrency: int  # recommended per replica
    reason: str
    steps: list[Step]


def _growth(a: float | None, b: float | None) -> float | None:
    r = ratio(b, a)
    return None if r is None else r - 1


def steps(points: Sequence[Point]) -> list[Step]:
    ordered = sorted(points, key=lambda p: p.load)
    out = []
    for a, b in itertools.pairwise(ordered):
        rise = _growth(a.rps, b.rps)
        load = (b.load - a.load) / a.load
        out.append(
            Step(
                a.load,
                b.load,
                None if rise is None else rise / load,
                _growth(a.e2e_p95, b.e2e_p95),
                _growth(a.tpot_p95, b.tpot_p95),
            )
        )
    return out


def find_knee(
    points: Sequence[Point], params: KneeParams = KneeParams(), replicas: int = 1
) -> Knee:
    """Apply the module's algorithm; `replicas` is how many replicas served the swept target."""
    if not points:
        raise ValueError("no levels to find a knee in")
    found = steps(points)
    for step in found:
        growth = step.latency_growth
        if (
            step.efficiency is not None
            and step.efficiency < params.min_efficiency
            and growth is not None
            and growth >= params.min_latency_growth
        ):
            lowest = step.load_from == min(p.load for p in points)
            reason = (
                f"from {step.load_from:g} to {step.load_to:g} users throughput grew at"
                f" {step.efficiency:.2f} of proportional while P95 latency rose {growth:.0%}"
                + ("; that is the lowest level swept, so sweep lower too" if lowest else "")
            )
            return Knee(step.load_from, _per_replica(step.load_from, replicas), reason, found)
    top = max(p.load for p in points)
    reason = (
        f"no knee up to {top:g} users: throughput kept growing in proportion (or latency did not"
        " rise); sweep higher before trusting this cap"
    )
    return Knee(None, _per_replica(top, replicas), reason, found)


def _per_replica(load: float, replicas: int) -> int:
    return max(1, int(load // replicas))


def policy_snippet(knee: Knee, pool: str, model: str, replicas: Sequence[str]) -> str:
    """A `pools:` entry for the gateway's policy, capped at the knee, ready to paste."""
    entry = {
        "pools": {
            pool: {
                "model": model,
                "replicas": list(replicas),
                "max_concurrency": knee.max_concurrency,
            }
        }
    }
    return f"# {knee.reason}\n" + yaml.safe_dump(entry, sort_keys=False)
