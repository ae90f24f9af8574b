"""The latency model predicts what a replica's load will cost a request, and learns it online.

Trained on a replica whose TTFT grows with the prefill ahead of a request and whose TPOT grows
with its decode batch (as vLLM's does), the model must predict far better than any constant,
and placement by its predictions must steer a request away from the loaded replica: a model
replaced by a constant fails both.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.admit import Claim, Replica
from gateway.admit.fairqueue import Place
from gateway.admit.latency import Fit, Flight, LatencyModel
from gateway.admit.pool import LivePool
from gateway.api import BY_NAME
from gateway.config.schema import LatencyModelSpec, PoolSpec
from gateway.context.ctx import Ctx
from gateway.context.objective import Objective
from gateway.pick.picker import LeastInflightPicker

SEED = LatencyModelSpec()
SEED_FIT = (0.02, 0.06, 0.1)


def true_ttft(prefill_tokens: int, decoding: int) -> float:
    return 0.025 + 0.09 * prefill_tokens / 1000 + 0.0015 * decoding


def true_tpot(batch: int, context_tokens: int) -> float:
    return 0.012 + 0.0004 * batch + 0.0002 * context_tokens / 1000


def claim(tokens: int, output: int = 100, objective: Objective | None = None) -> Claim:
    return Claim(tokens + output, objective=objective, input_tokens=tokens)


def train(model: LatencyModel, replica: Replica, rounds: int, rng: random.Random) -> None:
    """Requests arrive on `replica` at random loads; each stream's first token and TPOT come
    back as the true curves say, with noise."""
    flights = []
    for _ in range(rounds):
        if flights and rng.random() < 0.5:  # one leaves
            flight, c = flights.pop(rng.randrange(len(flights)))
            model.released(flight)
            replica.untake(c)
            continue
        c = claim(rng.choice((200, 500, 2000, 4000)))
        replica.take(c)
        state = model.of(replica)
        prefill_ahead, decoding = state.prefill_tokens, state.decoding
        flight, _ = model.admitted(replica, c, 0.0, stream=True)
        noise = rng.uniform(0.95, 1.05)
        flight.prefilled(
            flight.granted + noise * true_ttft(prefill_ahead + c.input_tokens, decoding)
        )
        batch, context = state.decoding, replica.inflight_tokens
        model.observe_tpot(flight, noise * true_tpot(batch, context))
        flights.append((flight, c))
        if len(flights) > 48 or rng.random() < 0.3:  # some finish prefill-free, making room
            flight, c = flights.pop(0)
            model.released(flight)
            replica.untake(c)


def test_a_fit_recovers_a_linear_law_from_noisy_samples() -> None:
    rng = random.Random(7)
    fit = Fit((0.0, 0.0, 0.0), 0.999)
    for _ in range(400):
        x = (1.0, rng.uniform(0, 8), rng.uniform(0, 2))
        fit.observe(x, 0.02 + 0.05 * x[1] + 0.3 * x[2] + rng.gauss(0, 0.002))
    assert fit.theta == pytest.approx([0.02, 0.05, 0.3], abs=0.01)


def test_no_load_makes_a_replica_faster() -> None:
    fit = Fit((0.05, 0.05, 0.05), 0.99)
    for _ in range(50):
        fit.observe((1.0, 1.0, 1.0), 0.0)  # samples that pull every coefficient below zero
    assert min(fit.theta) >= 0.0


def test_a_fit_stays_put_over_many_samples() -> None:
    """Rounding leaves P slightly asymmetric, and forgetting multiplies that by 1/forgetting
    at every sample: at the default forgetting a fit updated as a full matrix diverged after
    some 10,000 samples (θ to infinity, then predictions NaN, which no headroom compares
    above, so placement by headroom found no replica at all)."""
    rng = random.Random(9)
    fit = Fit(SEED_FIT, SEED.forgetting)
    for _ in range(30_000):
        x = (1.0, rng.uniform(0, 2), rng.uniform(0, 0.6))
        fit.observe(x, 0.02 + 0.06 * x[1] + 0.1 * x[2] + rng.gauss(0, 0.001))
    assert fit.theta == pytest.approx([0.02, 0.06, 0.1], abs=0.005)
    assert fit.p[0][1] == fit.p[1][0] and fit.p[1][2] == fit.p[2][1]


def test_a_quiet_direction_does_not_wind_up() -> None:
    """Forgetting divides the fit's uncertainty by `forgetting` at every sample; a feature that
    stays 0 (nothing decoding while a replica serves one request at a time) never brings its
    direction back down. Unbounded, one noisy sample after a quiet stretch set the whole
    per-running coefficient (a 50 ms miss made it 50 ms per running request), and after about
    `log(1e308) / -log(forgetting)` samples the uncertainty overflowed and the fit went to a
    constant 0 for good."""
    rng = random.Random(5)
    for forgetting, quiet in ((0.995, 5000), (0.91, 20_000)):
        fit = Fit(SEED_FIT, forgetting)
        for _ in range(quiet):
            x = (1.0, rng.uniform(0, 2), 0.0)
            fit.observe(x, 0.02 + 0.06 * x[1] + rng.gauss(0, 0.001))
        assert all(math.isfinite(v) for row in fit.p for v in row)
        assert fit.theta == pytest.approx([0.02, 0.06, 0.1], abs=0.005)
        fit.observe((1.0, 1.0, 0.01), 0.08 + 0.001 + 0.05)  # one request decoding, 50 ms late
        assert fit.theta[2] < 0.1 + 1.0  # under 11 ms more per running request, not 50


def test_predictions_beat_any_constant_on_a_loaded_replica() -> None:
    rng = random.Random(1)
    model, replica = LatencyModel(SEED), Replica("http://a", 64, None)
    train(model, replica, 3000, rng)
    errors, observed, tpot_errors, tpots = [], [], [], []
    for _ in range(300):  # held out: fresh loads, not trained on
        prefill, decoding = rng.randrange(0, 30_000), rng.randrange(0, 64)
        state = model.of(replica)
        state.prefill_tokens, state.decoding = prefill, decoding
        replica.inflight_tokens = context = rng.randrange(0, 200_000)
        c = claim(1000)
        predicted = model.predict(replica, c, 0.0)
        truth = true_ttft(prefill + 1000, decoding)
        errors.append(abs(predicted.ttft_s - truth))
        observed.append(truth)
        tpot_truth = true_tpot(decoding + 1, context + c.tokens)
        tpot_errors.append(abs(predicted.tpot_s - tpot_truth))
        tpots.append(tpot_truth)
    median = statistics.median(observed)
    constant = statistics.median(abs(t - median) for t in observed)
    assert statistics.median(errors) < 0.2 * constant
    tpot_median = statistics.median(tpots)
    tpot_constant = statistics.median(abs(t - tpot_median) for t in tpots)
    assert statistics.median(tpot_errors) < 0.3 * tpot_constant


def test_placement_by_headroom_avoids_the_replica_with_prefill_ahead() -> None:
    spec = PoolSpec(
        model="m",
        replicas=["http://busy", "http://idle"],
        max_concurrency=8,
        slo={"objectives": {"standard": {"ttft_ms": 400}}},
    )
    pool = LivePool("p", spec, LeastInflightPicker(None))
    assert pool.latency is not None
    rng = random.Random(3)
    for replica in pool.replicas:
        train(pool.latency, replica, 1500, rng)
        while replica.inflight:  # leave it idle
            replica.untake(claim(0, 0))
    busy, idle = pool.replicas
    pool.latency.of(busy).prefill_tokens = 8000  # two long prompts ahead of its next request
    now = time.perf_counter()
    objective = Objective(0.4, math.inf, now + 0.4)
    assert pool._pick(pool.replicas, claim(500, objective=objective)) is idle


def test_one_stall_moves_the_fit_as_a_sample_three_times_the_prediction_would() -> None:
    fit = Fit((0.02, 0.0, 0.0), 0.995)
    for _ in range(200):
        fit.observe((1.0, 0.0, 0.0), 0.02)
    fit.observe((1.0, 0.0, 0.0), 5.0)  # another request's long prefill shared its steps
    assert fit.predict((1.0, 0.0, 0.0)) < 0.03
    for _ in range(600):  # but a replica that really slowed is followed, at the fit's memory
        fit.observe((1.0, 0.0, 0.0), 0.05)
    assert fit.predict((1.0, 0.0, 0.0)) == pytest.approx(0.05, rel=0.05)


async def test_a_replicas_usage_past_the_bound_trains_nothing(tiny_policy) -> None:
    """A replica's usage is its word: a stream that claims 10^12 output tokens over a second
    is a TPOT of a picosecond, which the fit would take toward 0 (every TPOT objective then
    "met"). A count past what the request could be answered with trains nothing; an honest
    one trains the fit."""
    spec = PoolSpec(model="m", replicas=["http://a"], max_concurrency=4, slo={})
    pool = LivePool("p", spec, LeastInflightPicker(None))
    assert pool.latency is not None
    for output, samples in ((10**12, 0), (50, 1)):
        ctx = Ctx(
            request_id="r",
            api=BY_NAME["chat"],
            path="/v1/chat/completions",
            headers=CIMultiDictProxy(CIMultiDict()),
            arrived=time.perf_counter(),
        )
        ctx.pool, ctx.stream, ctx.max_output, ctx.input_tokens = (
            tiny_policy.pools["main"],
            True,
            64,
            100,
        )
        async with pool.slot(ctx, Place()) as grant:
            assert isinstance(ctx.prefill, Flight)
            ctx.prefill.prefilled(time.perf_counter())
            ctx.first_token, ctx.output_tokens = time.perf_counter() - 1.0, output
            pool.answered(grant, ctx, None)
        assert pool.latency.tpot.samples == samples
