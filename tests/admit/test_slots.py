"""LivePool on its own: the ordering and leak-freedom rules the HTTP tests rely on."""

from __future__ import annotations

import asyncio

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.admit import Claim, LivePool, Place
from gateway.api import BY_NAME
from gateway.config.schema import PoolSpec
from gateway.context.ctx import Ctx
from gateway.errors import QueueFull, QueueTimeout
from gateway.pick.picker import LeastInflightPicker


def pool(replicas: int = 1, cap: int = 1, **spec: object) -> LivePool:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(replicas)]
    return LivePool(
        "p",
        PoolSpec(model="m", replicas=urls, max_concurrency=cap, **spec),
        LeastInflightPicker(None),
    )


async def test_least_inflight_spreads_load() -> None:
    slots = pool(replicas=3, cap=2)
    taken = [(await slots.acquire(Claim(10))).replica for _ in range(6)]
    assert sorted(r.url for r in taken) == sorted(r.url for r in slots.replicas for _ in "ab")
    assert [r.inflight_tokens for r in slots.replicas] == [20, 20, 20]


async def test_no_queue_means_refusal_at_once() -> None:
    slots = pool(queue={"max_depth": 0})
    await slots.acquire(Claim(1, 1))
    with pytest.raises(QueueFull):
        await slots.acquire(Claim(1, 1))


async def test_waiter_granted_and_cancelled_in_the_same_tick_gives_the_slot_back() -> None:
    slots = pool()
    first = await slots.acquire(Claim(5, 1))
    waiter = asyncio.create_task(slots.acquire(Claim(5, 1)))
    await asyncio.sleep(0)
    assert slots.waiting == 1
    slots.release(first)  # grants the waiter's future...
    waiter.cancel()  # ...and the waiter is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.replicas[0].inflight == 0 and slots.replicas[0].inflight_tokens == 0
    assert slots.waiting == 0


async def test_abandoned_head_does_not_block_the_next_waiter() -> None:
    slots = pool()
    held = await slots.acquire(Claim(1, 1))
    head = asyncio.create_task(slots.acquire(Claim(1, 0)))
    second = asyncio.create_task(slots.acquire(Claim(1, 1)))
    await asyncio.sleep(0)
    head.cancel()
    await asyncio.sleep(0)
    slots.release(held)
    granted = await asyncio.wait_for(second, 1)
    assert granted.replica.inflight == 1 and slots.waiting == 0


async def test_timeout_leaves_no_waiter() -> None:
    slots = pool(queue={"max_wait_s": 0.05})
    await slots.acquire(Claim(1, 1))
    with pytest.raises(QueueTimeout):
        await slots.acquire(Claim(1, 1))
    assert slots.waiting == 0


async def test_an_oversized_request_runs_alone_on_an_idle_replica() -> None:
    slots = pool(cap=4, max_inflight_tokens=100)
    big = await slots.acquire(Claim(500, 1))
    assert big.replica.inflight_tokens == 500
    small = asyncio.create_task(slots.acquire(Claim(10, 1)))
    await asyncio.sleep(0)
    assert not small.done()
    slots.release(big)
    assert (await small).replica.inflight_tokens == 10


async def test_requests_that_fit_pass_a_head_waiting_for_an_idle_replica() -> None:
    slots = pool(replicas=2, cap=4, max_inflight_tokens=100)
    kept, other = slots.replicas
    running = [await slots.acquire(Claim(10)) for _ in range(2)]  # one on each replica
    big = asyncio.create_task(slots.acquire(Claim(500)))  # needs a replica to itself
    await asyncio.sleep(0)
    shorts = [asyncio.create_task(slots.acquire(Claim(10))) for _ in range(3)]
    passed = await asyncio.gather(*shorts)  # served while the head waits, not after it
    assert {grant.replica for grant in passed} == {other} and kept.inflight == 1
    assert not big.done()
    slots.release(next(grant for grant in running if grant.replica is kept))
    alone = await big  # the replica kept for it took nothing new, and drained
    assert alone.replica is kept and kept.inflight == 1


async def test_with_one_replica_nothing_passes_a_head_waiting_for_it_to_drain() -> None:
    slots = pool(cap=4, max_inflight_tokens=100)
    running = await slots.acquire(Claim(10))
    big = asyncio.create_task(slots.acquire(Claim(500)))
    await asyncio.sleep(0)
    short = asyncio.create_task(slots.acquire(Claim(10)))
    await asyncio.sleep(0)
    assert slots.waiting == 2  # a request passing it would put off the drain it waits for
    slots.release(running)
    slots.release(await big)
    assert (await short).replica.inflight == 1


async def test_capacity_and_queue_shrink_with_the_pool() -> None:
    slots = pool(replicas=2, cap=3, queue={"max_depth": 4}, health={"consecutive_failures": 1})
    assert (slots.capacity, slots.max_depth) == (6, 4)
    slots.failed(slots.replicas[0], "refused")
    assert (slots.capacity, slots.max_depth) == (3, 2)
    slots.readmit(slots.replicas[0])
    assert (slots.capacity, slots.max_depth) == (6, 4)


async def test_a_tenant_keeping_one_request_waiting_pays_for_each_it_is_served() -> None:
    # One slot; tenant a asks 1,000 tokens at a time from one client, b 10 tokens from ten.
    slots = pool()
    tokens = {"a": 0, "b": 0}
    stop = asyncio.Event()

    async def client(tenant: str, size: int) -> None:
        while not stop.is_set():
            grant = await slots.acquire(Claim(size, tenant=tenant))
            tokens[tenant] += size
            await asyncio.sleep(0)
            slots.release(grant)
            await asyncio.sleep(0)

    clients = [asyncio.create_task(client("a", 1000))]
    clients += [asyncio.create_task(client("b", 10)) for _ in range(10)]
    await asyncio.sleep(0.3)
    stop.set()
    for task in clients:
        task.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    share = tokens["a"] / (tokens["a"] + tokens["b"])
    assert 0.4 <= share <= 0.6, tokens  # equal weights: half the tokens each, not every other slot


@pytest.mark.parametrize("after", [{}, {"x": 1, "short": 1}])
async def test_a_reload_in_the_tick_a_waiter_gives_up_keeps_the_queue_counts(after) -> None:
    slots = pool(cap=4, reserve={"short": 1})
    held = [await slots.acquire(Claim(10, workload="long")) for _ in range(3)]
    held.append(await slots.acquire(Claim(10, workload="short")))
    waiter = asyncio.create_task(slots.acquire(Claim(10, workload="short", tenant="t")))
    await asyncio.sleep(0)
    assert slots.waiting == 1
    waiter.cancel()  # its future is cancelled now; its `finally` runs a tick later
    slots.update(
        PoolSpec(model="m", replicas=[r.url for r in slots.replicas], max_concurrency=4,
                 reserve=after),
        LeastInflightPicker(None),
    )  # fmt: skip
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.waiting == 0 and set(slots.waiting_by_group) == {0}
    assert slots.waiting_by_tier == [0, 0, 0]
    for grant in held:
        slots.release(grant)
    assert slots.inflight == 0


async def test_a_failure_after_the_grant_gives_the_slot_back(tiny_policy) -> None:
    """A picker (a plug-in) that raises when told of the grant: the request fails, its slot
    and the latency model's flight do not stay taken."""
    slots = pool(slo={})

    def refuse(replica: object, claim: object) -> None:
        raise RuntimeError("a scorer's bug")

    slots.picker.granted = refuse  # type: ignore[method-assign]
    ctx = Ctx(
        request_id="r",
        api=BY_NAME["chat"],
        path="/v1/chat/completions",
        headers=CIMultiDictProxy(CIMultiDict()),
        arrived=0.0,
    )
    ctx.pool, ctx.input_tokens = tiny_policy.pools["main"], 100
    with pytest.raises(RuntimeError):
        async with slots.slot(ctx, Place()):
            pass
    [replica] = slots.replicas
    assert (replica.inflight, replica.inflight_tokens) == (0, 0)
    assert replica.latency is not None and replica.latency.prefill_tokens == 0
