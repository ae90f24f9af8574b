"""`SlicedState` against a real `redis-server`: windows leased in slices never over-grant across
gateways, a slice's unused part goes back, corrections are sent in one call per flush, and
nothing is left running after close. Turning slices off (`fraction: 0`) leaves the exact
per-request `RedisState` the other tests in this package check.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence

import pytest
import redis

from gateway.config.schema import StateSpec
from gateway.state import Correction, Limit, Reservation, TenantWindow, WindowFull
from gateway.state.base import SliceAsk, SliceGrant
from gateway.state.build import build_state
from gateway.state.failover import FailoverState
from gateway.state.redis import RedisState
from gateway.state.slices import SlicedState
from tests.conftest import RedisServer, eventually
from tests.request.test_quotas import Clock

TOKENS = TenantWindow("acme", "tokens")
REQUESTS = TenantWindow("acme", "requests")


def sliced(server: RedisServer, *, fraction: float = 0.2, max_age_s: float = 0.5) -> SlicedState:
    return SlicedState(RedisState(server.url), fraction=fraction, max_age_s=max_age_s)


def used(server: RedisServer, key: TenantWindow) -> int:
    """What Redis counts in the window now."""
    raw = redis.Redis(port=server.port).get(f"quota:{{{key.tenant}}}:{key.window}:u")
    return int(raw or 0)


class Counting(RedisState):
    """The real Redis backend, counting the correction and grant calls it is asked to make."""

    calls = 0
    grants = 0

    async def adjust(self, corrections: Sequence[Correction]) -> None:
        self.calls += 1
        await super().adjust(corrections)

    async def grant(
        self, asks: Sequence[SliceAsk], slice_id: str, max_age_s: float
    ) -> SliceGrant | WindowFull:
        self.grants += 1
        return await super().grant(asks, slice_id, max_age_s)


async def test_two_gateways_never_grant_a_window_past_its_limit(fresh_redis: RedisServer) -> None:
    rng = random.Random(39)
    gateways = [sliced(fresh_redis), sliced(fresh_redis)]
    granted: list[tuple[int, int]] = []  # (tokens, requests) of each reservation granted

    async def client(state: SlicedState) -> None:
        for _ in range(60):
            amount = rng.randint(1, 400)
            limits = [Limit(TOKENS, amount, 10_000), Limit(REQUESTS, 1, 150)]
            if isinstance(await state.reserve(limits), Reservation):
                granted.append((amount, 1))
            await asyncio.sleep(0)

    await asyncio.gather(*(client(gateways[i % 2]) for i in range(8)))
    tokens, requests = sum(t for t, _ in granted), sum(r for _, r in granted)
    assert tokens <= 10_000 and requests <= 150
    assert len(granted) < 8 * 60  # the windows did fill
    for state in gateways:
        await state.close()
    # every slice's unused part given back: Redis holds what was granted, no more
    assert (used(fresh_redis, TOKENS), used(fresh_redis, REQUESTS)) == (tokens, requests)


async def test_near_the_limit_a_slice_is_the_requests_own_charge(fresh_redis: RedisServer) -> None:
    first, second = sliced(fresh_redis, fraction=0.5), sliced(fresh_redis, fraction=0.5)
    assert isinstance(await first.reserve([Limit(TOKENS, 40, 100)]), Reservation)
    assert used(fresh_redis, TOKENS) == 90  # 40 and a slice of 50 more
    # the other gateway gets what is left (10), not refused for want of a slice
    assert isinstance(await second.reserve([Limit(TOKENS, 10, 100)]), Reservation)
    refused = await second.reserve([Limit(TOKENS, 1, 100)])
    assert isinstance(refused, WindowFull) and refused.retry_after_s is not None
    # the first gateway's slice serves its own rest locally
    assert isinstance(await first.reserve([Limit(TOKENS, 50, 100)]), Reservation)
    assert isinstance(await first.reserve([Limit(TOKENS, 1, 100)]), WindowFull)
    assert isinstance(await first.reserve([Limit(TOKENS, 101, 100)]), WindowFull)
    await first.close()
    await second.close()
    assert used(fresh_redis, TOKENS) == 100


async def test_a_correction_lands_on_the_slice_its_request_took_for_that_window(
    fresh_redis: RedisServer,
) -> None:
    """One grant leased slices of two windows; the smaller ran short and was leased again alone.
    A request charged from the first grant's slice of one and the second's of the other: its
    refund on the second window goes to the second slice, not the older one its id also names."""
    model = TenantWindow("acme", "model:m:tokens")
    state = sliced(fresh_redis, fraction=0.5)
    try:
        first = await state.reserve([Limit(TOKENS, 10, 1000), Limit(model, 10, 100)])
        assert isinstance(first, Reservation)
        assert isinstance(
            await state.reserve([Limit(TOKENS, 10, 1000), Limit(model, 45, 100)]), Reservation
        )
        mixed = await state.reserve([Limit(TOKENS, 10, 1000), Limit(model, 20, 100)])
        assert isinstance(mixed, Reservation)
        old, new = mixed.id.split(" ")
        assert old == first.id
        await state.adjust([Correction(model, mixed.id, 20, 0)])
        assert state._known[new, model].handed == 0
        assert state._known[old, model].handed == 55  # what its own two requests still hold
    finally:
        await state.close()


async def test_a_slice_that_stops_while_a_grant_runs_serves_none_of_that_request(
    fresh_redis: RedisServer,
) -> None:
    """A request took one window from a live slice and waited for a grant for another; the
    grant took longer than that slice had left. Admitted then, it would fall after the slice's
    stamp, outside what Redis counts for it: it takes that window again from a new slice."""
    local = Clock()

    class Slow(Counting):
        takes_s = 0.3

        async def grant(
            self, asks: Sequence[SliceAsk], slice_id: str, max_age_s: float
        ) -> SliceGrant | WindowFull:
            local.now += self.takes_s  # the call's time, on the slices' own clock
            return await super().grant(asks, slice_id, max_age_s)

    store = Slow(fresh_redis.url)
    state = SlicedState(store, fraction=0.1, max_age_s=0.5, monotonic=local)
    model = TenantWindow("acme", "model:m:tokens")
    try:
        first = await state.reserve([Limit(TOKENS, 10, 100_000), Limit(model, 10, 100)])
        assert isinstance(first, Reservation)  # both slices live until 0.5 on `local`
        local.now += 0.1
        late = await state.reserve([Limit(TOKENS, 10, 100_000), Limit(model, 80, 100)])
        assert isinstance(late, Reservation)
        assert first.id not in late.id.split(" ")  # both windows from the one grant after
        assert store.grants == 3  # the first, the model's alone, then both together
        assert state._known[first.id, TOKENS].handed == 10  # the late request's share went back
        store.takes_s = 0.6  # a grant that outlives a slice: the store is failing, said so
        with pytest.raises(TimeoutError):
            await state.reserve([Limit(TOKENS, 10, 100_000), Limit(REQUESTS, 1, 1000)])
    finally:
        await state.close()


async def test_a_refused_grant_leaves_the_total_expiring(fresh_redis: RedisServer) -> None:
    """A grant cuts the slice it replaces back and rewrites the total before it finds the new
    one does not fit: a total without its expiry would outlive the log it sums and hold the
    tenant at its limit for good."""
    state = sliced(fresh_redis, fraction=0.5)
    try:
        assert isinstance(await state.reserve([Limit(TOKENS, 40, 100)]), Reservation)
        assert isinstance(await state.reserve([Limit(TOKENS, 70, 100)]), WindowFull)
        assert used(fresh_redis, TOKENS) == 40  # cut back to what it handed out
        assert redis.Redis(port=fresh_redis.port).pttl("quota:{acme}:tokens:u") > 0
    finally:
        await state.close()


async def test_a_slice_counts_until_a_window_after_its_last_possible_use(
    fresh_redis: RedisServer,
) -> None:
    """A slice granted at 0 may hand out until 10: its charge must still count at 61, or another
    gateway's grant then would put more than the limit in the window from 9."""
    clock = Clock()
    first, second = (
        SlicedState(
            RedisState(fresh_redis.url, clock=clock), fraction=0.5, max_age_s=10, monotonic=clock
        )
        for _ in range(2)
    )
    assert isinstance(await first.reserve([Limit(TOKENS, 10, 100)]), Reservation)  # a slice of 60
    clock.now += 9
    assert isinstance(await first.reserve([Limit(TOKENS, 50, 100)]), Reservation)  # from it
    clock.now += 52  # 61 after the grant
    refused = await second.reserve([Limit(TOKENS, 51, 100)])
    assert isinstance(refused, WindowFull)
    assert refused.retry_after_s == 9.0  # the slice leaves the window at 10 + 60
    assert isinstance(await second.reserve([Limit(TOKENS, 40, 100)]), Reservation)
    for state in (first, second):
        await state.close()


async def test_a_burst_waits_for_one_grant_rather_than_each_asking(
    fresh_redis: RedisServer,
) -> None:
    state = sliced(fresh_redis, fraction=0.5)
    burst = await asyncio.gather(*(state.reserve([Limit(TOKENS, 1, 1000)]) for _ in range(20)))
    # one slice of 501 serves all twenty; a grant each would have held the window full
    assert all(isinstance(result, Reservation) for result in burst)
    assert used(fresh_redis, TOKENS) == 501
    await state.close()
    assert used(fresh_redis, TOKENS) == 20


async def test_a_grant_redis_fails_fails_the_burst_that_waited_for_it(
    fresh_redis: RedisServer,
) -> None:
    backend = Counting(fresh_redis.url, timeout_s=0.3)
    state = SlicedState(backend, fraction=0.5, max_age_s=0.5)
    fresh_redis.stop()
    burst = await asyncio.gather(
        *(state.reserve([Limit(TOKENS, 1, 1000)]) for _ in range(10)), return_exceptions=True
    )
    assert all(isinstance(error, backend.failures) for error in burst)
    assert backend.grants == 1  # not one each in turn, every one a time-out with a hung Redis
    await state.close()


async def test_a_slices_unused_part_goes_back_after_its_age(fresh_redis: RedisServer) -> None:
    state = sliced(fresh_redis, fraction=0.5, max_age_s=0.2)
    result = await state.reserve([Limit(TOKENS, 10, 100)])
    assert isinstance(result, Reservation)
    assert used(fresh_redis, TOKENS) == 60
    await eventually(lambda: used(fresh_redis, TOKENS) == 10)
    # a refund after the slice stopped corrects its charge in Redis
    await state.adjust([Correction(TOKENS, result.id, 10, 4)])
    await eventually(lambda: used(fresh_redis, TOKENS) == 4)
    await state.close()


async def test_a_refund_while_the_slice_lives_is_reused_locally(fresh_redis: RedisServer) -> None:
    state = sliced(fresh_redis, fraction=0.1, max_age_s=5.0)
    first = await state.reserve([Limit(TOKENS, 90, 100)])
    assert isinstance(first, Reservation) and used(fresh_redis, TOKENS) == 100
    await state.adjust([Correction(TOKENS, first.id, 90, 30)])
    again = await state.reserve([Limit(TOKENS, 60, 100)])
    assert isinstance(again, Reservation) and again.id == first.id  # the same slice, no call
    await state.close()
    assert used(fresh_redis, TOKENS) == 90


async def test_corrections_of_every_tenant_go_in_one_call_per_flush(
    fresh_redis: RedisServer,
) -> None:
    backend = Counting(fresh_redis.url)
    state = SlicedState(backend, fraction=0.1, max_age_s=0.1, flush_s=3600)  # flushed by hand
    fixes = []
    for tenant in ("a", "b", "c"):
        key = TenantWindow(tenant, "tokens")
        for _ in range(5):
            result = await state.reserve([Limit(key, 10, 1000)])
            assert isinstance(result, Reservation)
            fixes.append(Correction(key, result.id, 10, 3))
    await state.adjust(fixes)
    assert backend.calls == 0  # recorded, not sent
    stats = redis.Redis(port=fresh_redis.port)
    before = stats.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    await asyncio.sleep(0.1)  # the slices' age: each must give back its rest
    await state.flush()
    after = stats.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert (backend.calls, after - before) == (1, 3)  # one call, one script per tenant
    assert [used(fresh_redis, TenantWindow(t, "tokens")) for t in "abc"] == [15, 15, 15]
    await state.close()


async def test_an_excess_after_the_slice_left_the_window_is_charged_anew(
    fresh_redis: RedisServer,
) -> None:
    state = sliced(fresh_redis, fraction=0.1, max_age_s=0.1)
    first = await state.reserve([Limit(TOKENS, 10, 1000)])
    assert isinstance(first, Reservation)
    await state.close()
    state = sliced(fresh_redis)  # a slice this state never knew: as one forgotten
    await state.adjust([Correction(TOKENS, first.id, 10, 25), Correction(TOKENS, first.id, 10, 0)])
    await state.flush()
    assert used(fresh_redis, TOKENS) == 25  # the refund of a charge gone is nothing
    await state.close()


async def test_a_flush_redis_does_not_take_is_sent_again_by_the_next(
    fresh_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A slice's correction is its charge written outright: kept, and sent when the store is
    back (a restarted Redis lost the slice's own charge, so its excess is charged anew)."""
    state = SlicedState(
        RedisState(fresh_redis.url, timeout_s=0.3), fraction=0.1, max_age_s=5, flush_s=3600
    )
    result = await state.reserve([Limit(TOKENS, 10, 1000)])
    assert isinstance(result, Reservation)
    await state.adjust([Correction(TOKENS, result.id, 10, 500)])  # an excess: Redis must hear
    fresh_redis.stop()
    with caplog.at_level(logging.WARNING, logger="gateway.state"):
        await state.flush()
    assert "lost" not in caplog.text
    fresh_redis.start()
    await state.flush()
    assert used(fresh_redis, TOKENS) == 500 - 110  # the slice charged 10 and 100 more
    await state.close()


async def test_an_excess_of_a_slice_gone_that_redis_does_not_take_is_logged_as_lost(
    fresh_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Once a slice's charge has left every window, an excess is a new charge: sent twice it
    would count twice, so a flush that fails loses it, said."""
    clock, local = Clock(), Clock()
    state = SlicedState(
        RedisState(fresh_redis.url, timeout_s=0.3, clock=clock),
        fraction=0.1,
        max_age_s=0.05,
        flush_s=3600,
        monotonic=local,
    )
    result = await state.reserve([Limit(TOKENS, 10, 1000)])
    assert isinstance(result, Reservation)
    clock.now += 120
    local.now += 120
    await state.flush()  # retired and forgotten: its charge has left every window
    await state.adjust([Correction(TOKENS, result.id, 10, 50)])
    fresh_redis.stop()
    with caplog.at_level(logging.WARNING, logger="gateway.state"):
        await state.flush()
    assert "in acme's tokens lost" in caplog.text
    fresh_redis.start()
    await state.close()


async def test_close_leaves_no_task(fresh_redis: RedisServer) -> None:
    before = asyncio.all_tasks()
    state = sliced(fresh_redis)
    assert isinstance(await state.reserve([Limit(TOKENS, 1, 100)]), Reservation)
    assert len(asyncio.all_tasks() - before) == 1  # the flusher
    await state.close()
    assert asyncio.all_tasks() == before


def test_fraction_zero_is_the_exact_backend(fresh_redis: RedisServer) -> None:
    exact, _, _ = build_state(
        StateSpec(backend="redis", url=fresh_redis.url, slices={"fraction": 0})
    )
    default, _, _ = build_state(StateSpec(backend="redis", url=fresh_redis.url))
    assert isinstance(exact, FailoverState) and type(exact.shared) is RedisState
    assert isinstance(default, FailoverState) and isinstance(default.shared, SlicedState)


class Stalling(RedisState):
    """The real Redis backend, whose corrections wait for `go` before they are sent."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.go = asyncio.Event()
        self.sending = asyncio.Event()

    async def adjust(self, corrections: Sequence[Correction]) -> None:
        self.sending.set()
        await self.go.wait()
        await super().adjust(corrections)


async def test_close_while_the_flusher_sends_loses_none_of_its_corrections(
    fresh_redis: RedisServer,
) -> None:
    backend = Stalling(fresh_redis.url)
    state = SlicedState(backend, fraction=0.1, max_age_s=5.0, flush_s=0.01)
    result = await state.reserve([Limit(TOKENS, 10, 1000)])
    assert isinstance(result, Reservation) and used(fresh_redis, TOKENS) == 110
    await state.adjust([Correction(TOKENS, result.id, 10, 500)])  # an excess Redis must hear
    await backend.sending.wait()  # the flusher is sending it
    closing = asyncio.create_task(state.close())
    await asyncio.sleep(0.05)
    backend.go.set()
    await closing
    assert used(fresh_redis, TOKENS) == 500  # the excess, and the slice's rest given back


class Unanswered(RedisState):
    """The real Redis backend, whose grants are made but whose answers never arrive."""

    async def grant(
        self, asks: Sequence[SliceAsk], slice_id: str, max_age_s: float
    ) -> SliceGrant | WindowFull:
        await super().grant(asks, slice_id, max_age_s)
        raise TimeoutError("the answer was lost")


async def test_a_grant_whose_answer_is_lost_is_given_back(fresh_redis: RedisServer) -> None:
    """The caller's request failed, so nothing will use the slice Redis charged for it."""
    state = SlicedState(Unanswered(fresh_redis.url), fraction=0.1, max_age_s=5.0, flush_s=3600)
    with pytest.raises(TimeoutError):
        await state.reserve([Limit(TOKENS, 10, 1000)])
    assert used(fresh_redis, TOKENS) == 110
    await state.flush()
    assert used(fresh_redis, TOKENS) == 0
    await state.close()
