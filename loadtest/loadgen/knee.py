"""The knee: the load past which more users buy less throughput than they cost in latency.

The rule is Kleinrock's *power*, throughput / response time, whose maximum is the classic
"knee" of a load-latency curve (L. Kleinrock, "Power and deterministic rules of thumb for
probabilistic problems in computer communications", ICC 1979). Here, over closed-loop levels
sorted by users u, with request throughput x and P95 E2E latency r:

1. Each step from level a to the next level b has a throughput ratio X = x_b / x_a and a
   latency ratio R = r_b / r_a; its power ratio is X / R.
2. The first step whose power falls, X / R < 1 - `tolerance` (default 0), is the knee, at
   level a: past it, each added user costs more latency, relatively, than it adds throughput.
3. The recommended per-replica `max_concurrency` is the knee level divided by the replicas
   behind the target, rounded down. With no knee in the sweep it is the highest level
   tested, and the reason says "no knee up to N users": the curve kept gaining, sweep higher.

Why power and not a fixed efficiency threshold. In a closed loop, Little's law ties the two
ratios together: users = throughput x mean latency, so a doubling of users with throughput
ratio X has a latency ratio of about 2 / X. A rule "throughput grew less than half in
proportion (X < 1.5) and latency rose 20%" is then one condition, not two, and it fires on
mere batching economics: a memory-bound decode step gets slower as the batch grows, so a
replica far from any wall still gains only ~1.45x per doubling at 64 -> 128 (Gemma 3 12B on
v6e in the simulator). That is still worth having: latency rose less than throughput did.
What the KV-cache wall adds is queueing and preemptions, which show in the tail: P95 E2E
grows faster than throughput (27B at 64 -> 128; docs/capacity.md). Power separates the two
without a model-specific threshold, and it uses P95, not the mean, because the tail is where
a wall shows first.

P95 TPOT is reported with each step but does not decide: it is part of E2E already, and its
growth under batching is exactly the price that power weighs against the throughput gained.
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
    tolerance: float = 0.0  # how far power must fall, as a fraction, to count (noise margin)


@dataclass(frozen=True, slots=True)
class Step:
    load_from: float
    load_to: float
    throughput_ratio: float | None
    e2e_ratio: float | None
    tpot_ratio: float | None

    @property
    def power_ratio(self) -> float | None:
        """Throughput gained over P95 E2E latency paid; below 1 means power fell."""
        if self.throughput_ratio is None or not self.e2e_ratio:
            return None
        return self.throughput_ratio / self.e2e_ratio

    @property
    def efficiency(self) -> float | None:
        """Relative throughput growth over relative load growth (1.0: in proportion)."""
        if self.throughput_ratio is None:
            return None
        return (self.throughput_ratio - 1) / ((self.load_to - self.load_from) / self.load_from)


@dataclass(frozen=True)
class Knee:
    knee: float | None  # the level past which power falls; None: not in the sweep
    max_concurrency: int  # recommended per replica
    reason: str
    steps: list[Step]


def steps(points: Sequence[Point]) -> list[Step]:
    ordered = sorted(points, key=lambda p: p.load)
    return [
        Step(
            a.load,
            b.load,
            ratio(b.rps, a.rps),
            ratio(b.e2e_p95, a.e2e_p95),
            ratio(b.tpot_p95, a.tpot_p95),
        )
        for a, b in itertools.pairwise(ordered)
    ]


def find_knee(
    points: Sequence[Point], params: KneeParams = KneeParams(), replicas: int = 1
) -> Knee:
    """Apply the module's rule; `replicas` is how many replicas served the swept target."""
    if not points:
        raise ValueError("no levels to find a knee in")
    found = steps(points)
    for step in found:
        power = step.power_ratio
        if power is not None and power < 1 - params.tolerance:
            lowest = step.load_from == min(p.load for p in points)
            reason = (
                f"from {step.load_from:g} to {step.load_to:g} users throughput grew"
                f" {step.throughput_ratio:.2f}x while P95 E2E grew {step.e2e_ratio:.2f}x:"
                " past this level users add more latency than throughput"
                + ("; that is the lowest level swept, so sweep lower too" if lowest else "")
            )
            return Knee(step.load_from, _per_replica(step.load_from, replicas), reason, found)
    top = max(p.load for p in points)
    reason = (
        f"no knee up to {top:g} users: throughput grew at least as fast as P95 E2E at every"
        " step; sweep higher before trusting this cap"
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
