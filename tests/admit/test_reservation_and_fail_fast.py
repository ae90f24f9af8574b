"""Slots kept for a class (`reserve`, with borrowing), and refusing at once a request whose
predicted queue wait is confidently over `max_wait_s` (`queue.fail_fast`).

The first half drives `LivePool` directly, as tests/admit/test_slots.py does; the second half puts a
stub replica and the gateway on loopback and floods them over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.admit import Claim, Grant, HoldTimes, LivePool
from gateway.config.load import PolicyError
from gateway.config.schema import PRIORITIES, PoolSpec
from gateway.errors import QueueWaitTooLong
from gateway.pick.picker import LeastInflightPicker
from gateway.policy.compile import load_policy
from loadtest.tiny_tokenizer import WORDS
from tests.conftest import RunningGateway, basic_policy, eventually

CRITICAL, STANDARD, SHEDDABLE = (PRIORITIES.index(t) for t in ("critical", "standard", "sheddable"))


def pool(replicas: int = 1, cap: int = 1, **spec: object) -> LivePool:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(replicas)]
    return LivePool(
        "p",
        PoolSpec(model="m", replicas=urls, max_concurrency=cap, **spec),
        LeastInflightPicker(None),
    )


def long_(tokens: int = 10) -> Claim:
    return Claim(tokens, workload="long")


def short(tokens: int = 10) -> Claim:
    return Claim(tokens, workload="short")


async def queued(slots: LivePool, claim: Claim) -> asyncio.Task[Grant]:
    """Start an acquire that has to wait, and return once it is in the queue."""
    before = slots.waiting
    task = asyncio.create_task(slots.acquire(claim))
    await asyncio.sleep(0)
    assert not task.done(), "expected to wait"
    assert slots.waiting == before + 1
    return task


async def cancel_all(tasks: list[asyncio.Task[Grant]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# --- reservation, LivePool alone ----------------------------------------------------------


async def test_a_reserved_slot_stays_free_for_its_class() -> None:
    slots = pool(cap=4, reserve={"short": 1})
    replica = slots.replicas[0]
    longs = [await slots.acquire(long_()) for _ in range(3)]  # 4 - 1 kept for short
    assert replica.inflight == 3
    assert replica.fits(short()) and not replica.fits(long_())
    got = await asyncio.wait_for(slots.acquire(short()), 0.5)  # the kept slot, at once
    assert got.replica is replica and replica.inflight == 4
    assert replica.by_class == {"long": 3, "short": 1}
    for grant in [*longs, got]:
        slots.release(grant)
    assert replica.inflight == 0 and replica.by_class == {}


async def test_a_long_claim_waits_for_a_long_slot_not_the_reserved_one() -> None:
    slots = pool(cap=4, reserve={"short": 1})
    longs = [await slots.acquire(long_()) for _ in range(3)]
    fourth = await queued(slots, long_())
    await asyncio.sleep(0.05)
    assert not fourth.done() and slots.replicas[0].inflight == 3  # one slot idle, kept
    slots.release(longs[0])  # a long slot frees: the waiter takes it
    granted = await asyncio.wait_for(fourth, 0.5)
    assert slots.replicas[0].by_class == {"long": 3} and slots.waiting == 0
    for grant in [*longs[1:], granted]:
        slots.release(grant)


async def test_a_short_claim_is_admitted_while_long_ones_queue() -> None:
    slots = pool(cap=4, reserve={"short": 1})
    longs = [await slots.acquire(long_()) for _ in range(3)]
    waiting = [await queued(slots, long_()) for _ in range(2)]
    try:
        got = await asyncio.wait_for(slots.acquire(short()), 0.5)
        assert got.replica.by_class == {"long": 3, "short": 1}
        assert slots.waiting == 2  # the long ones still wait
    finally:
        await cancel_all(waiting)
        for grant in longs:
            slots.release(grant)


async def test_a_reserved_class_borrows_every_unreserved_slot() -> None:
    slots = pool(cap=4, reserve={"short": 1})
    replica = slots.replicas[0]
    shorts = [await slots.acquire(short()) for _ in range(4)]  # no long traffic: all four
    assert replica.by_class == {"short": 4}
    waiting_long = await queued(slots, long_())  # full: even a long waits now
    slots.release(shorts[0])  # 3 short in flight, 1 free: short uses more than it keeps
    granted = await asyncio.wait_for(waiting_long, 0.5)
    assert replica.by_class == {"short": 3, "long": 1}
    slots.release(granted)  # a long finishes: the free slot is open to both classes
    assert replica.fits(long_()) and replica.fits(short())
    for grant in shorts[1:]:
        slots.release(grant)
    assert replica.inflight == 0 and replica.by_class == {}


async def test_reservations_for_two_classes() -> None:
    slots = pool(cap=6, reserve={"short": 1, "embed": 2})
    replica = slots.replicas[0]
    longs = [await slots.acquire(long_()) for _ in range(3)]  # 6 - 1 - 2
    assert not replica.fits(long_())
    assert replica.fits(short()) and replica.fits(Claim(1, workload="embed"))
    embeds = [await slots.acquire(Claim(1, workload="embed")) for _ in range(2)]
    # Both of embed's slots are used now; short's one is still kept from everybody else.
    assert not replica.fits(Claim(1, workload="embed")) and not replica.fits(long_())
    assert replica.fits(short())
    slots.release(longs[0])  # the freed unreserved slot: anybody, embed borrows it
    borrowed = await slots.acquire(Claim(1, workload="embed"))
    assert replica.by_class == {"long": 2, "embed": 3}
    last = await slots.acquire(short())
    assert replica.inflight == 6 and not replica.fits(short())
    for grant in [*longs[1:], *embeds, borrowed, last]:
        slots.release(grant)
    assert replica.inflight == 0 and replica.by_class == {}


async def test_reservations_are_per_replica() -> None:
    slots = pool(replicas=2, cap=2, reserve={"short": 1})
    longs = [await slots.acquire(long_()) for _ in range(2)]  # one on each replica
    assert sorted(g.replica.url for g in longs) == sorted(r.url for r in slots.replicas)
    shorts = [await slots.acquire(short()) for _ in range(2)]  # each replica's kept slot
    assert [r.by_class for r in slots.replicas] == [{"long": 1, "short": 1}] * 2
    for grant in longs + shorts:
        slots.release(grant)


def test_reservations_must_leave_a_slot_unreserved() -> None:
    with pytest.raises(ValidationError, match="`reserve` keeps 4 slots of 4"):
        PoolSpec(model="m", replicas=["http://127.0.0.1:1"], max_concurrency=4,
                 reserve={"short": 1, "embed": 3})  # fmt: skip
    with pytest.raises(ValidationError):
        PoolSpec(model="m", replicas=["http://127.0.0.1:1"], max_concurrency=4,
                 reserve={"short": 0})  # fmt: skip
    PoolSpec(model="m", replicas=["http://127.0.0.1:1"], max_concurrency=4,
             reserve={"short": 1, "embed": 2})  # fmt: skip


POLICY_WITH_RESERVE = """\
models:
  a: {tokenizer: estimate, max_model_len: 10}
pools:
  pa:
    model: a
    replicas: ['http://127.0.0.1:1']
    max_concurrency: 4
    reserve: {short: 1, %s: %d}
classes: [{name: short}, {name: long}]
routes: [{pool: pa}]
"""


def test_an_oversized_reservation_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(POLICY_WITH_RESERVE % ("long", 3))
    with pytest.raises(PolicyError, match=r"x.yaml:\d+: pools.pa: .*`reserve` keeps 4 slots of 4"):
        load_policy(path)


def test_a_reservation_for_an_unknown_class_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(POLICY_WITH_RESERVE % ("lnog", 1))
    with pytest.raises(PolicyError, match=r"x.yaml:8: pools.pa.reserve.lnog: unknown class 'lnog'"):
        load_policy(path)
    path.write_text(POLICY_WITH_RESERVE % ("long", 1))
    assert load_policy(path).pools["pa"].spec.reserve == {"short": 1, "long": 1}


# --- fail fast, LivePool alone ------------------------------------------------------------


def history(slots: LivePool, samples: list[float]) -> None:
    for seconds in samples:
        slots.holds[0].add(seconds)


async def test_a_confidently_long_wait_is_refused_at_once() -> None:
    slots = pool(cap=2, queue={"max_wait_s": 2.0})
    history(slots, [0.9, 1.1] * 12)  # mean 1.0 s, lower bound ~0.94 s
    mean, low = slots.holds[0].mean() or (0, 0)
    assert mean == pytest.approx(1.0) and 0.9 < low < 1.0
    held = [await slots.acquire(Claim(1)) for _ in range(2)]
    # Place p drains in p * hold / 2 slots: 4 * 0.94 / 2 < 2 s, so four may wait...
    waiters = [await queued(slots, Claim(1)) for _ in range(4)]
    fifth = slots.acquire(Claim(1))
    with pytest.raises(QueueWaitTooLong) as refused:
        fifth.send(None)  # ...and the fifth is told at once: in its first step, before any wait
    assert refused.value.retry_after_s == pytest.approx(5 * 1.0 / 2)  # the point estimate
    assert refused.value.headers() == {"x-should-retry": "true", "Retry-After": "3"}
    assert (refused.value.status, refused.value.code) == (429, "queue_wait_too_long")
    assert slots.waiting == 4  # the refused one never queued
    await cancel_all(waiters)
    for grant in held:
        slots.release(grant)
    assert slots.waiting == 0 and slots.inflight == 0


async def test_without_enough_history_nothing_is_refused_early() -> None:
    slots = pool(cap=1, queue={"max_wait_s": 1.0})
    history(slots, [5.0] * (HoldTimes.MIN_SAMPLES - 1))
    assert slots.holds[0].mean() is None
    held = await slots.acquire(Claim(1))
    waiters = [await queued(slots, Claim(1)) for _ in range(10)]  # 50 s predicted: still queued
    slots.holds[0].add(5.0)  # the twentieth sample: now the next one is refused
    with pytest.raises(QueueWaitTooLong):
        await slots.acquire(Claim(1))
    await cancel_all(waiters)
    slots.release(held)


async def test_fail_fast_off_queues_everybody() -> None:
    slots = pool(cap=1, queue={"max_wait_s": 1.0, "fail_fast": False})
    history(slots, [5.0] * 50)
    held = await slots.acquire(Claim(1))
    waiters = [await queued(slots, Claim(1)) for _ in range(10)]
    await cancel_all(waiters)
    slots.release(held)


async def test_only_waiters_of_its_tier_and_above_count_towards_its_place() -> None:
    slots = pool(cap=1, queue={"max_wait_s": 2.5})
    history(slots, [1.0] * 30)  # no spread: the lower bound is the mean
    held = await slots.acquire(Claim(1))
    waiters = [await queued(slots, Claim(1, STANDARD)) for _ in range(2)]
    with pytest.raises(QueueWaitTooLong):  # place 3: 3 s > 2.5 s
        await slots.acquire(Claim(1, STANDARD))
    with pytest.raises(QueueWaitTooLong):  # sheddable waits behind them too
        await slots.acquire(Claim(1, SHEDDABLE))
    waiters.append(await queued(slots, Claim(1, CRITICAL)))  # place 1: it goes first
    waiters.append(await queued(slots, Claim(1, CRITICAL)))  # place 2
    with pytest.raises(QueueWaitTooLong) as refused:  # place 3 among the critical ones
        await slots.acquire(Claim(1, CRITICAL))
    assert refused.value.retry_after_s == pytest.approx(3.0)
    await cancel_all(waiters)
    slots.release(held)


async def test_a_flooding_tenant_does_not_get_another_tenant_refused() -> None:
    slots = pool(cap=1, queue={"max_wait_s": 3.0})
    history(slots, [1.0] * 30)
    held = await slots.acquire(Claim(1))
    flood = [await queued(slots, Claim(1, tenant="a")) for _ in range(3)]
    try:
        # Tenant b's start tag is the head's: it would be served second, after ~2 s.
        other = asyncio.create_task(slots.acquire(Claim(1, tenant="b")))
        flood.append(other)
        await asyncio.sleep(0)
        if other.done():
            other.result()  # raises QueueWaitTooLong: refused although it would not wait long
        assert slots.waiting == 4
    finally:
        await cancel_all(flood)
        slots.release(held)


@settings(max_examples=150, deadline=None)
@given(
    samples=st.lists(st.floats(0.01, 10.0), min_size=HoldTimes.MIN_SAMPLES, max_size=300),
    cap=st.integers(1, 4),
    max_wait_s=st.floats(0.5, 60.0),
)
async def test_a_burst_that_drains_in_time_is_never_refused(
    samples: list[float], cap: int, max_wait_s: float
) -> None:
    slots = pool(cap=cap, queue={"max_wait_s": max_wait_s})
    history(slots, samples)
    measured = slots.holds[0].mean()
    assert measured is not None
    mean, low = measured
    assert 0 <= low <= mean
    held = [await slots.acquire(Claim(1)) for _ in range(cap)]
    # The longest burst whose point-estimate wait, last place included, is within max_wait.
    burst = math.floor(max_wait_s * cap / mean * (1 - 1e-9)) if mean > 0 else 100
    burst = min(burst, 200)
    waiters = []
    try:
        for _ in range(burst):
            waiters.append(await queued(slots, Claim(1)))  # asserts it waits, not refused
    finally:
        await cancel_all(waiters)
        for grant in held:
            slots.release(grant)
    assert slots.waiting == 0 and slots.inflight == 0


# --- over HTTP ------------------------------------------------------------------------------

LONG_TEXT = " ".join(WORDS * 6)  # ~440 tokens: class `long`
CLASSES = [
    {"name": "long", "when": {"input_tokens": {"gte": 200}}},
    {"name": "short", "when": {}},
]


def chat(text: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, dict, float]:
    started = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        payload = await resp.json()
        return resp.status, payload, dict(resp.headers), time.perf_counter() - started


def served(gw: RunningGateway) -> list[dict]:
    lines = [json.loads(line) for line in gw.access_log.getvalue().splitlines()]
    return [line for line in lines if "queue_wait_s" in line]


def refused_lines(gw: RunningGateway) -> list[dict]:
    lines = [json.loads(line) for line in gw.access_log.getvalue().splitlines()]
    return [line for line in lines if line["status"] == 429]


async def reserving_gateway(stub_factory, gateway_factory, tokenizer_dir):
    stub = await stub_factory(delay_s=0.5)
    policy = basic_policy(
        tokenizer_dir, [stub.url], max_concurrency=3, reserve={"short": 1},
        queue={"max_wait_s": 10},
    )  # fmt: skip
    policy["classes"] = CLASSES
    return stub, await gateway_factory(policy)


async def test_a_short_request_takes_its_reserved_slot_while_long_ones_run(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    stub, gw = await reserving_gateway(stub_factory, gateway_factory, tokenizer_dir)
    gate = asyncio.Event()  # nothing ends until it opens: no slot is freed meanwhile
    stub.config.gate = gate
    longs = [asyncio.create_task(post(http, gw.url, chat(LONG_TEXT))) for _ in range(2)]
    await eventually(lambda: stub.stats.running == 2)
    short_one = asyncio.create_task(post(http, gw.url, chat("is this spam?")))
    try:
        await eventually(lambda: stub.stats.running == 3)  # the kept slot, while both longs run
    finally:
        gate.set()
    results = await asyncio.gather(*longs, short_one)
    assert [r[0] for r in results] == [200] * 3
    assert {line["class"] for line in served(gw)} == {"long", "short"}

    # Without short traffic the third slot stays idle: a third long request waits for a long one.
    longs = [asyncio.create_task(post(http, gw.url, chat(LONG_TEXT))) for _ in range(3)]
    await eventually(lambda: stub.stats.running == 2 and gw.waiting() == 1)
    await asyncio.sleep(0.2)
    assert stub.stats.running == 2 and gw.waiting() == 1
    assert [r[0] for r in await asyncio.gather(*longs)] == [200] * 3
    assert stub.stats.max_running == 3
    await eventually(lambda: gw.inflight() == 0 and gw.waiting() == 0)


async def test_a_short_request_is_served_promptly_through_a_flood_of_long_ones(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    stub, gw = await reserving_gateway(stub_factory, gateway_factory, tokenizer_dir)
    gate = asyncio.Event()  # nothing ends until it opens: no slot is freed meanwhile
    stub.config.gate = gate
    flood = [asyncio.create_task(post(http, gw.url, chat(LONG_TEXT))) for _ in range(8)]
    short_one = None
    try:
        await eventually(lambda: stub.stats.running == 2 and gw.waiting() == 6)
        short_one = asyncio.create_task(post(http, gw.url, chat("is this spam?")))
        # Served on its kept slot while the six long ones still queue: with the two running
        # held, it cannot have waited for one of theirs (a wall-clock bound on when it was
        # served measured the machine's pace as well).
        await eventually(lambda: stub.stats.running == 3 and gw.waiting() == 6)
    finally:
        gate.set()
        results = await asyncio.gather(*flood, *([short_one] if short_one else []))
        assert [r[0] for r in results] == [200] * len(results)
        assert stub.stats.max_running <= 3
        await eventually(lambda: gw.inflight() == 0 and gw.waiting() == 0)
    assert [line["class"] for line in served(gw)].count("short") == 1


# Fail fast over HTTP. With one slot held ~h s each, place p waits ~p * h; those accepted have
# p * lower_bound(h) <= max_wait. The test works out the cut from the history the gateway
# measured and holds the running request while the burst arrives, so how many are refused does
# not depend on how fast they arrive. max_wait = 20 h puts the cut near place 20 of 30, and is
# how long the accepted wait for the test to see the whole burst decided and let them through.
HOLD_S = 0.3
MAX_WAIT_S = 20 * HOLD_S


async def test_a_burst_past_the_drain_rate_is_refused_at_once(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    stub = await stub_factory(delay_s=HOLD_S)
    policy = basic_policy(
        tokenizer_dir, [stub.url], max_concurrency=1, queue={"max_wait_s": MAX_WAIT_S}
    )
    gw = await gateway_factory(policy)
    body = chat("classify this")
    for _ in range(HoldTimes.MIN_SAMPLES + 2):  # history: the slot is held ~HOLD_S each time
        assert (await post(http, gw.url, body))[0] == 200
    await eventually(lambda: gw.inflight() == 0)
    (pool,) = gw.gateway.slots.values()
    measured = pool.holds[0].mean()
    assert measured is not None and measured[0] >= HOLD_S, measured
    # The places whose predicted wait, at the lower bound, is within max_wait: they queue.
    places = sum(1 for place in range(1, 30) if place * measured[1] <= MAX_WAIT_S)

    # Nothing drains while the burst arrives: the first runs until the gate opens.
    gate = asyncio.Event()
    stub.config.gate, stub.config.delay_s = gate, 0.0
    burst = [asyncio.create_task(post(http, gw.url, body)) for _ in range(30)]

    def decided() -> bool:
        return len(refused_lines(gw)) + gw.waiting() + gw.inflight() == 30

    try:
        await eventually(decided, within_s=MAX_WAIT_S)  # as long as the accepted ones wait
        decisions = len(refused_lines(gw)), gw.waiting(), stub.stats.running
        assert decisions == (29 - places, places, 1)
    finally:
        gate.set()
    results = await asyncio.gather(*burst)
    codes = [200 if s == 200 else b["error"]["code"] for s, b, _, _ in results]
    assert set(codes) <= {200, "queue_wait_too_long"}, codes  # no queue_timeout, nothing else
    refused = [r for r in results if r[0] == 429]
    assert len(refused) == 29 - places, codes  # one running, `places` waiting
    for _, body_, headers, _ in refused:
        assert int(headers["Retry-After"]) >= 1
        assert "predicted wait" in body_["error"]["message"]

    # Told at once, not at the time-out: none of them queued (a wall-clock bound would measure
    # the machine's pace as well).
    assert [line["queue_wait_s"] for line in refused_lines(gw)] == [None] * len(refused)
    assert stub.stats.max_running == 1
    await eventually(lambda: gw.inflight() == 0 and gw.waiting() == 0)
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    assert f'llm_rejections_total{{pool="main",reason="queue_wait"}} {len(refused)}.0' in text
