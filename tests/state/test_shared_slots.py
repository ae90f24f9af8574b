"""Replica slots shared by several gateways through a real `redis-server`: the cap holds across
all of them, a gateway killed with `kill -9` gives its slots back when its leases expire, and a
Redis outage falls back to each gateway's share of the cap (open) or to fast 503s (closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from typing import Any

import aiohttp
import pytest
import redis

from tests.conftest import (
    RedisServer,
    basic_policy,
    eventually,
    paced,
    serving,
    write_policy,
)
from tests.request.test_quotas import Clock

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "share"}], "max_tokens": 4}


def shared_policy(
    tokenizer_dir: Any, replica: str, server: RedisServer, *, cap: int, **state: Any
) -> dict[str, Any]:
    policy = basic_policy(
        tokenizer_dir, [replica], max_concurrency=cap, queue={"max_depth": 1000, "max_wait_s": 60}
    )
    policy["state"] = {"backend": "redis", "url": server.url, "timeout_s": 0.3, **state}
    return policy


async def post(http: aiohttp.ClientSession, url: str) -> int:
    async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
        await resp.read()
        return resp.status


def members(server: RedisServer) -> set[bytes]:
    """Every slot lease in Redis, by id."""
    client = redis.Redis(port=server.port)
    return {m for key in client.scan_iter("slots:*") for m in client.zrange(key, 0, -1)}


def leases(server: RedisServer) -> int:
    return len(members(server))


def expiries(server: RedisServer, prefix: bytes) -> dict[bytes, float]:
    """The slot leases whose ids start with `prefix` (one gateway's), with when each expires on
    Redis' own clock."""
    client = redis.Redis(port=server.port)
    return {
        lease: expiry
        for key in client.scan_iter("slots:*")
        for lease, expiry in client.zrange(key, 0, -1, withscores=True)
        if lease.startswith(prefix)
    }


def redis_now(server: RedisServer) -> float:
    seconds, micros = redis.Redis(port=server.port).time()
    return seconds + micros / 1e6


@pytest.mark.parametrize("spare_s", [0.0, 1.0])
async def test_two_gateways_never_run_more_than_the_replicas_cap_together(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http, spare_s
) -> None:
    """With spares too: a slot reused without asking Redis is one Redis still counts."""
    replica = await stub_factory(delay_s=0.05)
    policy = shared_policy(
        tokenizer_dir, replica.url, fresh_redis, cap=3, gateways=2, spare_slots_s=spare_s
    )
    first, second = await gateway_factory(policy), await gateway_factory(policy)
    for _ in range(3):  # the later rounds start with the spares the earlier ones left
        statuses = await asyncio.gather(
            *(post(http, gw.url) for _ in range(20) for gw in (first, second))
        )
        assert statuses == [200] * 40
    assert replica.stats.max_running == 3  # reached, never passed
    await eventually(lambda: leases(fresh_redis) == 0)  # every release reached Redis
    assert first.inflight() == second.inflight() == 0


async def test_three_gateway_processes_hold_the_cap_and_a_killed_ones_slots_come_back(
    fresh_redis, stub_factory, tokenizer_dir, tmp_path
) -> None:
    replica = await stub_factory(delay_s=0.2)
    ttl = 2.0
    policy = shared_policy(
        tokenizer_dir, replica.url, fresh_redis, cap=8, gateways=3, lease_ttl_s=ttl
    )
    policy["server"] = {"access_log": False}
    path = write_policy(tmp_path, policy)
    running: list[int] = []  # the replica's own concurrency, sampled throughout
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            running.append(replica.stats.running)
            await asyncio.sleep(0.005)

    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
        serving(path) as (victim, three),
    ):
        # The gateway to be killed starts alone: its leases are the ones Redis holds now.
        first = asyncio.create_task(post(http, three))
        async with asyncio.timeout(10):
            while not members(fresh_redis):  # noqa: ASYNC110 - Redis holds the state
                await asyncio.sleep(0.005)
        prefix = next(iter(members(fresh_redis))).split(b":")[0] + b":"
        assert await first == 200
        async with serving(path) as (_, one), serving(path) as (_, two):
            sampler = asyncio.create_task(sample())
            urls = [one, two, three] * 134  # 400 clients at once, over the three gateways
            clients = [asyncio.create_task(post(http, url)) for url in urls[:400]]
            async with asyncio.timeout(30):
                while len(expiries(fresh_redis, prefix)) < 2:  # noqa: ASYNC110 - Redis holds the state
                    await asyncio.sleep(0.005)
            victim.send_signal(signal.SIGKILL)
            await victim.wait()
            orphans = expiries(fresh_redis, prefix)
            assert orphans  # the dead gateway's slots stay leased: nobody may take them yet
            # Each expires within a lease life of the kill, on Redis' clock (a wall-clock bound
            # on their return measured the machine's pace as well)...
            assert max(orphans.values()) <= redis_now(fresh_redis) + ttl, orphans
            # ...where the dead gateway left it: nobody extends them, and once expired the next
            # call of a survivor's drops them (the time-out only stops a test that would hang).
            async with asyncio.timeout(10 * ttl):
                while left := expiries(fresh_redis, prefix):
                    assert left.items() <= orphans.items(), (left, orphans)
                    await asyncio.sleep(0.005)
            async with asyncio.timeout(5):  # and the survivors fill the replica again
                while replica.stats.running < 8:  # noqa: ASYNC110 - the stub counts
                    await asyncio.sleep(0.005)
            results = await asyncio.gather(*clients, return_exceptions=True)
            done.set()
            await sampler

    survivors = [r for url, r in zip(urls, results, strict=False) if url != three]
    assert survivors == [200] * len(survivors)  # the others carried on: nothing lost
    assert max(running) == 8  # the cap, reached and never passed by three gateways together
    await eventually(lambda: leases(fresh_redis) == 0, within_s=ttl + 2)


async def test_redis_down_each_gateway_keeps_its_share_of_the_cap_then_shares_again(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory(delay_s=0.1)
    policy = shared_policy(tokenizer_dir, replica.url, fresh_redis, cap=4, gateways=2)
    gw = await gateway_factory(policy)
    assert await asyncio.gather(*(post(http, gw.url) for _ in range(8))) == [200] * 8
    assert replica.stats.max_running == 4  # shared: one gateway may use the whole cap
    # Its spares gone back (a spare is a lease Redis granted: a request may still take it while
    # Redis is down and nothing has found out yet), so the next requests find Redis down.
    await eventually(lambda: leases(fresh_redis) == 0)

    fresh_redis.stop()
    replica.stats.max_running = 0
    assert await asyncio.gather(*(post(http, gw.url) for _ in range(8))) == [200] * 8
    assert replica.stats.max_running == 2  # failing open: its half of the cap
    assert gw.gateway.slots["main"].degraded

    fresh_redis.start()
    await eventually(lambda: not gw.gateway.slots["main"].degraded)  # renewals probe Redis
    replica.stats.max_running = 0
    assert await asyncio.gather(*(post(http, gw.url) for _ in range(8))) == [200] * 8
    assert replica.stats.max_running == 4
    assert gw.inflight() == 0


async def test_redis_down_the_shares_count_the_slots_each_gateway_already_holds(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    """Two gateways hold 3 and 1 of a replica's 4 slots when Redis dies. An even share, 2 each,
    let the one holding 1 take another while the other still ran its 3: 5 running."""
    gate = asyncio.Event()
    replica = await stub_factory(gate=gate)  # every request runs until the gate opens
    policy = shared_policy(
        tokenizer_dir, replica.url, fresh_redis, cap=4, gateways=2, lease_ttl_s=1.5
    )
    more, less = await gateway_factory(policy), await gateway_factory(policy)
    load = [asyncio.create_task(post(http, more.url)) for _ in range(3)]
    await eventually(lambda: replica.stats.running == 3)
    load.append(asyncio.create_task(post(http, less.url)))
    await eventually(lambda: replica.stats.running == 4)
    pools = [gw.gateway.slots["main"] for gw in (more, less)]
    # A renewal tells each of the other's leases; then both have requests waiting.
    await eventually(lambda: [p.replicas[0].leased_elsewhere for p in pools] == [1, 3])
    load += [asyncio.create_task(post(http, gw.url)) for gw in (more, less) for _ in range(2)]
    await eventually(lambda: more.waiting() == less.waiting() == 2)

    fresh_redis.stop()
    await eventually(lambda: all(p.degraded for p in pools))
    # What each may hold now, or holds still if more, is within the cap together.
    assert sum(max(p.replicas[0].inflight, p.replicas[0].cap) for p in pools) == 4
    gate.set()
    assert await asyncio.gather(*load) == [200] * 8
    assert replica.stats.max_running == 4
    assert more.inflight() == less.inflight() == 0


async def test_redis_down_and_failing_closed_answers_503_at_once_then_recovers(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory()
    policy = shared_policy(tokenizer_dir, replica.url, fresh_redis, cap=4, on_failure="closed")
    gw = await gateway_factory(policy)
    assert await post(http, gw.url) == 200
    # Its spare gone back: a request that takes one makes no call that could find Redis down.
    await eventually(lambda: leases(fresh_redis) == 0)
    fresh_redis.stop()

    async def refused() -> None:
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            body = await resp.json()
            assert (resp.status, body["error"]["code"]) == (503, "state_unavailable")
            assert "Retry-After" in resp.headers

    for _ in range(3):
        _, pace = await paced(refused(), tick_s=0.002)
        # Waited on no time-out (the state's is 0.3 s), the machine's pauses aside: a
        # wall-clock bound measured them as well.
        assert pace.waited < 0.3, pace
    assert replica.stats.requests == 1 and gw.inflight() == 0
    fresh_redis.start()
    deadline = time.monotonic() + 5
    while await post(http, gw.url) != 200:
        assert time.monotonic() < deadline, "shared slots never resumed"
        await asyncio.sleep(0.2)


async def test_gateways_agree_on_saturation_so_an_idle_one_sheds_too(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    # 2 run and 4 wait: saturation 3 for the first 1.5 s, 2 for the next (a window wide enough
    # for a loaded machine; with 2 waiting and 0.5 s requests the window was 0.5 s, and missed).
    replica = await stub_factory(delay_s=1.5)
    policy = shared_policy(tokenizer_dir, replica.url, fresh_redis, cap=2, lease_ttl_s=0.6)
    policy["pools"]["main"]["shed"] = {"sheddable": 2.0}
    busy, idle = await gateway_factory(policy), await gateway_factory(policy)
    load = [asyncio.create_task(post(http, busy.url)) for _ in range(6)]
    await eventually(lambda: busy.inflight() == 2 and busy.waiting() == 4)
    # Within a renewal period the idle gateway has heard of the other's leases and waiters.
    pool = idle.gateway.slots["main"]
    await eventually(lambda: pool.saturation >= 2.0, within_s=2)
    assert idle.inflight() == idle.waiting() == 0
    headers = {"x-priority": "sheddable"}
    async with http.post(f"{idle.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        body = await resp.json()
        assert (resp.status, body["error"]["code"]) == (429, "shed")
    assert await asyncio.gather(*load) == [200] * 6


async def test_clients_that_give_up_while_queued_or_served_leave_no_lease_behind(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory(delay_s=0.05, chunk_delay_s=0.01)
    policy = shared_policy(tokenizer_dir, replica.url, fresh_redis, cap=3, gateways=2)
    first, second = await gateway_factory(policy), await gateway_factory(policy)
    stream = {**CHAT, "stream": True, "max_tokens": 20}

    async def impatient(gw: Any, i: int) -> None:
        # Hang up at different moments: queued, waiting for the first token, mid-stream.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.01 * (i % 25)):
                async with http.post(f"{gw.url}/v1/chat/completions", json=stream) as resp:
                    await resp.read()

    await asyncio.gather(*(impatient(gw, i) for i in range(60) for gw in (first, second)))
    assert replica.stats.max_running <= 3
    await eventually(lambda: first.inflight() == second.inflight() == 0)
    await eventually(lambda: first.waiting() == second.waiting() == 0)
    await eventually(lambda: leases(fresh_redis) == 0)  # every lease given back, none expired
    # The gauge is the ledger's last count: on a loaded machine every call may have timed out
    # (failing open, so no count yet) until the next renewal reads it.
    await eventually(lambda: first.gateway.slots["main"].replicas[0].shared == 0, within_s=10)
    async with http.get(f"{first.url}/metrics") as resp:
        assert f'llm_replica_leases{{pool="main",replica="{replica.url}"}} 0.0' in await resp.text()


async def test_releases_redis_missed_during_a_stall_are_dropped_by_the_next_renewal(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory(delay_s=0.3)
    policy = shared_policy(tokenizer_dir, replica.url, fresh_redis, cap=4, lease_ttl_s=30)
    gw = await gateway_factory(policy)
    running = [asyncio.create_task(post(http, gw.url)) for _ in range(3)]
    await eventually(lambda: leases(fresh_redis) == 3)
    # Redis stalls for longer than the gateway's time-out: the releases of the requests that end
    # meanwhile, and the lease a timed-out call may still write, do not reach it.
    redis.Redis(port=fresh_redis.port).execute_command("CLIENT", "PAUSE", "600", "ALL")
    late = asyncio.create_task(post(http, gw.url))
    assert await asyncio.gather(*running, late) == [200] * 4  # fail-open served the fourth
    await eventually(lambda: gw.inflight() == 0)
    # Well inside the 30 s lease life, the first renewal after Redis answers drops them all.
    await eventually(lambda: leases(fresh_redis) == 0, within_s=5)


async def test_tiers_hold_across_gateways_a_critical_backlog_gets_the_freed_slots(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory(delay_s=0.2)
    # Redis slow, not down, on a loaded machine (three gateways and a flood on two cores): a
    # call that outlived the file's 0.3 s time-out sent a gateway to its local share, which
    # grants past the tiers this test is about. The failover has its own tests.
    policy = shared_policy(
        tokenizer_dir, replica.url, fresh_redis, cap=2, lease_ttl_s=0.6, timeout_s=1.0
    )
    ops, batch_one, batch_two = [await gateway_factory(policy) for _ in range(3)]

    async def send(gw: Any, tier: str) -> int:
        headers = {"x-priority": tier}
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
            await resp.read()
            return resp.status

    flood = [asyncio.create_task(send(gw, "sheddable")) for gw in (batch_one, batch_two)
             for _ in range(25)]  # fmt: skip
    await eventually(lambda: batch_one.waiting() > 10 and batch_two.waiting() > 10)
    critical_at = time.time()
    critical = [asyncio.create_task(send(ops, "critical")) for _ in range(10)]
    assert await asyncio.gather(*critical) == [200] * 10

    def granted(gw: Any) -> list[float]:
        records = [json.loads(line) for line in gw.access_log.getvalue().splitlines()]
        return [r["ts"] - r["e2e_s"] + r["queue_wait_s"] for r in records if r["status"] == 200]

    last_critical = max(granted(ops))
    # Within a share tick or two (0.2 s each) the other gateways know of the critical waiters and
    # leave every freed slot to them: 10 x 0.2 s on 2 slots, about a second, not three.
    batch_meanwhile = [t for gw in (batch_one, batch_two) for t in granted(gw)
                       if critical_at + 0.5 < t < last_critical]  # fmt: skip
    assert len(batch_meanwhile) <= 2, (len(batch_meanwhile), last_critical - critical_at)
    assert last_critical - critical_at < 2.0
    assert set(await asyncio.gather(*flood)) == {200}


async def test_slots_taken_while_redis_was_down_are_leased_again_when_it_returns(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory(delay_s=4.0)
    policy = shared_policy(tokenizer_dir, replica.url, fresh_redis, cap=4, lease_ttl_s=1.5)
    gw = await gateway_factory(policy)
    fresh_redis.stop()
    running = [asyncio.create_task(post(http, gw.url)) for _ in range(2)]
    await eventually(lambda: replica.stats.running == 2)  # counted here only, failing open
    assert gw.gateway.slots["main"].degraded
    fresh_redis.start()  # empty: it kept nothing
    # The first renewal after Redis answers writes both back, while their requests still run, so
    # other gateways count them against the cap again. Redis holds them a moment before this
    # gateway has read its answer and left the degraded mode: the wait is for both.
    pool = gw.gateway.slots["main"]
    await eventually(lambda: leases(fresh_redis) == 2 and not pool.degraded, within_s=3)
    assert replica.stats.running == 2
    assert await asyncio.gather(*running) == [200, 200]
    await eventually(lambda: leases(fresh_redis) == 0)


async def test_a_pool_a_reload_removes_keeps_its_running_streams_leases_then_gives_them_back(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, tmp_path, http
) -> None:
    """A stream outlives a lease: renewals go on after its pool left the policy, so the other
    gateways keep counting it, and its lease is given back when it ends, not left to expire.
    The leases' clock is the test's: it moves only when told, so a lease can expire only when
    the test says and a slow renewal is no lost one (lease lives of wall time measured the
    machine's pace as well)."""
    gate = asyncio.Event()  # the stream runs until the test lets it answer
    slow, fresh = await stub_factory(gate=gate), await stub_factory()
    ttl = 30.0  # of the test's clock; Redis drops an untouched key after twice this, in its own
    # no quota slices: `state.shared` is the Redis backend itself, whose clock the test moves
    policy = shared_policy(
        tokenizer_dir, slow.url, fresh_redis, cap=4, lease_ttl_s=ttl, slices={"fraction": 0}
    )
    gw = await gateway_factory(policy)
    clock = Clock()
    gw.gateway.state.shared.clock = clock  # type: ignore[attr-defined]
    body = {**CHAT, "max_tokens": 60, "stream": True}
    stream = asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=body))
    await eventually(lambda: slow.stats.running == 1 and leases(fresh_redis) == 1)
    policy["pools"] = {"next": {"model": "tiny", "replicas": [fresh.url], "max_concurrency": 4}}
    policy["routes"] = [{"match": {"model": ["tiny"]}, "pool": "next"}]
    (tmp_path / "policy.yaml").write_text(json.dumps(policy))
    await gw.gateway.reload()
    client = redis.Redis(port=fresh_redis.port)
    (key,) = client.scan_iter("slots:*")
    for _ in range(2):  # two lease lives: only renewals keep it, each writing it at the new time
        clock.now += ttl
        await eventually(
            lambda: client.zrange(key, 0, -1, withscores=True)[0][1] == clock.now + ttl
        )
    assert leases(fresh_redis) == 1
    gate.set()
    async with await stream as resp:
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    # Its expiry is a lease life ahead on a clock that stands still: gone means given back.
    await eventually(lambda: leases(fresh_redis) == 0)
    assert gw.gateway.retiring == {}


# The tests of spares below give Redis calls 2 s (not the file's 0.3 s): on a loaded machine a
# call that timed out sent the gateway to its local share, which gives every spare back.


def spare_policy(
    tokenizer_dir: Any, replica: str, server: RedisServer, *, cap: int, spare_s: float
) -> dict[str, Any]:
    """Redis calls get 2 s (above), and a lease lives far longer than a test: one gone from
    Redis was given back, not expired."""
    return shared_policy(
        tokenizer_dir, replica, server, cap=cap, timeout_s=2.0, lease_ttl_s=60,
        spare_slots_s=spare_s,
    )  # fmt: skip


class Calls:
    """Counts the slot ledger's lease and release calls a gateway makes to Redis (its real
    `RedisState`, whose methods this wraps and still calls)."""

    def __init__(self, gw: Any) -> None:
        self.leases = self.releases = 0
        shared = gw.gateway.state.shared
        lease, unlease = shared.lease, shared.unlease

        async def counted_lease(*args: Any) -> Any:
            self.leases += 1
            return await lease(*args)

        async def counted_unlease(*args: Any) -> Any:
            self.releases += 1
            return await unlease(*args)

        shared.lease, shared.unlease = counted_lease, counted_unlease


async def test_a_request_after_a_request_takes_the_spare_lease_without_a_call(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory()
    policy = spare_policy(tokenizer_dir, replica.url, fresh_redis, cap=4, spare_s=0.5)
    gw = await gateway_factory(policy)
    calls = Calls(gw)
    for _ in range(20):
        assert await post(http, gw.url) == 200
        assert leases(fresh_redis) == 1  # the spare: its slot still counts against the cap
    assert (calls.leases, calls.releases) == (1, 0)
    # Idle, it goes back within the bound, in one call.
    await eventually(lambda: leases(fresh_redis) == 0)
    assert (calls.leases, calls.releases) == (1, 1)
    assert not gw.gateway.slots["main"].replicas[0].lease_ids


async def test_spare_slots_zero_gives_every_lease_back_as_it_frees(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory()
    policy = spare_policy(tokenizer_dir, replica.url, fresh_redis, cap=4, spare_s=0)
    gw = await gateway_factory(policy)
    calls = Calls(gw)
    for _ in range(5):
        assert await post(http, gw.url) == 200
    await eventually(lambda: calls.releases == 5)
    assert calls.leases == 5 and leases(fresh_redis) == 0


async def test_spares_are_given_back_when_the_gateway_closes(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await stub_factory(delay_s=0.05)
    policy = spare_policy(tokenizer_dir, replica.url, fresh_redis, cap=4, spare_s=60)
    gw = await gateway_factory(policy)
    assert await asyncio.gather(*(post(http, gw.url) for _ in range(4))) == [200] * 4
    assert leases(fresh_redis) == 4  # kept as spares for a minute...
    await gw.gateway.close()
    assert leases(fresh_redis) == 0  # ...unless the gateway closes: then all go back


async def test_a_reload_gives_the_spares_back_and_a_smaller_cap_holds_at_once(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, tmp_path, http
) -> None:
    """A spare taken under the old cap would let a request past the new one without asking
    Redis: a reload gives every spare back, and one of a replica that left the pool too."""
    gate = asyncio.Event()
    replica, other = await stub_factory(gate=gate), await stub_factory()
    policy = spare_policy(tokenizer_dir, replica.url, fresh_redis, cap=3, spare_s=60)
    first = await gateway_factory(policy)
    second = await gateway_factory({**policy, "state": {**policy["state"], "spare_slots_s": 0}})
    gate.set()
    assert await asyncio.gather(*(post(http, first.url) for _ in range(2))) == [200] * 2
    assert leases(fresh_redis) == 2  # two spares at the first gateway
    gate.clear()
    held = asyncio.create_task(post(http, second.url))  # the second runs one
    await eventually(lambda: replica.stats.running == 1)
    policy["pools"]["main"]["max_concurrency"] = 2
    (tmp_path / "policy.yaml").write_text(json.dumps(policy))
    await first.gateway.reload()
    await eventually(lambda: leases(fresh_redis) == 1)  # the spares went back
    # One running at the second gateway, cap 2: one more fits across both, not two.
    more = [asyncio.create_task(post(http, first.url)) for _ in range(2)]
    await eventually(lambda: replica.stats.running == 2 and first.waiting() == 1)
    gate.set()
    assert await asyncio.gather(held, *more) == [200] * 3
    assert replica.stats.max_running == 2

    # The second gateway keeps none: what Redis holds now are the first's spares...
    await eventually(lambda: second.inflight() == 0 and leases(fresh_redis) > 0)
    policy["pools"]["main"]["replicas"] = [other.url]
    (tmp_path / "policy.yaml").write_text(json.dumps(policy))
    await first.gateway.reload()
    # ...and a replica the reload removes gives them back at once, a minute before their time.
    await eventually(lambda: leases(fresh_redis) == 0)
    assert first.gateway.slots["main"].leases.departed == []


async def test_a_spare_is_not_kept_while_another_gateway_waits_for_a_slot(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    """A gateway whose client sends request after request, each after a short pause, keeps its
    one slot as a spare through every pause: the other gateway's waiter, polling Redis, would
    never find it free. Once the share tick tells it of that waiter, the slot goes back as it
    frees and the waiter takes it in the next pause."""
    replica = await stub_factory(delay_s=0.02)
    policy = shared_policy(
        tokenizer_dir,
        replica.url,
        fresh_redis,
        cap=1,
        timeout_s=2.0,
        lease_ttl_s=0.6,
        spare_slots_s=60,
    )
    busy, other = await gateway_factory(policy), await gateway_factory(policy)
    assert await post(http, busy.url) == 200  # its spare now holds the only slot
    waiter = asyncio.create_task(post(http, other.url))
    sent = 0
    while not waiter.done() and sent < 100:  # ~10 s of pauses; a share tick is 0.2 s
        assert await post(http, busy.url) == 200
        sent += 1
        await asyncio.sleep(0.05)  # longer than two polls (20 ms, jittered)
    assert waiter.done() and await waiter == 200, sent


async def test_redis_down_the_spares_go_and_the_share_counts_only_slots_in_use(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    """Failing open, a gateway keeps what it holds plus its share of the rest: spares it kept
    would count as held and, reused, run past that share."""
    replica = await stub_factory(delay_s=0.1)
    policy = shared_policy(
        tokenizer_dir, replica.url, fresh_redis, cap=4, gateways=2, timeout_s=2.0,
        spare_slots_s=60,
    )  # fmt: skip
    gw = await gateway_factory(policy)
    assert await asyncio.gather(*(post(http, gw.url) for _ in range(4))) == [200] * 4
    assert leases(fresh_redis) == 4  # all four kept as spares
    pool = gw.gateway.slots["main"]
    fresh_redis.stop()
    await eventually(lambda: pool.degraded)  # the next renewal finds Redis down
    assert pool.replicas[0].cap == 2 and not pool.replicas[0].spares
    replica.stats.max_running = 0
    assert await asyncio.gather(*(post(http, gw.url) for _ in range(8))) == [200] * 8
    assert replica.stats.max_running == 2


async def test_a_spare_of_one_class_makes_room_for_a_request_of_another_at_once(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    """A spare holds its replica's room for its own class; a request of another class that
    Redis refuses for that room gets it back, rather than polling until the spare is swept."""
    replica = await stub_factory(delay_s=0.05)
    policy = spare_policy(
        tokenizer_dir, replica.url, fresh_redis, cap=2, spare_s=60
    )  # swept after half a minute
    policy["classes"] = [
        {"name": "long", "when": {"input_tokens": {"gte": 20}}},
        {"name": "any", "when": {}},
    ]
    policy["pools"]["main"]["reserve"] = {"long": 1}
    gw = await gateway_factory(policy)
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "hello there " * 20}]}

    async def chat(body: dict[str, Any]) -> int:
        async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status

    assert await asyncio.gather(chat(long_chat), chat(long_chat)) == [200, 200]
    assert leases(fresh_redis) == 2  # both kept as spares of `long`: the replica's whole cap
    async with asyncio.timeout(10):
        assert await chat(CHAT) == 200
    logged = [json.loads(line) for line in gw.access_log.getvalue().splitlines()]
    assert [line["class"] for line in logged] == ["long", "long", "any"]
