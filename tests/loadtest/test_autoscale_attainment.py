"""The autoscaling loop on attainment: the HPA model reads the demand estimate and the SLO miss
share (`llm_pool_slo_miss_ratio`, as prometheus-adapter serves it from the gateway's
`llm_slo_requests_total`) and scales out while the pool misses its objectives more than its
target allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.autoscale.attainment import SLO_MISS, MissRatio, slo_counts
from loadtest.autoscale.hpa import ExternalMetric
from loadtest.autoscale.loop import (
    REACTIVE,
    AutoscaleConfig,
    PoolConfig,
    external_metric,
    hpa_metrics,
    policy,
    run_keeping_pace,
)
from loadtest.autoscale.trace import load_trace


def exposition(met: float, missed: float, refused: float = 0.0) -> str:
    lines = [
        "# HELP llm_slo_requests Requests with a latency objective.",
        "# TYPE llm_slo_requests counter",
    ]
    for objective, outcome, value in (
        ("ttft", "met", met), ("ttft", "missed", missed), ("ttft", "refused", refused),
    ):  # fmt: skip
        labels = f'pool="gen",tier="standard",objective="{objective}",outcome="{outcome}"'
        lines.append(f"llm_slo_requests_total{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


def test_the_miss_share_is_a_rate_over_the_last_two_minutes_refusals_included() -> None:
    assert slo_counts(exposition(8, 1, 1)) == {"gen": (8.0, 10.0)}
    misses = MissRatio()
    misses.scraped(0.0, slo_counts(exposition(0, 0)))
    assert misses.value("gen", 10.0) is None  # one scrape: no rate yet
    misses.scraped(15.0, slo_counts(exposition(0, 0)))
    assert misses.value("gen", 20.0) == 0.0  # nothing observed: nothing missed
    misses.scraped(30.0, slo_counts(exposition(6, 3, 1)))
    assert misses.value("gen", 30.0) == pytest.approx(0.4)  # 4 of 10 not met
    misses.scraped(150.0, slo_counts(exposition(16, 3, 1)))
    # The window is (30, 150]: the scrape at 30 s left it; only 150 s is inside.
    assert misses.value("gen", 150.0) is None
    misses.scraped(165.0, slo_counts(exposition(26, 3, 1)))
    assert misses.value("gen", 165.0) == 0.0
    assert misses.value("other", 165.0) is None


def test_the_attainment_signal_reads_the_demand_and_the_miss_share_of_pools_with_objectives(
    tmp_path: Path,
) -> None:
    trace = load_trace("ramp", "generation")
    with pytest.raises(ValueError, match=r"no `slo\.objectives`"):
        AutoscaleConfig(trace, "tok", tmp_path, signal="attainment")
    slo = {"objectives": {"standard": {"ttft_ms": 2400, "tpot_ms": 120}},
           "model": {"ttft_base_ms": 24}, "preempt": {"enabled": True, "max_per_s": 0.5}}  # fmt: skip
    pool = PoolConfig(slo=slo, target=0.8)
    config = AutoscaleConfig(
        trace, "tok", tmp_path, pools=(pool,), signal="attainment", slo_miss_target=0.05,
        time_scale=12.0,
    )  # fmt: skip
    assert hpa_metrics(config, pool.name, False) == ((REACTIVE, SLO_MISS), [])
    assert external_metric(config, pool, SLO_MISS) == ExternalMetric(SLO_MISS, 0.05, "Value")
    assert external_metric(config, pool, REACTIVE) == ExternalMetric(REACTIVE, 0.8)
    # The gateway's clock is the wall's: its objectives and seed are the simulated ones over the
    # time scale, its preemption pace the simulated one times it.
    sent = policy(config, 5353, {pool.name: 8000})["pools"][pool.name]["slo"]
    assert sent == {
        "objectives": {"standard": {"ttft_ms": 200.0, "tpot_ms": 10.0}},
        "model": {"ttft_base_ms": 2.0},
        "preempt": {"enabled": True, "max_per_s": 6.0},
    }


async def test_a_pool_missing_its_objectives_is_scaled_out_though_its_demand_asks_for_none(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A TTFT objective of a millisecond no replica meets, and a demand target so high that
    the demand estimate alone never asks for a second replica: the miss share does."""
    config = AutoscaleConfig(
        trace=load_trace("step:base=0.5,peak=0.5,start=0,end=120,duration=120", "classification"),
        tokenizer=str(tokenizer_dir),
        out=tmp_path,
        time_scale=20.0,
        startup_s=20.0,
        pools=(
            PoolConfig(
                max_concurrency=8,
                max_replicas=3,
                target=50.0,
                slo={"objectives": {"standard": {"ttft_ms": 1}}},
            ),
        ),
        signal="attainment",
    )
    run = await run_keeping_pace(config)
    assert run.signal_used == {"generate-27b": (REACTIVE, SLO_MISS)}
    read = [s for s in run.samples if s.metrics.get(SLO_MISS) is not None]
    assert read, f"the miss share was never read: {run.samples}"
    # No TTFT of a millisecond: all missed, or (the load over) none observed in the window.
    assert {s.metrics[SLO_MISS] for s in read} <= {0.0, 1.0} and read[0].metrics[SLO_MISS] == 1.0
    out = [s for s in run.samples if s.desired > s.current]
    assert out, f"no scale-out: {run.samples}"
    for s in out:  # the demand asked for none of them: under 50 per replica
        assert s.metrics[SLO_MISS] is not None and (s.metrics[REACTIVE] or 0) < 50 * s.current
    assert max(s.desired for s in run.samples) == 3
    logged = [line for line in run.access if line.get("slo_ttft_s") is not None]
    assert logged and all(line["slo_ttft_s"] == pytest.approx(0.001 / 20) for line in logged)
