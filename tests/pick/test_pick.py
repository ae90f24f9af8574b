"""Picking a replica by what it holds: a pool's `pick:` scorers, end to end through the gateway
with stub replicas on loopback, and the bound that keeps affinity from piling load up."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.admit import Claim, LivePool, Replica
from gateway.admit.replica import EngineGauges
from gateway.config.load import PolicyError
from gateway.config.schema import PoolSpec
from gateway.context.affinity import Affinity
from gateway.pick.picker import RoundRobinPicker
from gateway.pick.scorers import KvCacheScorer, QueueScorer
from gateway.policy.compile import load_policy
from loadtest.sim.profiles import Profile
from loadtest.sim.server import ReplicaOptions, start_replica
from loadtest.stub_backend import STATS, StubConfig, create_stub_app
from tests.conftest import RunningGateway, Stub, _serve, basic_policy, eventually, write_policy
from tests.loadtest.test_simulator import write_profile

RULE_SETS = {name: f"Rules of {name}: " + f"{name} forbids item {name}. " * 120 for name in "ABCD"}


def classify(rules: str, product: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": f"{rules}\nProduct: {product}"}],
    }


def replicas_that_served(stubs: list[Stub], marker: str) -> set[int]:
    return {
        i
        for i, stub in enumerate(stubs)
        for body in stub.stats.bodies
        if marker in body["messages"][0]["content"]
    }


async def rounds_of_rule_sets(
    http: aiohttp.ClientSession,
    gateway: RunningGateway,
    rounds: int,
    sets: str = "ABCD",
    max_tokens: int = 4,
) -> None:
    """Each round, one request per rule set at once, in a different order each round."""
    order = list(sets)
    shuffle = random.Random(4)
    for n in range(rounds):
        shuffle.shuffle(order)
        posts = []
        for name in order:
            body = {**classify(RULE_SETS[name], f"lamp {n}"), "max_tokens": max_tokens}
            posts.append(http.post(f"{gateway.url}/v1/chat/completions", json=body))
            await asyncio.sleep(0.01)  # arrivals in this order
        for response in await asyncio.gather(*posts):
            assert response.status == 200, await response.text()
            response.release()


async def test_each_rule_set_keeps_going_to_the_replica_that_was_sent_it(
    tokenizer_dir: Path,
    stub_factory: Callable[..., Awaitable[Stub]],
    gateway_factory: Callable[[dict[str, Any]], Awaitable[RunningGateway]],
    http: aiohttp.ClientSession,
) -> None:
    stubs = [await stub_factory(delay_s=0.2) for _ in range(4)]
    policy = basic_policy(tokenizer_dir, [s.url for s in stubs], pick={"scorers": {"prefix": 1}})
    gateway = await gateway_factory(policy)
    await rounds_of_rule_sets(http, gateway, rounds=6)
    served = {name: replicas_that_served(stubs, f"Rules of {name}") for name in RULE_SETS}
    assert all(len(replicas) == 1 for replicas in served.values()), served
    assert len(set().union(*served.values())) == 4  # and the sets are spread over the fleet
    metrics = await (await http.get(f"{gateway.url}/metrics")).text()
    assert 'llm_prefix_blocks_total{outcome="matched",pool="main"}' in metrics


async def test_least_inflight_scatters_the_same_rule_sets_over_the_fleet(
    tokenizer_dir: Path,
    stub_factory: Callable[..., Awaitable[Stub]],
    gateway_factory: Callable[[dict[str, Any]], Awaitable[RunningGateway]],
    http: aiohttp.ClientSession,
) -> None:
    """The same traffic without `pick:`: what the scorer above is measured against."""
    stubs = [await stub_factory(delay_s=0.2) for _ in range(4)]
    gateway = await gateway_factory(basic_policy(tokenizer_dir, [s.url for s in stubs]))
    await rounds_of_rule_sets(http, gateway, rounds=6)
    served = {name: replicas_that_served(stubs, f"Rules of {name}") for name in RULE_SETS}
    assert any(len(replicas) > 1 for replicas in served.values()), served


async def test_a_replica_the_scorers_prefer_never_runs_more_than_the_spread_above_the_rest(
    tokenizer_dir: Path,
    gateway_factory: Callable[[dict[str, Any]], Awaitable[RunningGateway]],
    http: aiohttp.ClientSession,
) -> None:
    # The first replica reports an empty KV cache and the second a full one, all along: the
    # kv_cache scorer prefers the first for every request, however loaded it gets.
    apps = [engine_metrics(create_stub_app(StubConfig(delay_s=1.0))) for _ in range(2)]
    apps[1][GAUGES]["kv"] = 1.0
    served = [await _serve(app) for app in apps]
    try:
        pick = {"scorers": {"kv_cache": 10}, "max_load_spread": 0.25, "metrics_interval_s": 0.05}
        policy = basic_policy(tokenizer_dir, [url for _, url in served], pick=pick)
        gateway = await gateway_factory(policy)
        replicas = gateway.gateway.slots["main"].replicas
        await eventually(lambda: all(r.gauges is not None for r in replicas))
        posts = []
        for n in range(12):
            posts.append(http.post(f"{gateway.url}/v1/chat/completions",
                                   json=classify(RULE_SETS["A"], f"chair {n}")))  # fmt: skip
            await asyncio.sleep(0.01)
        for response in await asyncio.gather(*posts):
            assert response.status == 200
            response.release()
        # 2 above the other at most (0.25 x max_concurrency 8); unbounded it would have been the
        # cap, 8, and 4; least in flight, 6 and 6.
        assert [app[STATS].max_running for app in apps] == [7, 5]
    finally:
        for runner, _ in served:
            await runner.cleanup()


async def test_a_session_stays_on_its_replica_by_header_or_by_user(
    tokenizer_dir: Path,
    stub_factory: Callable[..., Awaitable[Stub]],
    gateway_factory: Callable[[dict[str, Any]], Awaitable[RunningGateway]],
    http: aiohttp.ClientSession,
) -> None:
    stubs = [await stub_factory(delay_s=0.2) for _ in range(3)]
    policy = basic_policy(tokenizer_dir, [s.url for s in stubs], pick={"scorers": {"session": 1}})
    gateway = await gateway_factory(policy)
    for turn in range(4):
        posts = []
        for session in ("s1", "s2", "s3"):
            # A conversation whose first message changes every turn: no prefix to go by.
            body = {"model": "tiny", "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"turn {turn} of {session}"}]}  # fmt: skip
            if session == "s3":
                body["user"] = session
                posts.append(http.post(f"{gateway.url}/v1/chat/completions", json=body))
            else:
                headers = {"x-session-id": session}
                posts.append(http.post(f"{gateway.url}/v1/chat/completions", json=body,
                                       headers=headers))  # fmt: skip
            await asyncio.sleep(0.01)
        for response in await asyncio.gather(*posts):
            assert response.status == 200
            response.release()
    for session in ("s1", "s2", "s3"):
        assert len(replicas_that_served(stubs, f"of {session}")) == 1, session


GAUGES = web.AppKey("gauges", dict[str, float])


def engine_metrics(app: web.Application) -> web.Application:
    """A stub replica with a /metrics of vLLM's gauges, as the test sets them."""

    async def metrics(request: web.Request) -> web.Response:
        g = app[GAUGES]
        return web.Response(text=(
            f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {g["running"]}\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {g["waiting"]}\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {g["kv"]}\n'
            f'vllm:prompt_tokens_total{{engine="0",model_name="tiny"}} {g["prompt"]}\n'
        ))  # fmt: skip

    app[GAUGES] = {"running": 0, "waiting": 0, "kv": 0.0, "prompt": 1000.0}
    app.router.add_get("/metrics", metrics)
    return app


async def test_queue_and_kv_scorers_read_the_replicas_gauges_and_a_restart_forgets_prefixes(
    tokenizer_dir: Path,
    gateway_factory: Callable[[dict[str, Any]], Awaitable[RunningGateway]],
    http: aiohttp.ClientSession,
) -> None:
    apps = [engine_metrics(create_stub_app(StubConfig())) for _ in range(2)]
    served = [await _serve(app) for app in apps]
    try:
        urls = [url for _, url in served]
        apps[0][GAUGES].update(waiting=12, kv=0.95)  # a backlog behind other gateways
        pick = {"scorers": {"prefix": 1, "queue": 2, "kv_cache": 2}, "metrics_interval_s": 0.05}
        gateway = await gateway_factory(basic_policy(tokenizer_dir, urls, pick=pick))
        replicas = gateway.gateway.slots["main"].replicas
        await eventually(lambda: all(r.gauges is not None for r in replicas))
        for n in range(3):
            response = await http.post(f"{gateway.url}/v1/chat/completions",
                                       json=classify(RULE_SETS["B"], str(n)))  # fmt: skip
            assert response.status == 200
        assert [r.url for r in replicas if r.gauges and r.gauges.waiting] == [urls[0]]
        prefix = gateway.gateway.slots["main"].picker.prefix
        assert prefix.index.size(urls[0]) == 0 and prefix.index.size(urls[1]) > 0
        apps[1][GAUGES]["prompt"] = 10.0  # its counters fell: it restarted, cache empty
        await eventually(lambda: prefix.index.size(urls[1]) == 0)
    finally:
        for runner, _ in served:
            await runner.cleanup()


def replica(url: str, inflight: int = 0, gauges: EngineGauges | None = None) -> Replica:
    r = Replica(url, 8, None)
    r.inflight = inflight
    r.gauges = gauges
    return r


def test_a_gauge_counts_less_as_it_ages_and_not_at_all_past_max_age() -> None:
    queue = QueueScorer(QueueScorer.Params(max_age_s=10.0))
    kv = KvCacheScorer(KvCacheScorer.Params(max_age_s=10.0))
    busy = EngineGauges(running=8, waiting=8, kv_usage=0.9, prompt_tokens=None, at=100.0)
    idle = EngineGauges(running=0, waiting=0, kv_usage=0.1, prompt_tokens=None, at=100.0)
    pair = [replica("http://a", gauges=busy), replica("http://b", gauges=idle)]
    claim = Claim(10, affinity=Affinity())
    assert queue.score(pair, claim, now=100.0) == [0.0, 1.0]
    assert kv.score(pair, claim, now=100.0) == pytest.approx([0.1, 0.9])
    fresh_gap = kv.score(pair, claim, now=100.0)
    aged = kv.score(pair, claim, now=105.0)
    assert 0 < aged[1] - aged[0] < fresh_gap[1] - fresh_gap[0]
    assert queue.score(pair, claim, now=111.0) == [1.0, 1.0]  # stale: only in-flight counts
    assert kv.score(pair, claim, now=111.0) == [0.5, 0.5]


async def test_a_reload_keeps_what_the_scorers_learned_and_a_replica_that_leaves_is_forgotten(
    tokenizer_dir: Path,
    tmp_path: Path,
    stub_factory: Callable[..., Awaitable[Stub]],
    gateway_factory: Callable[[dict[str, Any]], Awaitable[RunningGateway]],
    http: aiohttp.ClientSession,
) -> None:
    stubs = [await stub_factory() for _ in range(2)]
    policy = basic_policy(tokenizer_dir, [s.url for s in stubs], pick={"scorers": {"prefix": 1}})
    gw = await gateway_factory(policy)
    response = await http.post(f"{gw.url}/v1/chat/completions", json=classify(RULE_SETS["C"], "x"))
    assert response.status == 200
    picker = gw.gateway.slots["main"].picker
    (sent,) = [s.url for s in stubs if s.stats.requests]
    assert picker.prefix.index.size(sent) > 0

    policy["pools"]["main"]["max_concurrency"] = 4  # `pick` unchanged: the same picker
    write_policy(tmp_path, policy)
    await gw.gateway.reload()
    assert gw.gateway.slots["main"].picker is picker and picker.prefix.index.size(sent) > 0

    policy["pools"]["main"]["replicas"] = [s.url for s in stubs if s.url != sent]
    write_policy(tmp_path, policy)
    await gw.gateway.reload()
    assert picker.prefix.index.size(sent) == 0


def test_a_policy_names_unknown_scorers_and_bad_parameters(tmp_path: Path) -> None:
    policy = basic_policy("estimate", ["http://127.0.0.1:1"], pick={"scorers": {"prefixx": 1}})
    with pytest.raises(PolicyError, match=r"pools\.main\.pick\.scorers\.prefixx"):
        load_policy(write_policy(tmp_path, policy))
    policy["pools"]["main"]["pick"] = {"scorers": {"prefix": {"weight": 2, "block_char": 64}}}
    with pytest.raises(PolicyError, match=r"pools\.main\.pick\.scorers: prefix: block_char"):
        load_policy(write_policy(tmp_path, policy))
    policy["pools"]["main"]["pick"] = {"scorers": {"prefix": 2, "queue": {"max_age_s": 3}}}
    picker = load_policy(write_policy(tmp_path, policy)).pickers["main"]
    assert [weight for weight, _ in picker.scorers] == [2.0, 1.0]


async def test_round_robin_takes_turns_among_the_replicas_with_room() -> None:
    slots = LivePool(
        "p",
        PoolSpec(model="m", replicas=["http://a", "http://b", "http://c"], max_concurrency=1),
        RoundRobinPicker(None),
    )
    first = await slots.acquire(Claim(1))
    second = await slots.acquire(Claim(1))
    slots.release(first)
    third = await slots.acquire(Claim(1))
    assert [first.replica.url, second.replica.url, third.replica.url] == [
        "http://a", "http://b", "http://c"
    ]  # fmt: skip
    fourth = await slots.acquire(Claim(1))  # a's turn again, and it is free
    assert fourth.replica.url == "http://a"


@pytest.fixture
def sim_profile(tmp_path: Path) -> Profile:
    return write_profile(tmp_path, serving={"block_size": 16, "max_model_len": 2048})


async def prefix_hits_through(
    profile: Profile,
    tokenizer_dir: Path,
    gateway_factory: Callable[[dict[str, Any]], Awaitable[RunningGateway]],
    http: aiohttp.ClientSession,
    **pool: Any,
) -> float:
    """Prefix-cache hits (vLLM's counter) on two simulated replicas after six rounds of the
    four rule sets through a gateway with `pool`'s settings."""
    replicas = [await start_replica(profile, ReplicaOptions(time_scale=1)) for _ in range(2)]
    try:
        policy = basic_policy(tokenizer_dir, [r.url for r in replicas], **pool)
        policy["models"]["tiny"]["tokenizer"] = "estimate"  # the simulator's count, 4 a token
        gateway = await gateway_factory(policy)
        await rounds_of_rule_sets(http, gateway, rounds=6, sets="AB", max_tokens=40)
        return sum(r.engine.stats.prefix_cache_hits for r in replicas)
    finally:
        for r in replicas:
            await r.close()


async def test_the_prefix_scorer_makes_the_replicas_prefix_caches_hit(
    sim_profile: Profile,
    tokenizer_dir: Path,
    gateway_factory: Callable[[dict[str, Any]], Awaitable[RunningGateway]],
    http: aiohttp.ClientSession,
) -> None:
    """Two rule sets, each round both at once in a new order: least in flight sends each set to
    whichever replica is free first, so the sets trade replicas and miss; with the prefix
    scorer each set stays where its blocks are, and every request after the first hits. (With
    caches this large least in flight soon has both sets everywhere: docs/capacity.md measures
    a working set larger than one replica's cache.)"""
    args = (tokenizer_dir, gateway_factory, http)
    scattered = await prefix_hits_through(sim_profile, *args)
    kept = await prefix_hits_through(sim_profile, *args, pick={"scorers": {"prefix": 1}})
    # What two requests of a set share: 4 marker tokens, then the rules and "\nProduct: lamp "
    # at 4 characters a token, in whole 16-token blocks.
    shared = (4 + (len(RULE_SETS["A"]) + len("\nProduct: lamp ")) // 4) // 16 * 16
    assert kept == (12 - 2) * shared  # every request but each set's first hit all of it
    assert scattered < kept
