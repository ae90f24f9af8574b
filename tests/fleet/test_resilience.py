"""Failure handling: retries within a budget, time-outs with clear errors, ejection and readmission."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from loadtest.sim import ReplicaOptions, load_profile, start_replica
from tests.conftest import basic_policy, eventually

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


def dead_url() -> str:
    """A loopback port nobody listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def access(gw) -> list[dict]:
    return [json.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def scrape(http: aiohttp.ClientSession, gw) -> dict[str, list]:
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


async def test_a_refusing_replica_is_retried_on_the_other(
    stub, gateway_factory, tokenizer_dir
) -> None:
    policy = basic_policy(tokenizer_dir, [dead_url(), stub.url])
    policy["pools"]["main"]["health"] = {"interval_s": 0, "consecutive_failures": 100}
    gw = await gateway_factory(policy)
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(**CHAT)
    assert reply.choices[0].message.content == " tok" * 3
    stream = await client.chat.completions.create(**CHAT, stream=True)
    assert (
        "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == " tok" * 3
    )
    await client.close()
    assert [(x["status"], x["retries"], x["replica"]) for x in access(gw)] == [
        (200, 1, stub.url)
    ] * 2
    assert gw.inflight() == 0


async def test_a_503_is_retried_on_the_other(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    busy, ok = await stub_factory(status=503), await stub_factory()
    gw = await gateway_factory(basic_policy(tokenizer_dir, [busy.url, ok.url]))
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    assert (busy.stats.requests, ok.stats.completed) == (1, 1)


async def test_no_budget_means_no_retry(stub, gateway_factory, tokenizer_dir, http) -> None:
    policy = basic_policy(tokenizer_dir, [dead_url(), stub.url])
    policy["pools"]["main"]["retry"] = {"budget_percent": 0, "min_concurrent": 0}
    gw = await gateway_factory(policy)
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 502 and (await resp.json())["error"]["code"] == "upstream_error"
    assert stub.stats.requests == 0 and gw.inflight() == 0


async def test_a_failing_replica_is_ejected_then_readmitted(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    sick, healthy = await stub_factory(status=500), await stub_factory()
    policy = basic_policy(tokenizer_dir, [sick.url, healthy.url])
    policy["pools"]["main"]["health"] = {
        "interval_s": 0.05,
        "consecutive_failures": 2,
        "ejection_s": 0.3,
    }
    gw = await gateway_factory(policy)
    statuses = []
    for _ in range(6):
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            statuses.append(resp.status)
    assert statuses[:2] == [500, 500]  # the replica's own errors reach the client intact
    assert statuses[2:] == [200] * 4  # ejected: its slots left the pool
    found = await scrape(http, gw)
    up = {s.labels["replica"]: s.value for s in found["llm_replica_up"]}
    assert up == {sick.url: 0.0, healthy.url: 1.0}
    assert [
        (s.labels["replica"], s.labels["reason"], s.value)
        for s in found["llm_replica_ejections_total"]
    ] == [(sick.url, "5xx", 1.0)]
    assert [s.value for s in found["llm_pool_capacity"]] == [8.0]
    sick.config.status = 200  # it recovers: the half-open probe lets it back in
    await eventually(lambda: all(r.up for r in gw.gateway.slots["main"].replicas))
    found = await scrape(http, gw)
    assert [s.value for s in found["llm_pool_capacity"]] == [16.0]


async def test_a_failing_last_replica_stays_in_and_says_it_is_failing(
    stub_factory, gateway_factory, tokenizer_dir, http, caplog
) -> None:
    """A pool never ejects its last replica (nor more than max_ejection_percent): requests still
    go to it, so its failures must show somewhere other than `llm_replica_up`, or a dead
    one-replica pool raises no replica alert at all."""
    sick = await stub_factory(status=500)
    policy = basic_policy(tokenizer_dir, [sick.url])
    # Passive only: requests are the probes, so only they move the count (a probe of the stub's
    # /health, always 200, would end the spell whenever it ran).
    policy["pools"]["main"]["health"] = {"interval_s": 0, "consecutive_failures": 2}
    gw = await gateway_factory(policy)

    async def failing() -> tuple[float, float]:
        found = await scrape(http, gw)
        [up], [failing] = found["llm_replica_up"], found["llm_replica_failing"]
        assert up.labels == failing.labels == {"pool": "main", "replica": sick.url}
        return up.value, failing.value

    assert await failing() == (1.0, 0.0)
    for _ in range(2):
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 500
    assert await failing() == (1.0, 1.0)
    assert [s.value for s in (await scrape(http, gw))["llm_pool_capacity"]] == [8.0]
    assert "fails (5xx, 2 in a row) but stays" in caplog.text
    sick.config.status = 200  # the next request that succeeds ends the spell
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    assert await failing() == (1.0, 0.0)
    sick.config.status = 500  # a second spell soon after is not told again
    for _ in range(2):
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 500
    assert await failing() == (1.0, 1.0)
    assert caplog.text.count("but stays") == 1


async def test_first_token_timeout_is_504(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=3)
    policy = basic_policy(tokenizer_dir, [slow.url])
    policy["pools"]["main"]["timeouts"] = {"first_token_s": 0.2}
    gw = await gateway_factory(policy)
    async with http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status == 504 and (await resp.json())["error"]["code"] == "upstream_timeout"
    await eventually(lambda: slow.stats.running == 0 and gw.inflight() == 0)


async def test_total_timeout_is_504_for_a_whole_answer(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=3)
    policy = basic_policy(tokenizer_dir, [slow.url])
    policy["pools"]["main"]["timeouts"] = {"total_s": 0.2}
    gw = await gateway_factory(policy)
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 504
    await eventually(lambda: slow.stats.running == 0 and gw.inflight() == 0)


async def test_a_stall_mid_stream_ends_with_an_error_event(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    stalling = await stub_factory(chunk_delay_s=2)
    policy = basic_policy(tokenizer_dir, [stalling.url])
    policy["pools"]["main"]["timeouts"] = {"read_s": 0.3}
    gw = await gateway_factory(policy)
    async with http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status == 200
        events = [line for line in (await resp.read()).split(b"\n\n") if line]
    assert b'"upstream_timeout"' in events[-2] and events[-1] == b"data: [DONE]"
    await eventually(lambda: stalling.stats.disconnects == 1 and gw.inflight() == 0)
    assert access(gw)[-1]["reason"] == "upstream_timeout"


async def test_desired_replicas_follows_demand(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=0.2)
    policy = basic_policy(tokenizer_dir, [slow.url], max_concurrency=2)
    policy["pools"]["main"]["health"] = {"interval_s": 0.05}
    gw = await gateway_factory(policy)

    async def user() -> None:
        for _ in range(6):  # bounded: 6 requests each
            async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200

    await asyncio.gather(*(user() for _ in range(8)))  # 8 users on 2 slots: 4 replicas' worth
    found = await scrape(http, gw)
    desired = [s.value for s in found["llm_pool_desired_replicas"]]
    assert desired and desired[0] > 2.0


async def test_drift_against_the_replicas_own_metrics_is_detected_and_corrected(
    gateway_factory, http
) -> None:
    replica = await start_replica(
        load_profile("gemma-3-12b-tpu-v6e-2x2"), ReplicaOptions(time_scale=100)
    )
    try:
        policy = {
            "models": {"gemma-3-12b-it": {"tokenizer": "estimate", "max_model_len": 128000}},
            "pools": {"main": {"model": "gemma-3-12b-it", "replicas": [replica.url], "max_concurrency": 4,
                               "health": {"reconcile_interval_s": 0.05}}},
            "classes": [{"name": "any"}],
            "routes": [{"pool": "main"}],
        }  # fmt: skip
        gw = await gateway_factory(policy)
        slot = gw.gateway.slots["main"].replicas[0]
        slot.inflight += 3  # a forced leak: counted here, held by nobody, unknown to the replica
        await eventually(lambda: slot.inflight == 0)
        found = await scrape(http, gw)
        drift = [(s.labels["kind"], s.value) for s in found["llm_slot_drift_total"]]
        assert drift and drift[0][0] == "gateway_high" and drift[0][1] >= 2
        assert [s.value for s in found["llm_replica_observed_requests"]] == [0.0]
        body = {
            "model": "gemma-3-12b-it",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
        }
        async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200  # the slots are whole again
    finally:
        await replica.close()


async def test_a_replica_decoding_slower_than_its_peers_is_ejected(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    fast = [await stub_factory(chunk_delay_s=0.002) for _ in range(2)]
    slow = await stub_factory(chunk_delay_s=0.02)  # a tenth of its peers' speed
    policy = basic_policy(tokenizer_dir, [slow.url, *(r.url for r in fast)])
    policy["pools"]["main"]["health"] = {"interval_s": 0.05, "slow_window_s": 0.3}
    gw = await gateway_factory(policy)
    body = {**CHAT, "max_tokens": 10, "stream": True}

    async def user() -> None:
        for _ in range(20):  # bounded
            async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
            if not gw.gateway.slots["main"].replicas[0].up:
                return

    await asyncio.gather(*(user() for _ in range(6)))
    pool = gw.gateway.slots["main"]
    assert not pool.replicas[0].up and all(r.up for r in pool.replicas[1:])
    assert list(pool.ejections) == [(slow.url, "slow")]


async def test_retries_cannot_amplify_a_full_outage(gateway_factory, tokenizer_dir, http) -> None:
    gw = await gateway_factory(
        basic_policy(tokenizer_dir, [dead_url(), dead_url()], max_concurrency=64)
    )

    async def call() -> int:
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            return resp.status

    statuses = await asyncio.gather(*(call() for _ in range(40)))
    assert statuses == [502] * 40
    retries = sum(x["retries"] for x in access(gw))
    assert retries <= 10  # the budget's floor and the ejection stop retries, not the request count
    assert gw.inflight() == 0 and gw.gateway.slots["main"].retrying == 0


async def test_disconnect_while_waiting_for_the_first_token(
    stub_factory, gateway_factory, tokenizer_dir
) -> None:
    slow = await stub_factory(delay_s=5)
    gw = await gateway_factory(basic_policy(tokenizer_dir, [slow.url]))
    session = aiohttp.ClientSession()
    request = asyncio.create_task(
        session.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True})
    )
    await eventually(lambda: slow.stats.running == 1)
    request.cancel()
    await session.close()
    await eventually(lambda: slow.stats.disconnects == 1 and slow.stats.running == 0)
    await eventually(lambda: gw.inflight() == 0 and gw.inflight_tokens() == 0)
    assert access(gw)[-1]["status"] == 499


async def test_requests_that_run_out_their_own_total_s_eject_no_replica(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    """`total_s` is the request's own limit: a long stream it cuts, or a long whole answer, says
    nothing of the replica that was answering (its silence is `read_s`'s to judge, a stream's
    start `first_token_s`'s). Held against the replicas, one tenant's long streams ejected
    healthy ones and left the rest marked failing."""
    a, b = await stub_factory(chunk_delay_s=0.2), await stub_factory(chunk_delay_s=0.2)
    policy = basic_policy(tokenizer_dir, [a.url, b.url])
    policy["pools"]["main"]["health"] = {"interval_s": 0, "consecutive_failures": 2}
    policy["pools"]["main"]["timeouts"] = {"total_s": 0.3}
    gw = await gateway_factory(policy)
    long = {**CHAT, "max_tokens": 100}
    for _ in range(4):  # cut mid-stream
        async with http.post(f"{gw.url}/v1/chat/completions", json={**long, "stream": True}) as r:
            assert r.status == 200 and '"code":"total_timeout"' in await r.text()
    a.config.delay_s = b.config.delay_s = 5
    for _ in range(4):  # cut before the whole answer's head
        async with http.post(f"{gw.url}/v1/chat/completions", json=long) as r:
            assert (r.status, (await r.json())["error"]["code"]) == (504, "total_timeout")
    assert [x["reason"] for x in access(gw)] == ["total_timeout"] * 8
    found = await scrape(http, gw)
    assert found.get("llm_replica_ejections_total", []) == []
    assert {s.labels["replica"]: s.value for s in found["llm_replica_up"]} == {a.url: 1, b.url: 1}
    assert [s.value for s in found["llm_replica_failing"]] == [0, 0]
    await eventually(lambda: a.stats.running == b.stats.running == 0 and gw.inflight() == 0)


async def test_a_fresh_gateway_reports_what_its_replicas_answered(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    """Issue 36 item 12: a replica counted as healthy until it had failed three probes five
    seconds apart, so a fresh gateway called one that does not listen healthy for 15 s. It probes
    before it serves: its first `/readyz` has the listening replica healthy, the other failing
    (not yet ejected: one failure of three); with probes off, both are unchecked until a request
    reaches them."""
    dead = dead_url()
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url, dead]))
    async with http.get(f"{gw.url}/readyz") as resp:
        pool = (await resp.json())["pools"]["main"]
    assert pool["replicas"] == {stub.url: "healthy", dead: "failing"}
    assert (pool["healthy"], pool["failing"], pool["ejected"], pool["unchecked"]) == (1, 1, 0, 0)

    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["pools"]["main"]["health"] = {"interval_s": 0}
    gw = await gateway_factory(policy)
    async with http.get(f"{gw.url}/readyz") as resp:
        assert (await resp.json())["pools"]["main"]["replicas"] == {stub.url: "unchecked"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    async with http.get(f"{gw.url}/readyz") as resp:
        assert (await resp.json())["pools"]["main"]["replicas"] == {stub.url: "healthy"}


async def test_readyz_says_which_replicas_fail(gateway_factory, tokenizer_dir, http) -> None:
    """A pool keeps its last replica in however it fails (and ejects at most
    `max_ejection_percent`), so "in the pool" is not "up": `/readyz` said `{"main": 1}` of a pool
    whose every request got a 502. It stays 200 (docs/operations.md says why) and names the
    healthy, failing and ejected replicas of each pool."""
    dead = [dead_url(), dead_url()]
    policy = basic_policy(tokenizer_dir, dead)
    policy["pools"]["main"]["health"] = {"interval_s": 0.05, "consecutive_failures": 1}
    gw = await gateway_factory(policy)
    replicas = gw.gateway.slots["main"].replicas
    await eventually(lambda: sorted(r.up for r in replicas) == [False, True])
    await eventually(lambda: all(r.failures for r in replicas))
    async with http.get(f"{gw.url}/readyz") as resp:
        assert resp.status == 200
        body = await resp.json()
    [ejected] = [r.url for r in replicas if not r.up]
    [failing] = [r.url for r in replicas if r.up]
    assert body == {
        "ready": True,
        "draining": False,
        "pools": {
            "main": {
                "healthy": 0,
                "failing": 1,
                "ejected": 1,
                "unchecked": 0,
                "replicas": {ejected: "ejected", failing: "failing"},
            }
        },
    }
