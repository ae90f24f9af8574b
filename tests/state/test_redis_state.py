"""The Redis `State` against a real `redis-server` on a loopback port, no mocks.

`MemoryState` is the reference: its properties (no minute over the limit, exact Retry-After,
all-or-nothing charges) are tested in test_quotas.py, so here random sequences of reservations
and corrections are replayed on both with one injected clock and must give the same answers.
Then gateways: two sharing one Redis share a tenant's window; Redis stopped mid-run fails open
to 1/N local limits or closed to a fast 503, and shared limits return with Redis.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from gateway.config.schema import StateSpec
from gateway.state import (
    Correction,
    Limit,
    MemoryState,
    PoolReplica,
    Reservation,
    SlotClaim,
    TenantWindow,
    WindowFull,
)
from gateway.state.base import StateUnreachable
from gateway.state.build import build_state
from gateway.state.failover import FailoverState
from gateway.state.redis import RedisState
from loadtest.adversary.slow_link import SlowLink
from tests.conftest import RedisServer, RunningGateway, eventually, paced
from tests.request.test_quotas import Clock, chat, quota_policy, sized

steps = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=200, allow_nan=False),
        st.integers(1, 400),
        st.integers(0, 600),  # what the request really used, for a later correction
        st.booleans(),  # correct it now (True) or leave it to the end of the sequence
    ),
    max_size=60,
)


@settings(max_examples=100, deadline=None)
@given(steps=steps, limit=st.integers(1, 1000))
async def test_redis_answers_as_the_in_memory_state_does(
    redis_server: RedisServer, steps: list[tuple[float, int, int, bool]], limit: int
) -> None:
    clock = Clock()
    memory, shared = MemoryState(clock), RedisState(redis_server.url, clock=clock)
    await shared.client.flushdb()
    keys = (TenantWindow("acme", "tokens"), TenantWindow("acme", "requests"))
    later: list[tuple[str, str, int, int]] = []
    try:
        for at, amount, actual, now in sorted(steps):
            clock.now = 1000 + at
            limits = [Limit(keys[0], amount, limit), Limit(keys[1], 1, 5)]
            mine, theirs = await memory.reserve(limits), await shared.reserve(limits)
            assert type(mine) is type(theirs)
            assert mine.windows == pytest.approx(theirs.windows)
            if isinstance(mine, WindowFull):
                assert isinstance(theirs, WindowFull)
                assert mine.index == theirs.index
                assert mine.retry_after_s == pytest.approx(theirs.retry_after_s)
                continue
            assert isinstance(theirs, Reservation)
            if now:
                await memory.adjust([Correction(keys[0], mine.id, amount, actual)])
                await shared.adjust([Correction(keys[0], theirs.id, amount, actual)])
            else:
                later.append((mine.id, theirs.id, amount, actual))
        clock.now += 30  # some corrections come after their charge has left the window, in one call
        await memory.adjust(
            [Correction(keys[0], m, amount, actual) for m, _, amount, actual in later]
        )
        await shared.adjust(
            [Correction(keys[0], t, amount, actual) for _, t, amount, actual in later]
        )
        probe = [Limit(keys[0], 0, limit), Limit(keys[1], 0, 5)]
        assert await memory.peek(probe) == pytest.approx(await shared.peek(probe))
    finally:
        await shared.close()


async def test_ids_are_unique_across_gateways(fresh_redis: RedisServer) -> None:
    one, two = RedisState(fresh_redis.url), RedisState(fresh_redis.url)
    try:
        limits = [Limit(TenantWindow("acme", "requests"), 1, 10)]
        first, second = await one.reserve(limits), await two.reserve(limits)
        assert isinstance(first, Reservation) and isinstance(second, Reservation)
        assert first.id != second.id
        assert second.windows[0].remaining == 8  # both charges count in one window
    finally:
        await one.close()
        await two.close()


async def test_a_refusal_that_rewrote_the_total_leaves_it_expiring_with_its_log(
    fresh_redis: RedisServer,
) -> None:
    """A call that drops expired charges rewrites the running total; a plain SET took its
    expiry away, and a refusal then charged nothing to set it again: the total outlived the
    charges it summed and counted them against the tenant for good."""
    clock = Clock()
    shared = RedisState(fresh_redis.url, clock=clock)
    key = TenantWindow("acme", "tokens")
    try:
        assert isinstance(await shared.reserve([Limit(key, 10, 1000)]), Reservation)
        clock.now += 30
        assert isinstance(await shared.reserve([Limit(key, 20, 1000)]), Reservation)
        clock.now += 35  # the first charge has left the window, the second not
        assert isinstance(await shared.reserve([Limit(key, 2000, 1000)]), WindowFull)
        total = redis.Redis(port=fresh_redis.port)
        assert total.get("quota:{acme}:tokens:u") == b"20"
        assert total.pttl("quota:{acme}:tokens:u") > 0
    finally:
        await shared.close()


async def test_excesses_of_a_charge_gone_add_up_and_leave_the_window(
    fresh_redis: RedisServer,
) -> None:
    """A slice's charge may be corrected more than once after it left the window (batched
    corrections of its requests): each excess counts, and all of them leave a window later."""
    clock = Clock()
    shared = RedisState(fresh_redis.url, clock=clock)
    key = TenantWindow("acme", "tokens")
    try:
        charge = await shared.reserve([Limit(key, 10, 1000)])
        assert isinstance(charge, Reservation)
        clock.now += 61
        await shared.adjust([Correction(key, charge.id, 10, 30)])
        clock.now += 1
        await shared.adjust([Correction(key, charge.id, 10, 15)])
        assert (await shared.peek([Limit(key, 0, 1000)]))[0].remaining == 1000 - 20 - 5
        clock.now += 61
        assert (await shared.peek([Limit(key, 0, 1000)]))[0].remaining == 1000
    finally:
        await shared.close()


async def test_what_one_call_touches_is_one_redis_cluster_slot(fresh_redis: RedisServer) -> None:
    """Callers name a tenant's windows and a pool's replica; the Redis backend's keys for them
    hash to one Cluster slot per call (a tenant's windows, a replica's leases), so each script
    runs on Redis Cluster as on one Redis."""
    shared = RedisState(fresh_redis.url)
    try:
        windows = ("tokens", "requests", "model:m:tokens", "pool:p:requests")
        for tenant in ("acme", "globex"):
            await shared.reserve([Limit(TenantWindow(tenant, w), 1, 10) for w in windows])
        claim = SlotClaim(PoolReplica("chat", "http://10.0.0.1:8000"), "batch", (("batch", 1),), 4)
        await shared.lease(claim, shared.lease_id())
        keys = [k.decode() for k in redis.Redis(port=fresh_redis.port).scan_iter("*")]
        by_owner: dict[str, set[int]] = {}
        for key in keys:
            owner = next(o for o in ("acme", "globex", "10.0.0.1") if o in key)
            by_owner.setdefault(owner, set()).add(key_slot(key.encode()))
        assert len(keys) == 2 * 3 * len(windows) + 2  # each window's three keys; two of leases
        assert all(len(slots) == 1 for slots in by_owner.values()), by_owner
        assert by_owner.keys() == {"acme", "globex", "10.0.0.1"}
    finally:
        await shared.close()


@pytest.fixture
async def black_hole() -> AsyncIterator[str]:
    """A loopback server that accepts connections and never answers: a hung Redis."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"redis://127.0.0.1:{port}/0"
    server.close()


async def test_a_hung_redis_fails_within_the_time_out(black_hole: str) -> None:
    limits = [Limit(TenantWindow("acme", "tokens"), 10, 100)]
    timeout_s = 0.2
    closed = FailoverState(
        RedisState(black_hole, timeout_s=timeout_s), on_failure="closed", gateways=2
    )

    async def refused() -> None:
        with pytest.raises(StateUnreachable):
            async with asyncio.timeout(30 * timeout_s):  # stops a test that would hang
                await closed.reserve(limits)

    _, pace = await paced(refused(), tick_s=0.002)
    # The time-out ended it: it waited that long, and not much longer, the machine's pauses
    # aside (a wall-clock bound measured them as well).
    assert timeout_s <= pace.elapsed and pace.waited < 1.5 * timeout_s, pace
    assert not closed.up
    await closed.close()
    opened = FailoverState(RedisState(black_hole, timeout_s=0.2), on_failure="open", gateways=2)
    result = await opened.reserve(limits)
    assert isinstance(result, Reservation) and result.windows[0].limit == 50  # 1/2 locally
    await opened.close()


async def test_a_redis_that_answers_late_gets_every_connection_back(
    fresh_redis: RedisServer,
) -> None:
    """Corrections of two tenants go in one pipeline, whose scripts are checked before the
    part of `execute` that gives its connection back. A reply later than the time-out there
    kept that connection from the pool for good: with a pool of one, every later call failed
    though Redis answered again. Found by the adversary's slow Redis."""
    link = SlowLink(fresh_redis.port)
    async with link.serving() as url:
        state = RedisState(url, timeout_s=0.2, max_connections=1)
        a, b = TenantWindow("a", "tokens"), TenantWindow("b", "tokens")
        charges = [await state.reserve([Limit(key, 10, 1000)]) for key in (a, b)]
        assert all(isinstance(c, Reservation) for c in charges)
        fixes = [Correction(key, c.id, 10, 5) for key, c in zip((a, b), charges, strict=True)]
        await state.adjust(fixes)
        link.delay_s = 0.5
        for _ in range(4):
            with pytest.raises((TimeoutError, redis.RedisError)):
                await state.adjust(fixes)
        link.delay_s = 0.0
        await asyncio.sleep(0.6)  # the replies held are delivered, or dropped with their link
        gc.collect()  # what a lost pipeline holds is let go only when it is collected
        assert isinstance(await state.reserve([Limit(a, 1, 1000)]), Reservation)
        await state.close()


async def test_each_worker_of_a_pod_is_one_more_gateway_failing_open() -> None:
    """`serve --workers 3` with `state.gateways: 2`: six processes share the limits, so each
    worker's local share while Redis fails is a sixth."""
    black_hole = "redis://127.0.0.1:9/0"  # nothing listens: the first call fails at once
    state, ledger, _ = build_state(StateSpec(backend="redis", url=black_hole, gateways=2), 3)
    assert ledger is not None and ledger.gateways == 6
    limits = [Limit(TenantWindow("acme", "tokens"), 10, 600)]
    result = await state.reserve(limits)
    assert isinstance(result, Reservation) and result.windows[0].limit == 100
    await state.close()


EXACT = {"fraction": 0}  # every request's charge its own script call: exact headers, no slices


def redis_policy(
    tokenizer_dir: Any, stub: Any, server: RedisServer, **state: Any
) -> dict[str, Any]:
    policy = quota_policy(tokenizer_dir, [stub.url], tpm=10_000)
    policy["state"] = {"backend": "redis", "url": server.url, "timeout_s": 0.3, **state}
    return policy


async def backend_up(http: aiohttp.ClientSession, gw: RunningGateway) -> str:
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    return next(line for line in text.splitlines() if line.startswith("llm_state_backend_up "))


async def test_the_10000_tpm_case_holds_in_redis(
    fresh_redis, stub, gateway_factory, tokenizer_dir, http
) -> None:
    # exact per-request charges (no slices): the clock moved here is Redis's alone
    gw = await gateway_factory(redis_policy(tokenizer_dir, stub, fresh_redis, slices=EXACT))
    clock = Clock()
    gw.gateway.state.shared.clock = clock  # type: ignore[attr-defined]
    body = await sized(gw, 4000)
    assert (await chat(http, gw, body))[0] == 200
    clock.now += 10
    assert (await chat(http, gw, body))[0] == 200
    clock.now += 5
    status, error, headers = await chat(http, gw, body)
    assert (status, headers["Retry-After"]) == (429, "45")
    assert error["error"]["code"] == "rate_limit_exceeded"
    clock.now += 45
    status, _, headers = await chat(http, gw, body)
    assert (status, headers["x-ratelimit-remaining-tokens"]) == (200, "2000")
    assert await backend_up(http, gw) == "llm_state_backend_up 1.0"


async def test_two_gateways_share_a_tenants_tpm_window(
    fresh_redis, stub, gateway_factory, tokenizer_dir, http
) -> None:
    first = await gateway_factory(redis_policy(tokenizer_dir, stub, fresh_redis, gateways=2))
    second = await gateway_factory(redis_policy(tokenizer_dir, stub, fresh_redis, gateways=2))
    body = await sized(first, 6000)
    assert (await chat(http, first, body))[0] == 200
    status, error, _ = await chat(http, second, body)
    assert status == 429 and error["error"]["code"] == "rate_limit_exceeded"
    assert len(stub.stats.bodies) == 1


async def test_fail_open_serves_at_local_limits_then_shares_again_when_redis_returns(
    fresh_redis, stub, gateway_factory, tokenizer_dir, http
) -> None:
    # exact headers, as without slices (a live slice would still serve its rest locally)
    policy = redis_policy(
        tokenizer_dir, stub, fresh_redis, on_failure="open", gateways=2, slices=EXACT
    )
    first, second = await gateway_factory(policy), await gateway_factory(policy)
    body = await sized(first, 4000)
    assert (await chat(http, first, body))[0] == 200
    fresh_redis.stop()
    status, _, headers = await chat(http, first, body)  # locally: 5000, nothing charged yet
    assert (status, headers["x-ratelimit-limit-tokens"]) == (200, "5000")
    status, _, _ = await chat(http, first, body)
    assert status == 429  # 8000 would exceed this gateway's half of the limit
    assert await backend_up(http, first) == "llm_state_backend_up 0.0"
    async with http.get(f"{first.metrics_url}/metrics") as resp:
        assert 'llm_state_mode{mode="local"} 1.0' in await resp.text()

    fresh_redis.start()  # empty: it persisted nothing
    await asyncio.sleep(1.1)  # the failover retries Redis a second after the failure
    status, _, headers = await chat(http, first, body)
    assert (status, headers["x-ratelimit-remaining-tokens"]) == (200, "6000")
    status, _, headers = await chat(http, second, body)
    assert (status, headers["x-ratelimit-remaining-tokens"]) == (200, "2000")  # shared again
    assert (await chat(http, first, body))[0] == 429
    assert await backend_up(http, first) == "llm_state_backend_up 1.0"


async def test_fail_closed_answers_503_within_a_second_and_recovers(
    fresh_redis, stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(redis_policy(tokenizer_dir, stub, fresh_redis, on_failure="closed"))
    body = await sized(gw, 1000)
    assert (await chat(http, gw, body))[0] == 200
    fresh_redis.stop()
    for _ in range(2):  # the failing call and one while Redis is known to be down
        (status, error, _), pace = await paced(chat(http, gw, body), tick_s=0.002)
        # Waited on no time-out, the machine's pauses aside (a wall-clock bound measured them).
        assert pace.waited < 0.3, pace
        assert (status, error["error"]["code"]) == (503, "state_unavailable")
    assert len(stub.stats.bodies) == 1
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        assert 'llm_state_mode{mode="refusing"} 1.0' in await resp.text()
    fresh_redis.start()

    async def served() -> bool:
        return (await chat(http, gw, body))[0] == 200

    deadline = time.monotonic() + 5
    while not await served():
        assert time.monotonic() < deadline, "shared state never resumed"
        await asyncio.sleep(0.2)
    await eventually(lambda: gw.gateway.state.up)  # type: ignore[attr-defined]
