"""Adaptive caps (`gateway/admit/limiter.py`): a replica's cap finds the knee of its latency curve
and holds there, within its bounds; and a real gateway shows the moves on /metrics."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.admit import Claim, LivePool
from gateway.admit.limiter import Limiter
from gateway.admit.replica import Replica
from gateway.config.schema import PoolSpec
from gateway.pick.picker import LeastInflightPicker
from loadtest.sim import Faults, Profile, ReplicaOptions, start_replica
from tests.conftest import basic_policy, eventually
from tests.fleet.test_resilience import scrape
from tests.loadtest.test_simulator import write_profile
from tests.state.test_shared_slots import leases, post, shared_policy

URL = "http://127.0.0.1:9000"
INTERVAL_S = 2.0  # the default: two simulated minutes are 60 windows
TARGET_MS = 250.0


def spec(
    top: int, replicas: tuple[str, ...] = (URL,), tokens: int | None = None, **adaptive: Any
) -> PoolSpec:
    return PoolSpec(
        model="m",
        replicas=list(replicas),
        max_concurrency=top,
        max_inflight_tokens=tokens,
        slo={"adaptive": {"target": {"ttft_ms": TARGET_MS}, "min_samples": 20, **adaptive}},
    )


def hockey_stick(knee: int, wall_s: float) -> Callable[[int], float]:
    """A replica's p90 TTFT at `running` requests: flat, under the target by more than the
    margin, up to the knee; past it every request adds `wall_s` (0.04: one more is within the
    target, two are over; 0.1: one more is over)."""
    return lambda running: 0.2 if running <= knee else 0.2 + wall_s * (running - knee)


def window(p90: float) -> list[float]:
    """20 answers whose nearest-rank p90 is `p90`: most far faster, and one outlier ten times
    slower (a mean or a maximum would read these otherwise)."""
    return [0.5 * p90] * 16 + [p90] * 3 + [10 * p90]


class Bench:
    """A limiter and its replica, run window by window on a simulated clock."""

    def __init__(self, start: int, top: int, **adaptive: Any) -> None:
        self.limiter = Limiter("p", spec(top, **adaptive))
        self.limiter.retune(spec(start, **adaptive))  # a reload to a lower cap clamps to it...
        self.limiter.retune(spec(top, **adaptive))  # ...and one back keeps it: it starts there
        assert self.limiter.caps(URL)[0] == start
        self.replica = Replica(URL, start, None)
        self.now = 0.0

    def run(self, latency: Callable[[int], float], windows: int, busy: int) -> list[int]:
        """`windows` windows of answers, the replica running min(cap, `busy`) requests: the
        caps after each."""
        limiter, replica = self.limiter, self.replica
        caps = []
        for _ in range(windows):
            replica.inflight = min(limiter.caps(URL)[0], busy)
            for ttft_s in window(latency(replica.inflight)):
                limiter.observe(replica, self.now, ttft_s, None)
            self.now += INTERVAL_S
            limiter.decide([replica], self.now)
            caps.append(limiter.caps(URL)[0])
        return caps


@pytest.mark.parametrize("start", [80, 20], ids=["2x-above", "2x-below"])
@pytest.mark.parametrize("wall_s", [0.04, 0.1], ids=["knee", "wall"])
def test_the_cap_finds_the_knee_from_twice_above_or_below(start: int, wall_s: float) -> None:
    knee = 40
    bench = Bench(start, top=160)
    caps = bench.run(hockey_stick(knee, wall_s), windows=60, busy=1000)
    # Found at the first fall to within 10% of the knee (from below, after the probe that went
    # past it by one step): within 30 simulated seconds of the first answers.
    found = next(
        i for i in range(1, 60) if caps[i] < caps[i - 1] and abs(caps[i] - knee) <= 0.1 * knee
    )
    assert found < 15
    if start < knee:
        assert max(caps) <= knee + round(knee**0.5)
    after = caps[found:]
    # AIMD saws under a wall no step can stand on: over by one, down by the backoff, back up
    # in halving steps. Its average stays within 10% of the knee, and no cap over it by more.
    assert all(0.85 * knee - 1 <= cap <= 1.1 * knee for cap in after)
    assert abs(sum(after) / len(after) - knee) <= 0.1 * knee
    if wall_s == 0.04:  # a cap one past the knee is within the target: it stays there
        assert after[-20:] == [knee + 1] * 20
    assert bench.limiter.moves["grow"] > 0 and bench.limiter.moves["ttft_over"] > 0


def test_an_idle_replica_does_not_grow_however_fast_it_answers() -> None:
    bench = Bench(20, top=160)
    fast = hockey_stick(40, 0.1)
    assert bench.run(fast, windows=10, busy=12) == [20] * 10  # 12 in flight of 20: idle
    assert bench.limiter.moves == {}
    assert bench.run(fast, windows=1, busy=18) == [24]  # at its cap, within the margin: it grows


def test_the_caps_never_leave_their_bounds_and_the_token_cap_follows() -> None:
    rng = random.Random(7)
    bench = Bench(8, top=16, tokens=16_000, min_concurrency=3)

    def wild(running: int) -> float:
        return rng.choice([0.01, 0.2, 0.3, 5.0])

    for _ in range(20):
        caps = bench.run(wild, windows=10, busy=rng.choice([2, 16, 1000]))
        assert all(3 <= cap <= 16 for cap in caps)
        limit, tokens = bench.limiter.caps(URL)
        assert tokens == 16_000 * limit // 16
    assert bench.limiter.moves["grow"] > 0 and bench.limiter.moves["ttft_over"] > 0


def test_answers_to_requests_granted_under_an_earlier_cap_do_not_move_it_again() -> None:
    """The requests over a cap just lowered still answer slowly: they say nothing of the new
    cap, and counting them would lower it twice for one cause."""
    bench = Bench(40, top=40)
    limiter, replica = bench.limiter, bench.replica
    replica.inflight = 40
    for ttft_s in window(0.4):
        limiter.observe(replica, 0.0, ttft_s, None)
    limiter.decide([replica], INTERVAL_S)
    assert limiter.caps(URL)[0] == 34
    for ttft_s in window(0.4):  # granted before the move, answered after it
        limiter.observe(replica, INTERVAL_S - 1, ttft_s, None)
    assert limiter.decide([replica], 2 * INTERVAL_S) == []
    assert limiter.caps(URL)[0] == 34


def test_a_cap_moves_at_most_once_an_interval_and_only_on_enough_answers() -> None:
    bench = Bench(40, top=40)
    limiter, replica = bench.limiter, bench.replica
    replica.inflight = 40
    for ttft_s in window(0.4)[:19]:
        limiter.observe(replica, 0.0, ttft_s, None)
    assert limiter.decide([replica], 10.0) == []  # 19 answers of 20
    limiter.observe(replica, 0.0, 0.4, None)
    assert limiter.decide([replica], 10.0) == [(replica, False)]
    for ttft_s in window(0.4):
        limiter.observe(replica, 10.0, ttft_s, None)
    assert limiter.decide([replica], 10.0 + INTERVAL_S / 2) == []  # too soon
    assert limiter.decide([replica], 10.0 + INTERVAL_S) == [(replica, False)]


def test_tpot_over_its_target_lowers_the_cap_under_its_own_reason(caplog) -> None:
    limiter = Limiter("p", _tpot_spec())
    replica = Replica(URL, 32, None)
    replica.inflight = 32
    for tpot_s in window(0.08):  # 80 ms a token against 50
        limiter.observe(replica, 0.0, 0.01, tpot_s)
    with caplog.at_level(logging.INFO, "gateway.admit"):
        assert limiter.decide([replica], INTERVAL_S) == [(replica, False)]
    assert limiter.moves == {"tpot_over": 1} and limiter.caps(URL)[0] == 27
    assert f"replica {URL}'s cap 32 -> 27: its p90 TPOT, 80 ms, is over the 50 ms target" in (
        caplog.text
    )


def _tpot_spec() -> PoolSpec:
    return PoolSpec(
        model="m",
        replicas=[URL],
        max_concurrency=32,
        slo={"adaptive": {"target": {"ttft_ms": 1000, "tpot_ms": 50}, "min_samples": 20}},
    )


def test_a_reload_keeps_the_limits_of_the_replicas_that_stay_clamped_to_the_new_bounds() -> None:
    urls = (URL, "http://127.0.0.1:9001")
    slots = LivePool("p", spec(40, urls), LeastInflightPicker(None))
    assert slots.limiter is not None
    for replica, limit in zip(slots.replicas, (34, 20), strict=True):
        slots.limiter._caps[replica.url].limit = limit  # where earlier windows left them
    slots.update(spec(30, (*urls, "http://127.0.0.1:9002"), tokens=3000), slots.picker)
    assert [(r.max_concurrency, r.cap, r.max_tokens) for r in slots.replicas] == [
        (30, 30, 3000),  # clamped to the new top
        (20, 20, 2000),  # kept, its token cap in proportion
        (25, 25, 2500),  # joined at its peers' mean
    ]
    assert slots.capacity == 75 and slots.replica_cap == 25
    slots.update(spec(30, urls, min_concurrency=24), slots.picker)
    assert [r.max_concurrency for r in slots.replicas] == [30, 24]  # raised to the new floor
    plain = spec(30, urls).model_copy(update={"slo": None})
    slots.update(plain, slots.picker)
    assert slots.limiter is None and [r.max_concurrency for r in slots.replicas] == [30, 30]


async def test_a_cap_that_grows_lets_a_waiter_in_without_waiting_for_a_release() -> None:
    slots = LivePool("p", spec(2), LeastInflightPicker(None))
    slots.update(spec(4), slots.picker)  # its limit stays 2 of a top of 4
    held = [await slots.acquire(Claim(1)) for _ in range(2)]
    waiter = asyncio.create_task(slots.acquire(Claim(1)))
    await asyncio.sleep(0)
    assert slots.waiting == 1 and slots.replica_cap == 2
    assert slots.limiter is not None
    for ttft_s in window(0.1):  # fast answers at its cap, granted now
        slots.limiter.observe(slots.replicas[0], time.perf_counter(), ttft_s, None)
    slots.adapt()  # the health checker's tick: 2 + round(sqrt(2))
    assert slots.waiting == 0 and slots.replicas[0].inflight == 3 and slots.replica_cap == 3
    assert (await waiter).replica is slots.replicas[0]
    for grant in [*held, await waiter]:
        slots.release(grant)


def test_a_replica_joining_leaves_the_others_windows_open() -> None:
    """DNS finding one more replica is a reload: the answers the others' windows hold stay."""
    slots = LivePool("p", spec(40), LeastInflightPicker(None))
    assert slots.limiter is not None
    replica = slots.replicas[0]
    replica.inflight = 40
    answers = window(0.4)
    for ttft_s in answers[:19]:
        slots.limiter.observe(replica, 0.0, ttft_s, None)
    slots.update(spec(40, (URL, "http://127.0.0.1:9001")), slots.picker)
    slots.limiter.observe(replica, 0.0, answers[19], None)
    assert slots.limiter.decide([replica], INTERVAL_S) == [(replica, False)]


def test_the_floor_must_fit_under_the_cap_and_beside_the_reserve() -> None:
    with pytest.raises(ValueError, match="min_concurrency` \\(9\\) is over `max_concurrency"):
        spec(8, min_concurrency=9)
    with pytest.raises(ValueError, match="leaves no slot beside the 2 `reserve` keeps"):
        PoolSpec(
            model="m",
            replicas=[URL],
            max_concurrency=8,
            reserve={"classification": 2},
            slo={"adaptive": {"target": {"ttft_ms": 100}, "min_concurrency": 2}},
        )


async def test_with_redis_the_adaptive_cap_bounds_every_gateway_together(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    """The ledger is asked for a lease against the limit in force, not the policy's cap: two
    gateways at a limit of 2 run 2 requests on the replica, not 2 each."""
    replica = await stub_factory(delay_s=0.05)
    policy = shared_policy(tokenizer_dir, replica.url, fresh_redis, cap=6, gateways=2)
    policy["pools"]["main"]["slo"] = {"adaptive": {"target": {"ttft_ms": 1000}}}
    gateways = [await gateway_factory(policy) for _ in range(2)]
    for gw in gateways:
        slots = gw.gateway.slots["main"]
        top = slots.spec
        slots.update(top.model_copy(update={"max_concurrency": 2}), slots.picker)
        slots.update(top, slots.picker)  # the limit stays at 2 of a top of 6
        assert slots.replicas[0].max_concurrency == 2
    statuses = await asyncio.gather(*(post(http, gw.url) for _ in range(10) for gw in gateways))
    assert statuses == [200] * 20
    assert replica.stats.max_running == 2


async def test_with_redis_a_cap_that_shrinks_gives_this_gateways_spares_back(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    """A spare is taken without asking Redis: one kept under the old limit would let a request
    past the new one, so a limit that falls gives the replica's spares back."""
    replica = await stub_factory()
    policy = shared_policy(
        tokenizer_dir, replica.url, fresh_redis, cap=6, timeout_s=2.0, lease_ttl_s=60,
        spare_slots_s=60,
    )  # fmt: skip
    policy["pools"]["main"]["slo"] = {"adaptive": {"target": {"ttft_ms": 1000}}}
    gw = await gateway_factory(policy)
    assert await asyncio.gather(*(post(http, gw.url) for _ in range(4))) == [200] * 4
    assert leases(fresh_redis) > 0  # spares, kept for a minute
    slots = gw.gateway.slots["main"]
    assert slots.limiter is not None
    for ttft_s in window(3.0):  # slow answers: over the target
        slots.limiter.observe(slots.replicas[0], time.perf_counter(), ttft_s, None)
    slots.adapt()
    assert slots.replicas[0].max_concurrency < 6
    await eventually(lambda: leases(fresh_redis) == 0)


# --- a real gateway in front of a simulated replica ---------------------------------------------


@pytest.fixture
def tiny(tmp_path: Path) -> Profile:
    return write_profile(tmp_path)


async def test_a_replica_that_gets_slow_has_its_cap_lowered_on_metrics_then_grown_back(
    tiny: Profile, tokenizer_dir: Path, gateway_factory, http: aiohttp.ClientSession, caplog
) -> None:
    replica = await start_replica(tiny, ReplicaOptions(1000, tokenizer_dir))
    loading: list[asyncio.Task[None]] = []
    try:
        policy = basic_policy(tokenizer_dir, [replica.url], max_concurrency=8)
        pool = policy["pools"]["main"]
        pool["health"] = {"interval_s": 0.05}  # the tick the caps move on
        pool["queue"] = {"max_wait_s": 60}
        pool["slo"] = {
            "adaptive": {
                "target": {"ttft_ms": 150},
                "min_concurrency": 2,
                "interval_s": 0.1,
                "min_samples": 4,
            }
        }
        gw = await gateway_factory(policy)
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "stream": True,
        }
        stop = asyncio.Event()

        async def user() -> None:
            for _ in range(2000):  # bounded: the test stops it long before
                if stop.is_set():
                    return
                async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()

        async def metrics() -> tuple[float, dict[str, float]]:
            found = await scrape(http, gw)
            [cap] = found["llm_replica_adaptive_cap"]
            assert cap.labels == {"pool": "main", "replica": replica.url}
            moves = {
                s.labels["reason"]: s.value for s in found.get("llm_adaptive_cap_moves_total", [])
            }
            return cap.value, moves

        assert await metrics() == (8.0, {})
        slots = gw.gateway.slots["main"]
        replica.set_faults(Faults(first_token_delay_s=500))  # half a second before each answer
        with caplog.at_level(logging.INFO, "gateway.admit"):
            loading = [asyncio.create_task(user()) for _ in range(8)]
            await eventually(lambda: slots.replicas[0].max_concurrency == 2, within_s=60)
        cap, moves = await metrics()
        assert cap == 2.0 and moves["ttft_over"] >= 4 and "grow" not in moves
        assert f"replica {replica.url}'s cap 8 -> 6: its p90 TTFT" in caplog.text
        assert slots.replicas[0].cap == 2 and slots.capacity == 2
        # 8 users' worth of slots over the limit in force, 2: 4 replicas (over the policy's 8: 1).
        # Averaged: a wait is counted when it ends, so one tick may read a burst of them.
        desired = []
        for _ in range(40):
            await asyncio.sleep(0.05)
            desired.append(slots.demand.desired_replicas)
        assert sum(desired) / len(desired) > 2

        replica.set_faults(Faults())  # fast again, and 8 users keep its 2 slots full
        await eventually(lambda: slots.replicas[0].max_concurrency == 8, within_s=60)
        cap, moves = await metrics()
        assert cap == 8.0 and moves["grow"] >= 3
    finally:
        for task in loading:
            task.cancel()
        await asyncio.gather(*loading, return_exceptions=True)
        await replica.close()


def test_a_cap_written_too_low_grows_past_it_to_the_adaptive_ceiling() -> None:
    limiter = Limiter("p", spec(20, max_concurrency=160))
    assert limiter.caps(URL)[0] == 20  # it starts where the pool's cap was written
    replica, now, caps = Replica(URL, 20, None), 0.0, []
    for _ in range(30):
        replica.inflight = limiter.caps(URL)[0]
        for ttft_s in window(hockey_stick(40, 0.1)(replica.inflight)):
            limiter.observe(replica, now, ttft_s, None)
        now += INTERVAL_S
        limiter.decide([replica], now)
        caps.append(limiter.caps(URL)[0])
    assert max(caps) > 20 and abs(caps[-1] - 40) <= 4
    with pytest.raises(ValueError, match="under `max_concurrency`"):
        spec(20, max_concurrency=10)
