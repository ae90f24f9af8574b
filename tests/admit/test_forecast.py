"""The demand forecast: Holt's damped, capped trend, and its gauge on a running gateway."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from pydantic import ValidationError

from gateway.admit.forecast import DEFAULT, Holt
from gateway.config.schema import PoolSpec
from tests.conftest import basic_policy, eventually
from tests.fleet.test_resilience import CHAT, scrape

HORIZON_S = 600.0


def feed(holt: Holt, values: list[float], dt: float = 1.0) -> list[float]:
    """The forecast after each value."""
    out = []
    for value in values:
        holt.add(value, dt)
        out.append(holt.ahead(HORIZON_S))
    return out


def damped_rise(slope: float, horizon_s: float = HORIZON_S) -> float:
    return slope * DEFAULT.damping_s * (1 - math.exp(-horizon_s / DEFAULT.damping_s))


def test_a_linear_trend_is_extrapolated_to_the_horizon_with_its_damping() -> None:
    holt = Holt()
    slope = 0.01  # slot-seconds per second, per second: +6 slots over 10 minutes
    ramp = [10 + slope * t for t in range(3600)]
    forecast = feed(holt, ramp)[-1]
    assert forecast == pytest.approx(ramp[-1] + damped_rise(slope), rel=0.01)
    assert ramp[-1] < forecast < ramp[-1] + slope * HORIZON_S  # damped: short of the straight line


def test_the_tick_length_does_not_change_the_forecast() -> None:
    coarse, fine = Holt(), Holt()
    feed(coarse, [10 + 0.01 * t for t in range(1200)], dt=1.0)
    feed(fine, [10 + 0.01 * t / 20 for t in range(1200 * 20)], dt=0.05)
    assert fine.ahead(HORIZON_S) == pytest.approx(coarse.ahead(HORIZON_S), rel=0.01)


def test_a_step_converges_to_the_new_level_within_the_ceiling() -> None:
    holt = Holt()
    before = feed(holt, [10.0] * 600)
    assert before[-1] == pytest.approx(10.0)
    after = feed(holt, [20.0] * 3600)
    assert 20.0 < max(after) <= 20.0 * DEFAULT.ceiling  # read as a ramp for a while, within bounds
    assert after[-1] == pytest.approx(20.0, rel=0.02)


def test_white_noise_around_a_constant_does_not_run_away() -> None:
    noise = random.Random(14)
    mean, sigma = 10.0, 5.0
    holt = Holt()
    forecast = feed(holt, [max(0.0, noise.gauss(mean, sigma)) for _ in range(7200)])
    settled = forecast[600:]  # past the first level's ten time constants
    assert mean * 0.5 < min(settled) and max(settled) < mean * 1.5
    assert sum(settled) / len(settled) == pytest.approx(mean, rel=0.05)


def test_the_ceiling_holds_and_the_forecast_is_never_negative() -> None:
    holt = Holt()
    capped = 0
    for value in [0.0] * 600 + [1.0] * 600:  # an idle pool woken: the trend's worst misread
        holt.add(value, 1.0)
        assert holt.level is not None
        straight = holt.level + damped_rise(holt.trend)
        capped += straight > DEFAULT.ceiling * holt.level
        expected = max(0.0, min(straight, DEFAULT.ceiling * holt.level))
        assert holt.ahead(HORIZON_S) == pytest.approx(expected)
    assert capped > 60
    assert holt.ahead(HORIZON_S) < DEFAULT.ceiling
    falling = Holt()
    feed(falling, [max(0.0, 100.0 - t) for t in range(300)])  # drained: the trend undershoots
    assert falling.level == 0.0 and falling.ahead(HORIZON_S) == 0.0
    woken = feed(falling, [10.0] * 60)
    assert woken[0] > 0  # demand back at once: a level held at 0, not dug below it
    assert Holt().ahead(HORIZON_S) == 0.0  # no sample yet: no opinion


def test_startup_s_defaults_to_ten_minutes_and_must_be_positive() -> None:
    pool = {"model": "m", "replicas": ["http://a:1"], "max_concurrency": 4}
    assert PoolSpec.model_validate(pool).startup_s == 600.0
    assert PoolSpec.model_validate({**pool, "startup_s": 90}).startup_s == 90.0
    with pytest.raises(ValidationError):
        PoolSpec.model_validate({**pool, "startup_s": 0})


async def test_the_forecast_gauge_is_on_a_running_gateways_metrics(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=0.2)
    policy = basic_policy(tokenizer_dir, [slow.url], max_concurrency=2, startup_s=120)
    policy["pools"]["main"]["health"] = {"interval_s": 0.05}
    gw = await gateway_factory(policy)

    async def user() -> None:
        for _ in range(6):
            async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200

    await asyncio.gather(*(user() for _ in range(8)))  # demand rising from nothing
    found = await scrape(http, gw)
    forecast = {s.labels["pool"]: s.value for s in found["llm_pool_desired_replicas_forecast"]}
    reactive = {s.labels["pool"]: s.value for s in found["llm_pool_desired_replicas"]}
    assert set(forecast) == set(reactive) == {"main"}
    assert 0 < forecast["main"]


async def test_after_a_burst_the_forecast_falls_with_the_measured_demand(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    """The level follows the burst down over its time constant and the trend keeps rising for a
    while: without the reactive estimate as a ceiling too, the forecast stayed high (and the HPA,
    taking the larger, asked for replicas) after the demand it forecast had gone."""
    slow = await stub_factory(delay_s=0.1)
    policy = basic_policy(tokenizer_dir, [slow.url], max_concurrency=4, startup_s=60)
    policy["pools"]["main"]["health"] = {"interval_s": 0.05}
    policy["pools"]["main"]["forecast"] = {"level_s": 1, "trend_s": 5, "damping_s": 5}
    gw = await gateway_factory(policy)
    demand = gw.gateway.slots["main"].demand

    async def user() -> None:
        for _ in range(6):
            async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200

    await asyncio.gather(*(user() for _ in range(8)))  # 8 slots' worth on a 4-slot replica
    assert demand.desired_replicas_forecast > 0
    await eventually(lambda: demand.desired_replicas < 0.05)  # the burst is over, as measured
    ceiling = DEFAULT.ceiling * demand.desired_replicas
    assert demand.desired_replicas_forecast <= ceiling
