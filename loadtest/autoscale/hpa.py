"""The Kubernetes HorizontalPodAutoscaler's algorithm (autoscaling/v2), as a pure model.

What one sync of the controller does for a scale target whose metrics are External metrics
with an `AverageValue` target (deploy/base/autoscaling/hpa.yaml's shape), following
kubernetes/kubernetes pkg/controller/podautoscaler:

1. Per metric (replica_calculator.go, GetExternalPerPodMetricReplicas): the usage ratio is
   `total / (target x current)`; within the tolerance (10%) of 1.0 the proposal is `current`,
   else `ceil(total / target)`, which is `ceil(current x metric / target)` for the per-pod
   average. A `Value` target (GetExternalMetricReplicas, getUsageRatioReplicaCount): the usage
   ratio is `total / target`; within the tolerance the proposal is `current`, else
   `ceil(ratio x ready pods)`. The HPA takes the largest proposal over its metrics; a metric it
   cannot read is skipped, but then it will not scale down (horizontal.go,
   computeReplicasForMetrics).
2. Stabilisation (stabilizeRecommendationWithBehaviors): every sync's raw proposal is kept;
   the recommendation is at least the smallest proposal of the scale-up window and at most the
   largest of the scale-down window (so scale-down takes the window's maximum).
3. Rate policies (convertDesiredReplicasWithBehaviorRate): from the replicas at the start of each
   policy's period (now minus what was added, plus what was removed within it), a `Pods` policy
   allows +-value and a `Percent` one x(1 +- value/100) (rounded up when scaling up, truncated
   when scaling down); `selectPolicy` Max takes the policy allowing the biggest change, Min the
   smallest, Disabled none. min/max replicas bound the result.

A current count outside [min, max] is brought inside at once, as the controller does before it
reads any metric. `from_manifest` reads min/max, behavior and the AverageValue External metrics
from an HPA manifest (deploy/base/autoscaling/hpa.yaml); other metric types, and Value targets
(whose series the caller may not compute), are not modelled from a manifest.
Times are the caller's clock in seconds (simulated seconds in loadtest).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

PolicyType = Literal["Pods", "Percent"]
Select = Literal["Max", "Min", "Disabled"]
TargetType = Literal["AverageValue", "Value"]

DEFAULT_TOLERANCE = 0.1  # --horizontal-pod-autoscaler-tolerance
DEFAULT_SYNC_PERIOD_S = 15.0  # --horizontal-pod-autoscaler-sync-period
DEFAULT_DOWNSCALE_STABILIZATION_S = 300.0  # --horizontal-pod-autoscaler-downscale-stabilization


@dataclass(frozen=True)
class ScalingPolicy:
    type: PolicyType
    value: int
    period_s: float


@dataclass(frozen=True)
class ScalingRules:
    """One direction of `spec.behavior`: `scaleUp` or `scaleDown`."""

    stabilization_s: float
    policies: tuple[ScalingPolicy, ...]
    select: Select = "Max"


# The API's defaults (pkg/apis/autoscaling/v2/defaults.go; the docs' "Default Behavior").
DEFAULT_SCALE_UP = ScalingRules(
    0.0, (ScalingPolicy("Percent", 100, 15.0), ScalingPolicy("Pods", 4, 15.0))
)
DEFAULT_SCALE_DOWN = ScalingRules(
    DEFAULT_DOWNSCALE_STABILIZATION_S, (ScalingPolicy("Percent", 100, 15.0),)
)


@dataclass(frozen=True)
class ExternalMetric:
    """`type: External` with `target: {type: AverageValue, averageValue: ...}`, or with
    `target: {type: Value, value: ...}`."""

    name: str
    target: float = 1.0
    type: TargetType = "AverageValue"


@dataclass(frozen=True)
class HpaSpec:
    metrics: tuple[ExternalMetric, ...]
    min_replicas: int = 1
    max_replicas: int = 10
    scale_up: ScalingRules = DEFAULT_SCALE_UP
    scale_down: ScalingRules = DEFAULT_SCALE_DOWN
    tolerance: float = DEFAULT_TOLERANCE
    sync_period_s: float = DEFAULT_SYNC_PERIOD_S

    def __post_init__(self) -> None:
        if not self.metrics:
            raise ValueError("an HPA needs at least one metric")
        if not 0 < self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 < min_replicas <= max_replicas")


def milli(value: float) -> int:
    """A quantity's MilliValue(), which rounds up; the controller computes in milli-units, so
    0.6 / 0.1 is 600 / 100 = 6 and not the float 6.000000000000001. (Rounded to 1e-6 first:
    a value parsed from text as 0.2 is 200.00000000000003 thousandths in binary.)"""
    return math.ceil(round(value * 1000, 6))


def average_value_proposal(current: int, total: float, target: float, tolerance: float) -> int:
    """GetExternalPerPodMetricReplicas: the replicas an External AverageValue metric asks for."""
    used, per_pod = milli(total), milli(target)
    usage_ratio = used / (per_pod * current)
    if abs(1.0 - usage_ratio) <= tolerance:
        return current
    return math.ceil(used / per_pod)


def value_proposal(current: int, ready: int, total: float, target: float, tolerance: float) -> int:
    """GetExternalMetricReplicas: the replicas an External Value metric asks for, from the ready
    pods (not the current count: replicas still starting are not counted)."""
    usage_ratio = milli(total) / milli(target)
    if abs(1.0 - usage_ratio) <= tolerance:
        return current
    return math.ceil(usage_ratio * ready)


@dataclass(frozen=True)
class Decision:
    """One sync: the raw proposal per metric (None: not readable), and what was decided."""

    at_s: float
    current: int
    proposals: dict[str, int | None]
    desired: int
    reason: str


@dataclass
class Hpa:
    """The controller's memory for one HPA: past proposals and scale events."""

    spec: HpaSpec
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    scale_up_events: list[tuple[float, int]] = field(default_factory=list)
    scale_down_events: list[tuple[float, int]] = field(default_factory=list)

    def sync(
        self,
        now_s: float,
        current: int,
        metrics: Mapping[str, float | None],
        ready: int | None = None,
    ) -> Decision:
        """One reconcile: `metrics` are the External metrics' totals as read now (None or
        missing: unavailable); `ready` the pods ready now (a Value target's proposal scales
        them; None: `current`). The caller scales to `desired`; the event is recorded here."""
        spec = self.spec
        if current > spec.max_replicas:
            return self._scaled(Decision(now_s, current, {}, spec.max_replicas, "TooManyReplicas"))
        if current < spec.min_replicas:
            return self._scaled(Decision(now_s, current, {}, spec.min_replicas, "TooFewReplicas"))
        proposals: dict[str, int | None] = {}
        for metric in spec.metrics:
            total = metrics.get(metric.name)
            if total is None:
                proposals[metric.name] = None
            elif metric.type == "Value":
                proposals[metric.name] = value_proposal(
                    current, current if ready is None else ready, total, metric.target,
                    spec.tolerance,
                )  # fmt: skip
            else:
                proposals[metric.name] = average_value_proposal(
                    current, total, metric.target, spec.tolerance
                )
        valid = [p for p in proposals.values() if p is not None]
        if not valid:
            return Decision(now_s, current, proposals, current, "FailedGetExternalMetric")
        proposal = max(valid)
        if len(valid) < len(proposals) and proposal < current:
            # A metric that cannot be read might be the one holding the replicas up.
            return Decision(now_s, current, proposals, current, "InvalidMetricNoScaleDown")
        stabilised = self._stabilise(now_s, current, proposal)
        desired, reason = self._limit_rate(now_s, current, stabilised)
        return self._scaled(Decision(now_s, current, proposals, desired, reason))

    def _stabilise(self, now_s: float, current: int, proposal: int) -> int:
        up_cutoff = now_s - self.spec.scale_up.stabilization_s
        down_cutoff = now_s - self.spec.scale_down.stabilization_s
        up, down = proposal, proposal
        for at_s, recommendation in self.recommendations:
            if at_s > up_cutoff:
                up = min(up, recommendation)
            if at_s > down_cutoff:
                down = max(down, recommendation)
        # What has left both windows is never read again (the controller overwrites it).
        oldest = min(up_cutoff, down_cutoff)
        self.recommendations = [r for r in self.recommendations if r[0] > oldest]
        self.recommendations.append((now_s, proposal))
        return min(max(current, up), down)

    def _limit_rate(self, now_s: float, current: int, desired: int) -> tuple[int, str]:
        spec = self.spec
        if desired > current:
            limit = max(current, self._up_limit(now_s, current))
            ceiling = min(spec.max_replicas, limit)
            if ceiling < desired:
                reason = "ScaleUpLimit" if limit < spec.max_replicas else "TooManyReplicas"
                return ceiling, reason
        elif desired < current:
            limit = min(current, self._down_limit(now_s, current))
            floor = max(spec.min_replicas, limit)
            if floor > desired:
                reason = "ScaleDownLimit" if limit > spec.min_replicas else "TooFewReplicas"
                return floor, reason
        return desired, "DesiredWithinRange"

    def _period_start(self, now_s: float, current: int, period_s: float) -> int:
        added = sum(n for at_s, n in self.scale_up_events if at_s > now_s - period_s)
        removed = sum(n for at_s, n in self.scale_down_events if at_s > now_s - period_s)
        return current - added + removed

    def _up_limit(self, now_s: float, current: int) -> int:
        rules = self.spec.scale_up
        if rules.select == "Disabled":
            return current
        proposed = []
        for policy in rules.policies:
            start = self._period_start(now_s, current, policy.period_s)
            if policy.type == "Pods":
                proposed.append(start + policy.value)
            else:  # rounded up, or a small target could never grow by a percentage
                proposed.append(math.ceil(start * (1 + policy.value / 100)))
        return max(proposed) if rules.select == "Max" else min(proposed)

    def _down_limit(self, now_s: float, current: int) -> int:
        rules = self.spec.scale_down
        if rules.select == "Disabled":
            return current
        proposed = []
        for policy in rules.policies:
            start = self._period_start(now_s, current, policy.period_s)
            if policy.type == "Pods":
                proposed.append(start - policy.value)
            else:
                proposed.append(int(start * (1 - policy.value / 100)))
        # Scaling down, the biggest change is the lowest count.
        return min(proposed) if rules.select == "Max" else max(proposed)

    def _scaled(self, decision: Decision) -> Decision:
        """storeScaleEvent: remember the change for the rate policies' periods."""
        change = decision.desired - decision.current
        now_s = decision.at_s
        longest = max(
            (p.period_s for r in (self.spec.scale_up, self.spec.scale_down) for p in r.policies),
            default=0.0,
        )
        self.scale_up_events = [e for e in self.scale_up_events if e[0] > now_s - longest]
        self.scale_down_events = [e for e in self.scale_down_events if e[0] > now_s - longest]
        if change > 0:
            self.scale_up_events.append((now_s, change))
        elif change < 0:
            self.scale_down_events.append((now_s, -change))
        return decision


def _rules(raw: Mapping[str, Any] | None, default: ScalingRules) -> ScalingRules:
    """One `behavior` direction with the API's defaults for what it leaves out."""
    if raw is None:
        return default
    window = raw.get("stabilizationWindowSeconds")
    policies = tuple(
        ScalingPolicy(p["type"], int(p["value"]), float(p["periodSeconds"]))
        for p in raw.get("policies") or ()
    )
    return ScalingRules(
        default.stabilization_s if window is None else float(window),
        policies or default.policies,
        raw.get("selectPolicy", "Max"),
    )


@dataclass(frozen=True)
class Manifest:
    """What an autoscaling/v2 HorizontalPodAutoscaler manifest says that the model uses."""

    name: str
    min_replicas: int
    max_replicas: int
    scale_up: ScalingRules
    scale_down: ScalingRules
    metrics: tuple[ExternalMetric, ...]  # External metrics with an AverageValue target
    pool: str | None  # the metrics' `pool` label selector, if they share one
    unmodelled: tuple[str, ...]  # the other metrics, described


def from_manifest(doc: Mapping[str, Any]) -> Manifest:
    spec = doc["spec"]
    behavior = spec.get("behavior") or {}
    metrics, unmodelled, pools = [], [], set()
    for m in spec.get("metrics") or ():
        external = m.get("external") if m.get("type") == "External" else None
        target = (external or {}).get("target") or {}
        if external is None or target.get("type") != "AverageValue":
            name = (external or {}).get("metric", {}).get("name", m.get("type"))
            unmodelled.append(f"{name} ({m.get('type')}, {target.get('type', '?')} target)")
            continue
        metric = external["metric"]
        metrics.append(ExternalMetric(metric["name"], float(target["averageValue"])))
        pools.add((metric.get("selector") or {}).get("matchLabels", {}).get("pool"))
    return Manifest(
        doc["metadata"]["name"],
        int(spec.get("minReplicas", 1)),
        int(spec["maxReplicas"]),
        _rules(behavior.get("scaleUp"), DEFAULT_SCALE_UP),
        _rules(behavior.get("scaleDown"), DEFAULT_SCALE_DOWN),
        tuple(metrics),
        pools.pop() if len(pools) == 1 else None,
        tuple(unmodelled),
    )
