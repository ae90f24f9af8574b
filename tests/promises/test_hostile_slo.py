"""A seeded walk over a pool with `slo`, on the real queue, latency model and slot code: requests
of every tier, of three tenants and two classes (one with reserved slots), with objectives or
none (some already past their deadline), streamed or whole, arrive, wait, are granted, see a
first token or none, end or are cancelled (a client leaving) while queued or running, and are
refused as unreachable; between them reloads take `slo` away, bring it back with another seed,
and regroup the queue. After every step the queue's deadline index (`Queue._edf`) holds only
flows whose earliest entry still waits, none when nobody waits; at the end every slot, queue
place and latency flight (on every model a replica had) is back to 0. A failure names the
seed and the step."""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.admit.fairqueue import Place
from gateway.admit.latency import ReplicaLatency
from gateway.admit.pool import LivePool
from gateway.api import BY_NAME
from gateway.config.schema import PoolSpec, TenantSpec
from gateway.context.compiled import Tenant
from gateway.context.ctx import Ctx
from gateway.context.objective import Objective
from gateway.errors import GatewayError
from gateway.pick.picker import LeastInflightPicker
from loadtest.adversary.generator import fresh_seed

FRESH = fresh_seed()
TENANTS = [Tenant(name, TenantSpec(keys_env="UNSET"), 0) for name in ("a", "b", "c")]
STEPS = 600


def spec(rng: random.Random) -> PoolSpec:
    """A pool of three replicas of two slots; `slo` present (seed drawn), or not; a class's
    reserved slot, or not."""
    slo = None
    if rng.random() < 0.8:
        slo = {
            "objectives": {"standard": {"ttft_ms": 200}, "sheddable": {"ttft_ms": 20}},
            "model": {"ttft_base_ms": rng.choice((5.0, 20.0, 400.0))},
        }
    return PoolSpec(
        model="m",
        replicas=["http://r0", "http://r1", "http://r2"],
        max_concurrency=2,
        queue={"max_depth": 32, "max_wait_s": 30, "fail_fast": False},
        reserve={"short": 1} if rng.random() < 0.5 else {},
        slo=slo,
    )


def objective(rng: random.Random, now: float) -> Objective | None:
    ttft = rng.choice((None, 1e-323, 0.001, 0.05, 5.0, math.inf))
    if ttft is None:
        return None
    tpot = rng.choice((math.inf, 0.001, 1.0))
    if ttft == math.inf and tpot == math.inf:
        return None
    return Objective(ttft, tpot, now + (0.0 if ttft == math.inf else ttft))


def edf_holds(pool: LivePool) -> str:
    """What is wrong with the deadline index, or ''."""
    queue = pool.queue
    if not queue.waiting and queue._edf:
        return f"the queue is empty, its deadline index holds {len(queue._edf)} flows"
    for flow, entries in queue._edf.items():
        if not entries:
            return f"flow {flow} is held with no entry"
        if not entries[0][2].queued:
            return f"flow {flow}'s earliest entry left the queue"
    return ""


@pytest.mark.parametrize("seed", [38, 39, 569656613, FRESH], ids=["38", "39", "569656613", "fresh"])
async def test_a_walk_over_slo_admission_leaks_nothing(seed: int) -> None:
    rng = random.Random(seed)
    pool = LivePool("p", spec(rng), LeastInflightPicker(None))
    running: list[tuple[asyncio.Task[None], asyncio.Event]] = []
    # Every request, those a move let go on its own too: all are awaited before the counts are
    # read (a request let go while it waited may be granted and not yet have run to release).
    every: list[tuple[asyncio.Task[None], asyncio.Event]] = []
    states: dict[int, ReplicaLatency] = {}
    refused: list[str] = []
    flows = 0  # the most flows the deadline index held at once: the walk reached it

    async def request(ctx: Ctx, done: asyncio.Event, first_token: bool) -> None:
        try:
            async with pool.slot(ctx, Place()):
                if first_token and ctx.prefill is not None:
                    await asyncio.sleep(0)
                    ctx.prefill.prefilled(time.perf_counter())
                await done.wait()
        except GatewayError as exc:  # refused: unreachable, a full queue
            refused.append(exc.refusal)

    for step in range(STEPS):
        move = rng.random()
        if move < 0.45:
            ctx = Ctx(
                request_id=f"r{step}",
                api=BY_NAME["chat"],
                path="/v1/chat/completions",
                headers=CIMultiDictProxy(CIMultiDict()),
                arrived=time.perf_counter(),
            )
            ctx.tenant = rng.choice(TENANTS)
            ctx.priority = rng.randrange(3)
            ctx.workload = rng.choice(("any", "short"))
            ctx.input_tokens = rng.choice((10, 500, 4000))
            ctx.stream = rng.random() < 0.7
            if pool.latency is not None:
                ctx.objective = objective(rng, ctx.arrived)
            done = asyncio.Event()
            task = asyncio.create_task(request(ctx, done, rng.random() < 0.8))
            running.append((task, done))
            every.append((task, done))
        elif move < 0.7 and running:
            running.pop(rng.randrange(len(running)))[1].set()
        elif move < 0.85 and running:
            running.pop(rng.randrange(len(running)))[0].cancel()
        elif move < 0.9:
            pool.update(spec(rng), pool.picker)
        else:
            await asyncio.sleep(rng.choice((0.0, 0.001, 0.01)))
        for _ in range(3):
            await asyncio.sleep(0)
        for replica in pool.replicas:
            if replica.latency is not None:
                states[id(replica.latency)] = replica.latency
        flows = max(flows, len(pool.queue._edf))
        wrong = edf_holds(pool)
        assert not wrong, f"seed {seed}, step {step}: {wrong}"
    for _, done in every:
        done.set()
    await asyncio.gather(*(task for task, _ in every), return_exceptions=True)
    assert pool.inflight == 0 and pool.waiting == 0 and not pool.queue._edf, f"seed {seed}"
    assert flows > 1 and "slo_unreachable" in refused, f"seed {seed}: the walk missed its aim"
    leaked = [(s.replica.url, s.prefill_tokens, s.decoding) for s in states.values()
              if s.prefill_tokens or s.decoding]  # fmt: skip
    assert not leaked, f"seed {seed}: latency flights never released {leaked}"
