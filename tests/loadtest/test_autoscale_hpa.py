"""The HPA model against the Kubernetes documentation's worked examples.

kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/: "Algorithm details",
"Stabilization window", "Scaling policies", "Default Behavior", "Disable scale down"; the v1.33
blog post on configurable tolerance for the 50-replica example.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from loadtest.autoscale.hpa import (
    DEFAULT_SCALE_UP,
    ExternalMetric,
    Hpa,
    HpaSpec,
    ScalingPolicy,
    ScalingRules,
    average_value_proposal,
    from_manifest,
    value_proposal,
)

M = "llm_pool_desired_replicas"
IMMEDIATE_DOWN = ScalingRules(0.0, (ScalingPolicy("Percent", 100, 15.0),))


def hpa(**spec: object) -> Hpa:
    spec.setdefault("metrics", (ExternalMetric(M, 1.0),))
    return Hpa(HpaSpec(**spec))  # type: ignore[arg-type]


def per_pod(current: int, average: float) -> dict[str, float | None]:
    """An External metric's total when each of `current` pods averages `average`."""
    return {M: current * average}


def test_a_metric_of_200m_against_a_target_of_100m_doubles_the_replicas() -> None:
    # "if the current metric value is 200m, and the desired value is 100m, the number of
    # replicas will be doubled, since 200.0 / 100.0 == 2.0"
    assert average_value_proposal(1, 0.2, 0.1, 0.1) == 2
    assert average_value_proposal(3, 3 * 0.2, 0.1, 0.1) == 6


def test_a_metric_of_50m_halves_them() -> None:
    # "If the current value is instead 50m, you'll halve the number of replicas"
    assert average_value_proposal(4, 4 * 0.05, 0.1, 0.1) == 2


def test_fifty_replicas_at_90_against_75_become_sixty() -> None:
    # The tolerance blog post: 50 x (90 / 75) = 60; 20% over the target is past the 10% tolerance.
    assert average_value_proposal(50, 50 * 90, 75, 0.1) == 60


def test_within_the_ten_percent_tolerance_nothing_changes() -> None:
    # "the control plane skips any scaling action if the ratio is sufficiently close to 1.0
    # (within a configurable tolerance, 0.1 by default)"
    assert average_value_proposal(10, 10.9, 1.0, 0.1) == 10
    assert average_value_proposal(10, 9.1, 1.0, 0.1) == 10
    assert average_value_proposal(10, 11.5, 1.0, 0.1) == 12
    assert average_value_proposal(4, 3.2, 1.0, 0.0) == 4  # exactly on target, even without any


def test_the_average_value_ratio_is_the_total_over_target_times_current() -> None:
    # The gateway's llm_pool_desired_replicas is a pool total: at AverageValue 1 the HPA asks
    # for ceil(total) replicas, whatever the current count.
    for current in (1, 3, 8):
        assert average_value_proposal(current, 5.2, 1.0, 0.1) == 6


def test_with_several_metrics_the_largest_proposal_wins() -> None:
    # "the HorizontalPodAutoscaler will evaluate each metric, and propose a new scale based on
    # that metric. The largest of the proposed scales will be used as the new scale."
    model = hpa(metrics=(ExternalMetric(M), ExternalMetric("forecast")), scale_down=IMMEDIATE_DOWN)
    decision = model.sync(0.0, 2, {M: 1.0, "forecast": 5.0})
    assert decision.proposals == {M: 1, "forecast": 5}
    assert decision.desired == 5


def test_a_missing_metric_blocks_scale_down_but_not_scale_up() -> None:
    # "If any of these metrics cannot be converted into a desired replica count ... and a scale
    # down is suggested by the metrics which can be fetched, scaling is skipped."
    model = hpa(metrics=(ExternalMetric(M), ExternalMetric("forecast")), scale_down=IMMEDIATE_DOWN)
    assert model.sync(0.0, 4, {M: 1.0}).desired == 4
    assert model.sync(15.0, 4, {M: 7.0}).desired == 7
    assert model.sync(30.0, 7, {}).reason == "FailedGetExternalMetric"


def test_scale_down_takes_the_highest_recommendation_of_the_window() -> None:
    # "the algorithm looks into previously computed desired states, and uses the highest value
    # from the specified interval" (default 300 s).
    model = hpa()
    assert model.sync(0.0, 5, per_pod(5, 1.0)).desired == 5
    t, proposals = 15.0, []
    while t < 300.0:
        proposals.append(model.sync(t, 5, {M: 2.0}).desired)
        t += 15.0
    assert set(proposals) == {5}  # the 5 recommended at t=0 is still in the window
    assert model.sync(300.0, 5, {M: 2.0}).desired == 2  # it has left: 2 is now the highest


def test_scale_up_is_immediate_by_default() -> None:
    # scaleUp stabilizationWindowSeconds defaults to 0
    model = hpa()
    model.sync(0.0, 1, {M: 1.0})
    assert model.sync(15.0, 1, {M: 2.0}).desired == 2


def test_default_scale_up_is_the_larger_of_double_and_four_pods_per_fifteen_seconds() -> None:
    # Default behavior: Percent 100 and Pods 4 every 15 s, selectPolicy Max.
    assert DEFAULT_SCALE_UP.select == "Max"
    model = hpa(max_replicas=100)
    first = model.sync(0.0, 1, {M: 50.0})
    assert (first.desired, first.reason) == (5, "ScaleUpLimit")  # +4 pods beats +100% of 1
    assert model.sync(5.0, 5, {M: 50.0}).desired == 5  # the period's allowance is spent
    assert model.sync(15.0, 5, {M: 50.0}).desired == 10  # next period: +100% of 5 beats +4
    assert model.sync(30.0, 10, {M: 50.0}).desired == 20
    assert model.sync(45.0, 20, {M: 50.0}).desired == 40
    assert model.sync(60.0, 40, {M: 50.0}).desired == 50


def test_scale_down_policies_80_to_10_replicas() -> None:
    # The docs' example: Pods 4 and Percent 10 per 60 s. "if there are 80 replicas and the target
    # has to be scaled down to 10 replicas then during the first step 8 replicas will be reduced.
    # In the next iteration when the number of replicas is 72, 10% of the pods is 7.2 but the
    # number is rounded up to 8. ... When the number of replicas falls below 40 the first policy
    # (Pods) is applied and 4 replicas will be reduced at a time."
    rules = ScalingRules(0.0, (ScalingPolicy("Pods", 4, 60.0), ScalingPolicy("Percent", 10, 60.0)))
    model = hpa(max_replicas=100, scale_down=rules)
    assert model.sync(0.0, 80, {M: 10.0}).desired == 72
    assert model.sync(15.0, 72, {M: 10.0}).desired == 72  # within the period: no more
    current, t, steps = 72, 60.0, []
    while current > 10:
        current = model.sync(t, current, {M: 10.0}).desired
        steps.append(current)
        t += 60.0
    assert steps[:5] == [64, 57, 51, 45, 40]
    assert steps[5:] == [36, 32, 28, 24, 20, 16, 12, 10]


def test_select_policy_min_takes_the_smallest_change() -> None:
    # "selectPolicy: Min" on the same two policies: 80 replicas lose 4 (the Pods policy), not 8.
    rules = ScalingRules(
        0.0, (ScalingPolicy("Pods", 4, 60.0), ScalingPolicy("Percent", 10, 60.0)), "Min"
    )
    model = hpa(max_replicas=100, scale_down=rules)
    assert model.sync(0.0, 80, {M: 10.0}).desired == 76


def test_select_policy_disabled_never_scales_down() -> None:
    # "Disable scale down": scaleDown: selectPolicy: Disabled
    model = hpa(scale_down=ScalingRules(0.0, (ScalingPolicy("Percent", 100, 15.0),), "Disabled"))
    for t in (0.0, 15.0, 600.0):
        decision = model.sync(t, 6, {M: 1.0})
        assert (decision.desired, decision.reason) == (6, "ScaleDownLimit")
    assert model.sync(615.0, 6, {M: 9.0}).desired == 9  # scaling up still works


def test_min_and_max_replicas_bound_every_decision() -> None:
    model = hpa(min_replicas=2, max_replicas=6, scale_down=IMMEDIATE_DOWN)
    assert model.sync(0.0, 4, {M: 40.0}).desired == 6
    assert model.sync(15.0, 6, {M: 0.0}).desired == 2
    assert model.sync(30.0, 9, {M: 1.0}).reason == "TooManyReplicas"  # out of range: clamped
    assert model.sync(45.0, 1, {M: 9.0}).desired == 2


def test_the_shipped_manifest_reads_as_its_behavior_says() -> None:
    # deploy/base/autoscaling/hpa.yaml: up 100% or 2 pods a minute (Max), no stabilisation;
    # down one pod per 5 minutes after 10 minutes of stabilisation.
    root = Path(__file__).resolve().parents[2]
    docs = list(yaml.safe_load_all((root / "deploy/base/autoscaling/hpa.yaml").read_text()))
    shipped = from_manifest(next(d for d in docs if d["metadata"]["name"] == "gemma3-27b-gen"))
    assert (shipped.min_replicas, shipped.max_replicas, shipped.pool) == (1, 8, "generate-27b")
    forecast = "llm_pool_desired_replicas_forecast"  # the HPA takes the larger: reactive floor
    assert shipped.metrics == (ExternalMetric(M, 1.0), ExternalMetric(forecast, 1.0))
    assert shipped.unmodelled == ("llm_pool_queue_wait_p95_seconds (External, Value target)",)
    assert shipped.scale_down == ScalingRules(600.0, (ScalingPolicy("Pods", 1, 300.0),), "Min")
    model = Hpa(HpaSpec(shipped.metrics, 1, 8, shipped.scale_up, shipped.scale_down))
    assert model.sync(0.0, 1, {M: 8.0, forecast: 2.0}).desired == 3  # +2 pods beats +100% of 1
    assert model.sync(30.0, 3, {M: 8.0, forecast: 2.0}).desired == 3  # the minute is not over
    assert model.sync(60.0, 3, {M: 8.0, forecast: 2.0}).desired == 6


def test_a_manifest_without_behavior_gets_the_defaults() -> None:
    bare = {"metadata": {"name": "x"}, "spec": {"maxReplicas": 4, "metrics": []}}
    manifest = from_manifest(bare)
    assert manifest.scale_up == DEFAULT_SCALE_UP and manifest.scale_down.stabilization_s == 300


def test_a_value_target_scales_the_ready_pods_by_the_metric_over_its_target() -> None:
    # "desiredReplicas = ceil[currentReplicas * (currentMetricValue / desiredMetricValue)]",
    # the replicas being the ready pods for a Value target (getUsageRatioReplicaCount).
    assert value_proposal(4, 4, 0.2, 0.1, 0.1) == 8  # twice the allowed miss share
    assert value_proposal(4, 2, 0.2, 0.1, 0.1) == 4  # two still starting count for nothing
    assert value_proposal(4, 4, 0.105, 0.1, 0.1) == 4  # within the tolerance: no change
    assert value_proposal(4, 4, 0.0, 0.1, 0.1) == 0  # nothing missed: the floor is another's
    assert value_proposal(4, 4, 0.3, 0.1, 0.1) == 12


def test_an_hpa_with_a_value_metric_beside_the_demand_takes_the_larger_proposal() -> None:
    miss = ExternalMetric("llm_pool_slo_miss_ratio", 0.1, "Value")
    model = hpa(metrics=(ExternalMetric(M), miss), scale_down=IMMEDIATE_DOWN, max_replicas=20)
    # Demand asks for 3; 30% of the objectives missed, over 3 ready of 4, asks for 9.
    decision = model.sync(0.0, 4, {M: 3.0, miss.name: 0.3}, ready=3)
    assert decision.proposals == {M: 3, miss.name: 9}
    assert decision.desired == 8  # the default scale-up: +100% a period
    # All met: the demand's proposal is the floor the miss share cannot pull under.
    assert model.sync(15.0, 8, {M: 5.0, miss.name: 0.0}, ready=8).desired == 5
    # The miss share unreadable (no SLO traffic yet): no scale-down, as the controller.
    assert model.sync(30.0, 5, {M: 2.0}).reason == "InvalidMetricNoScaleDown"
