"""SLO signals: whether a request with a latency objective met it (`llm_slo_requests_total`), the
headroom predicted at its grant (`llm_slo_predicted_headroom`), the objective and prediction in
its response headers and access-log line; the client's SLO headers never reach the replica.

A real gateway on loopback in front of a simulated vLLM replica (real latencies, at time scale
1) or a stub one (whose `gate` holds a slot, whose log keeps the headers it was sent).

`objectives` stands in for the objective stage and the latency model: it gives each request
its pool's objective for its tier after placement and a fixed prediction at its grant, as
gateway/request/objective.py and gateway/admit/latency.py will; what it sets is exactly the
`Ctx.objective` / `Ctx.predicted` those write, so the accounting and headers under test are
the same.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import gateway.pipeline
from gateway.config.schema import PRIORITIES
from gateway.context.objective import Objective, Prediction
from loadtest.sim import Profile, ReplicaOptions, start_replica
from tests.conftest import accounted, basic_policy, eventually
from tests.loadtest.test_simulator import write_profile

PREDICTED = Prediction(ttft_s=0.02, tpot_s=0.004)
GENEROUS = {"ttft_ms": 60_000, "tpot_ms": 60_000}  # met by any answer this test gets
IMPOSSIBLE = {"ttft_ms": 0.001, "tpot_ms": 0.001}  # a microsecond: missed by any answer
SLO = {"objectives": {"standard": GENEROUS, "sheddable": IMPOSSIBLE, "critical": {"ttft_ms": 250}}}


@pytest.fixture
def objectives(monkeypatch: pytest.MonkeyPatch) -> None:
    place, forward = gateway.pipeline.place, gateway.pipeline.forward

    async def placed(ctx: Any, *args: Any) -> None:
        await place(ctx, *args)
        slo = ctx.pool.spec.slo
        spec = slo.objectives.get(PRIORITIES[ctx.priority]) if slo is not None else None
        if spec is not None:
            ttft = spec.ttft_ms / 1000 if spec.ttft_ms else math.inf
            tpot = spec.tpot_ms / 1000 if spec.tpot_ms else math.inf
            ctx.objective = Objective(ttft, tpot, ctx.arrived + ttft)

    async def granted(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        if ctx.objective is not None:
            ctx.predicted = PREDICTED
        return await forward(ctx, *args, **kwargs)

    monkeypatch.setattr(gateway.pipeline, "place", placed)
    monkeypatch.setattr(gateway.pipeline, "forward", granted)


@pytest.fixture
async def sim(tmp_path: Path, tokenizer_dir: Path) -> AsyncIterator[Any]:
    profile: Profile = write_profile(tmp_path)
    replica = await start_replica(profile, ReplicaOptions(1, tokenizer_dir))
    yield replica
    await replica.close()


def chat(**extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "review this listing"}]}
    return {**body, "max_tokens": 8, "ignore_eos": True, "stream": True, **extra}


async def metrics(http: Any, gw: Any) -> dict[str, list[Any]]:
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def attained(found: dict[str, list[Any]]) -> dict[tuple[str, ...], float]:
    return {
        (s.labels["pool"], s.labels["tier"], s.labels["objective"], s.labels["outcome"]): s.value
        for s in found.get("llm_slo_requests_total", [])
    }


def access(gw: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def streamed(http: Any, gw: Any, headers: dict[str, str] | None = None) -> Any:
    async with http.post(
        f"{gw.url}/v1/chat/completions", json=chat(), headers=headers or {}
    ) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers


async def test_met_and_missed_are_counted_per_tier_and_objective(
    objectives, sim, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [sim.url], slo=SLO))
    await streamed(http, gw)
    await streamed(http, gw)
    await streamed(http, gw, {"x-priority": "sheddable"})
    await accounted(gw, 2)
    found = await metrics(http, gw)
    assert attained(found) == {
        ("main", "standard", "ttft", "met"): 2.0,
        ("main", "standard", "tpot", "met"): 2.0,
        ("main", "sheddable", "ttft", "missed"): 1.0,
        ("main", "sheddable", "tpot", "missed"): 1.0,
    }
    # The headroom predicted at each grant: 1 - 4 ms / 60 s for the standard TPOTs, a miss of
    # thousands of times the sheddable's microsecond. Negative buckets: no `_count` (OpenMetrics
    # has none with them), the `+Inf` bucket counts.
    buckets = {
        (s.labels["objective"], s.labels["le"]): s.value
        for s in found["llm_slo_predicted_headroom_bucket"]
    }
    assert {o: buckets[o, "+Inf"] for o in ("ttft", "tpot")} == {"ttft": 3.0, "tpot": 3.0}
    assert {o: buckets[o, "0.0"] for o in ("ttft", "tpot")} == {"ttft": 1.0, "tpot": 1.0}
    assert {o: buckets[o, "0.9"] for o in ("ttft", "tpot")} == {"ttft": 1.0, "tpot": 1.0}


async def test_the_response_says_the_objective_and_the_prediction(
    objectives, sim, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [sim.url], slo=SLO))
    standard = await streamed(http, gw)
    assert standard["x-gateway-slo-ttft-ms"] == "60000"
    assert standard["x-gateway-slo-tpot-ms"] == "60000"
    assert standard["x-gateway-predicted-tpot-ms"] == "4"
    # The TTFT predicted from arrival: the wait before the grant plus the model's 20 ms.
    assert float(standard["x-gateway-predicted-ttft-ms"]) >= 20
    assert standard["x-gateway-slo"] == "met"
    sheddable = await streamed(http, gw, {"x-priority": "sheddable"})
    assert sheddable["x-gateway-slo-ttft-ms"] == "0"  # 1 us, in tenths of a millisecond
    assert sheddable["x-gateway-slo"] == "at-risk"
    critical = await streamed(http, gw, {"x-priority": "critical"})  # a TTFT objective only
    assert critical["x-gateway-slo-ttft-ms"] == "250"
    assert "x-gateway-slo-tpot-ms" not in critical
    await accounted(gw, 2)
    logged = access(gw)
    assert [(x["slo_ttft_s"], x["slo_tpot_s"]) for x in logged] == [
        (60.0, 60.0), (1e-06, 1e-06), (0.25, None)
    ]  # fmt: skip
    for line in logged:
        assert line["predicted_tpot_s"] == 0.004
        assert line["predicted_ttft_s"] >= 0.02 + line["queue_wait_s"] - 1e-6


async def test_a_pool_without_slo_has_no_slo_series_headers_or_fields(
    objectives, sim, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [sim.url]))
    headers = await streamed(http, gw, {"x-slo-ttft-ms": "100"})
    await accounted(gw, 0)
    assert not [name for name in headers if name.lower().startswith("x-gateway-slo")]
    assert not [name for name in headers if name.lower().startswith("x-gateway-predicted")]
    found = await metrics(http, gw)
    assert "llm_slo_requests_total" not in found
    assert "llm_slo_predicted_headroom_bucket" not in found
    assert not [key for key in access(gw)[0] if "slo" in key or "predicted" in key]


async def test_a_refused_request_is_counted_refused_and_one_that_left_early_not_at_all(
    objectives, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    gate = asyncio.Event()
    stub = await stub_factory(gate=gate)
    policy = basic_policy(
        tokenizer_dir, [stub.url], max_concurrency=1, queue={"max_depth": 0}, slo=SLO
    )
    gw = await gateway_factory(policy)
    held = asyncio.create_task(streamed(http, gw))  # holds the one slot, then leaves
    await eventually(lambda: stub.stats.running == 1)
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 429 and (await resp.json())["error"]["code"] == "queue_full"
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    gate.set()
    await accounted(gw, 1)
    assert sorted(x["reason"] for x in access(gw)) == ["client_disconnect", "queue_full"]
    # The one that left did so long before its 60 s deadline: it says nothing of it.
    assert attained(await metrics(http, gw)) == {
        ("main", "standard", "ttft", "refused"): 1.0,
        ("main", "standard", "tpot", "refused"): 1.0,
    }


async def test_the_clients_slo_headers_are_not_sent_upstream(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url], slo=SLO))
    slo_headers = {
        "x-slo-ttft-ms": "100",
        "X-SLO-TPOT-MS": "10",
        "x-llm-d-slo-ttft-ms": "100",
        "x-llm-d-slo-tpot-ms": "10",
    }
    await streamed(http, gw, {**slo_headers, "x-kept": "yes"})
    (sent,) = stub.stats.headers
    assert sent["x-kept"] == "yes"
    assert not [name for name in sent if "slo" in name]
