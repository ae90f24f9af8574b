"""Admission by latency objective: a pool with `slo` learns each replica's latency from the
streams it serves, places a request where it is predicted to meet its objective, refuses at once
a sheddable request no replica would serve in time, and takes objectives from the client's
headers (ours and llm-d's) over the policy's defaults by tenant, class and tier."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import aiohttp
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.api import BY_NAME
from gateway.context.ctx import Ctx
from gateway.errors import BadRequest
from gateway.policy.compile import load_policy
from gateway.request.objective import set_objective
from tests.conftest import basic_policy, eventually, write_policy
from tests.request.test_tenants import hashed

STREAM = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "classify this"}],
    "max_tokens": 4,
    "stream": True,
}


async def post(
    http: aiohttp.ClientSession, url: str, **headers: str
) -> tuple[int, bytes, CIMultiDictProxy[str]]:
    async with http.post(f"{url}/v1/chat/completions", json=STREAM, headers=headers) as resp:
        return resp.status, await resp.read(), resp.headers


async def warm(http: aiohttp.ClientSession, url: str, rounds: int, at_once: int) -> None:
    """Streams without objectives, `at_once` together so each replica serves its share: what
    the latency model learns from."""
    for _ in range(rounds):
        results = await asyncio.gather(*(post(http, url) for _ in range(at_once)))
        assert [status for status, _, _ in results] == [200] * at_once


def slo_policy(tokenizer_dir: Path, replicas: list[str], **slo: object) -> dict:
    return basic_policy(tokenizer_dir, replicas, slo=slo)


async def test_a_request_goes_to_the_replica_predicted_to_meet_its_objective(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow, fast = await stub_factory(delay_s=0.3), await stub_factory()
    gw = await gateway_factory(slo_policy(tokenizer_dir, [slow.url, fast.url]))
    await warm(http, gw.url, rounds=20, at_once=2)
    before = slow.stats.requests
    for _ in range(5):  # alone, the least-loaded picker would take the first: the slow one
        status, _, _ = await post(http, gw.url, **{"x-slo-ttft-ms": "150"})
        assert status == 200
    assert slow.stats.requests == before
    assert gw.inflight() == 0 and gw.waiting() == 0


@pytest.mark.parametrize("header", ["x-slo-ttft-ms", "x-llm-d-slo-ttft-ms"])
async def test_a_sheddable_request_no_replica_would_serve_in_time_is_refused_at_once(
    stub_factory, gateway_factory, tokenizer_dir, http, header
) -> None:
    slow = await stub_factory(delay_s=0.2)
    gw = await gateway_factory(slo_policy(tokenizer_dir, [slow.url]))
    await warm(http, gw.url, rounds=20, at_once=1)
    served = slow.stats.requests
    started = time.perf_counter()
    status, body, headers = await post(http, gw.url, **{header: "50", "x-priority": "sheddable"})
    assert status == 429 and b'"slo_unreachable"' in body and b"TTFT" in body
    assert time.perf_counter() - started < 0.2  # refused, not served late
    assert int(headers["Retry-After"]) >= 1
    assert slow.stats.requests == served  # it never reached the replica
    # A standard request with the same objective is served, late: only sheddable work is shed.
    status, _, _ = await post(http, gw.url, **{header: "50", "x-priority": "standard"})
    assert status == 200
    assert gw.inflight() == 0 and gw.waiting() == 0


async def test_a_queued_sheddable_request_whose_objective_passed_is_refused_at_its_turn(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    gate = asyncio.Event()
    stub = await stub_factory(gate=gate)
    gw = await gateway_factory(
        basic_policy(
            tokenizer_dir, [stub.url], max_concurrency=1, queue={"fail_fast": False}, slo={}
        )
    )
    holding = asyncio.create_task(post(http, gw.url))
    await eventually(lambda: gw.inflight() == 1)
    queued = asyncio.create_task(
        post(http, gw.url, **{"x-slo-ttft-ms": "100", "x-priority": "sheddable"})
    )
    await eventually(lambda: gw.waiting() == 1)
    await asyncio.sleep(0.15)  # past its deadline while it waits
    gate.set()
    status, body, _ = await queued
    assert status == 429 and b'"slo_unreachable"' in body
    assert (await holding)[0] == 200
    assert stub.stats.requests == 1
    await eventually(lambda: gw.inflight() == 0 and gw.waiting() == 0)


async def test_slo_headers_are_checked_and_never_sent_upstream(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    stub = await stub_factory()
    gw = await gateway_factory(slo_policy(tokenizer_dir, [stub.url]))
    for bad in ("0", "-5", "soon", "nan", "1e9"):
        status, body, _ = await post(http, gw.url, **{"x-slo-ttft-ms": bad})
        assert status == 400 and b'"invalid_slo"' in body, bad
    status, _, _ = await post(
        http, gw.url, **{"x-slo-ttft-ms": "5000", "x-llm-d-slo-tpot-ms": "200"}
    )
    assert status == 200
    sent = {name.lower() for name in stub.stats.headers[-1]}
    assert not sent & {"x-slo-ttft-ms", "x-llm-d-slo-tpot-ms"}
    assert stub.stats.requests == 1  # the refused ones cost the replica nothing


@pytest.mark.parametrize("header", ["x-slo-ttft-ms", "x-slo-tpot-ms"])
async def test_an_objective_no_prediction_can_be_measured_against_still_places_the_request(
    stub_factory, gateway_factory, tokenizer_dir, http, header
) -> None:
    """`1e-320` ms is over 0, so a valid header; against it every replica's headroom is -inf
    (a margin over a denormal objective overflows). Placement took only a replica whose
    headroom was over -inf: none, so the request waited for room it had, at the head of its
    tier, and every request of the pool queued behind it until its `max_wait_s` ran out (the
    adversary's draw). A standard request is placed on the replica that misses by least;
    a sheddable one is refused as unreachable."""
    stub = await stub_factory()
    gw = await gateway_factory(
        basic_policy(tokenizer_dir, [stub.url], queue={"max_wait_s": 1}, slo={})
    )
    hostile = asyncio.create_task(post(http, gw.url, **{header: "1e-320"}))
    behind = asyncio.create_task(post(http, gw.url))
    assert (await hostile)[0] == 200 and (await behind)[0] == 200
    status, body, _ = await post(http, gw.url, **{header: "1e-320", "x-priority": "sheddable"})
    assert status == 429 and b'"slo_unreachable"' in body
    assert gw.inflight() == 0 and gw.waiting() == 0


async def test_a_pool_without_slo_ignores_the_headers(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    stub = await stub_factory()
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    status, _, _ = await post(http, gw.url, **{"x-slo-ttft-ms": "soon"})
    assert status == 200
    assert "x-slo-ttft-ms" not in {name.lower() for name in stub.stats.headers[-1]}


@pytest.fixture
def objectives_policy(tmp_path: Path, tokenizer_dir: Path):
    policy = basic_policy(
        tokenizer_dir,
        ["http://127.0.0.1:9"],
        slo={
            "objectives": {
                "critical": {"ttft_ms": 500, "tpot_ms": 50},
                "standard": {"ttft_ms": 2000, "tpot_ms": 100},
            }
        },
    )
    policy["classes"] = [
        {"name": "classify", "when": {"output_tokens": {"lte": 16}}, "slo": {"ttft_ms": 800}},
        {"name": "any", "when": {}},
    ]
    policy["tenants"] = {
        "gold": {"keys": ["sha256:" + "0" * 64], "tier": "critical", "slo": {"tpot_ms": 30}},
        "plain": {"keys": ["sha256:" + "1" * 64]},
    }
    compiled = load_policy(write_policy(tmp_path, policy))
    yield compiled
    compiled.close()


def objective_of(policy, tenant: str | None, workload: str, priority: int, **headers: str):
    ctx = Ctx(
        request_id="r",
        api=BY_NAME["chat"],
        path="/v1/chat/completions",
        headers=CIMultiDictProxy(CIMultiDict(headers)),
        arrived=100.0,
    )
    ctx.pool = policy.pools["main"]
    by_name = {t.name: t for t in policy.tenants.values()}
    ctx.tenant = by_name[tenant] if tenant else None
    ctx.workload, ctx.priority = workload, priority
    set_objective(ctx)
    return None if ctx.objective is None else (ctx.objective.ttft_s, ctx.objective.tpot_s)


def test_each_objective_is_the_first_stated_of_header_tenant_class_and_tier(
    objectives_policy,
) -> None:
    p = objectives_policy
    assert objective_of(p, "plain", "any", 1) == (2.0, 0.1)  # the tier's
    assert objective_of(p, "plain", "classify", 1) == (0.8, 0.1)  # the class's TTFT
    assert objective_of(p, "gold", "classify", 0) == (0.8, 0.03)  # the tenant's TPOT
    assert objective_of(p, "gold", "any", 0, **{"x-llm-d-slo-ttft-ms": "250"}) == (0.25, 0.03)
    assert objective_of(p, "plain", "any", 2) is None  # sheddable: no default, none stated
    assert objective_of(p, "plain", "any", 2, **{"x-slo-tpot-ms": "40"}) == (math.inf, 0.04)


def test_a_deadline_is_the_arrival_plus_the_ttft_objective(objectives_policy) -> None:
    ctx = Ctx(
        request_id="r",
        api=BY_NAME["chat"],
        path="/",
        headers=CIMultiDictProxy(CIMultiDict({"x-slo-ttft-ms": "x"})),
        arrived=100.0,
    )
    ctx.pool, ctx.priority = objectives_policy.pools["main"], 1
    with pytest.raises(BadRequest, match="x-slo-ttft-ms"):
        set_objective(ctx)
    ctx.headers = CIMultiDictProxy(CIMultiDict({"x-slo-ttft-ms": "300"}))
    set_objective(ctx)
    assert ctx.objective is not None and ctx.objective.deadline == pytest.approx(100.3)


async def held_then_queued(
    http, gw, stub, requests: list[tuple[str, dict[str, str]]], **holder: str
) -> list[str]:
    """One request holds the only slot while `requests` (content, headers) queue one by one;
    then the replica answers: the contents in the order the replica received them."""
    holding = asyncio.create_task(post(http, gw.url, **holder))
    await eventually(lambda: gw.inflight() == 1)
    tasks: list[asyncio.Task] = []
    for content, headers in requests:
        body = {**STREAM, "messages": [{"role": "user", "content": content}]}
        tasks.append(asyncio.create_task(http.post(
            f"{gw.url}/v1/chat/completions", json=body, headers=headers
        )))  # fmt: skip
        queued = len(tasks)
        await eventually(lambda: gw.waiting() == queued)  # noqa: B023 - awaited at once
    assert stub.config.gate is not None
    stub.config.gate.set()
    for response in await asyncio.gather(holding, *tasks):
        if isinstance(response, aiohttp.ClientResponse):
            assert response.status == 200
            await response.read()
    return [b["messages"][0]["content"] for b in stub.stats.bodies[1:]]


async def test_a_tier_waits_in_deadline_order(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    stub = await stub_factory(gate=asyncio.Event())
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url], max_concurrency=1, slo={}))
    standard = {"x-priority": "standard"}
    order = await held_then_queued(http, gw, stub, [
        ("none", standard),
        ("late", {**standard, "x-slo-ttft-ms": "60000"}),
        ("soon", {**standard, "x-slo-ttft-ms": "20000"}),
        ("critical-late", {"x-slo-ttft-ms": "90000", "x-priority": "critical"}),
        ("sooner", {**standard, "x-llm-d-slo-ttft-ms": "10000"}),
    ])  # fmt: skip
    # Tiers first; within one, the earliest deadline; a request without one last.
    assert order == ["critical-late", "sooner", "soon", "late", "none"]
    assert gw.inflight() == 0 and gw.waiting() == 0


async def test_deadlines_reorder_a_tenants_own_requests_not_another_tenants_share(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    stub = await stub_factory(gate=asyncio.Event())
    policy = basic_policy(tokenizer_dir, [stub.url], max_concurrency=1, slo={})
    policy["tenants"] = {name: {"keys": [hashed(f"sk-{name}")]} for name in ("urgent", "calm")}

    def as_(tenant: str, **headers: str) -> dict[str, str]:
        return {"Authorization": f"Bearer sk-{tenant}", **headers}

    gw = await gateway_factory(policy)
    order = await held_then_queued(http, gw, stub, [
        ("calm-1", as_("calm")),
        ("calm-2", as_("calm")),
        ("urgent-1", as_("urgent", **{"x-slo-ttft-ms": "30000"})),
        ("urgent-2", as_("urgent", **{"x-slo-ttft-ms": "20000"})),
        ("urgent-3", as_("urgent", **{"x-slo-ttft-ms": "10000"})),
    ], **as_("calm"))  # fmt: skip
    # Fair share alternates the tenants (calm queued first); the urgent tenant's deadlines
    # order its own turns, earliest first, and never take the calm tenant's.
    assert order == ["calm-1", "urgent-3", "calm-2", "urgent-2", "urgent-1"]
