"""SLO signals: whether a request with a latency objective met it (`llm_slo_requests_total`), the
headroom predicted at its grant (`llm_slo_predicted_headroom`), the objective and prediction in
its response headers and access-log line.

A real gateway on loopback in front of a simulated vLLM replica (real latencies, at time scale
1) or a stub one (whose `gate` holds a slot). The objectives are the pool's per tier and the
client's headers (gateway/request/objective.py); the predictions the pool's latency model's
(gateway/admit/latency.py). Objectives of a minute are met, and of a microsecond missed, by any
answer these tests get, however busy the machine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.context.ctx import Ctx
from gateway.context.objective import Objective
from gateway.errors import Refusal
from gateway.request.attainment import outcomes
from loadtest.sim import Profile, ReplicaOptions, start_replica
from tests.conftest import accounted, basic_policy, eventually
from tests.loadtest.test_simulator import write_profile
from tests.promises.test_hostile_upstream import scrape

GENEROUS = {"ttft_ms": 60_000, "tpot_ms": 60_000}
IMPOSSIBLE = {"ttft_ms": 0.001, "tpot_ms": 0.001}  # a microsecond
SLO = {
    "objectives": {"standard": GENEROUS, "critical": IMPOSSIBLE, "sheddable": {"ttft_ms": 60_000}}
}
SHEDDABLE = {"x-priority": "sheddable"}
CRITICAL = {"x-priority": "critical"}


@pytest.fixture
async def sim(tmp_path: Path, tokenizer_dir: Path) -> AsyncIterator[Any]:
    profile: Profile = write_profile(tmp_path)
    replica = await start_replica(profile, ReplicaOptions(1, tokenizer_dir))
    yield replica
    await replica.close()


def chat(**extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "review this listing"}]}
    return {**body, "max_tokens": 8, "ignore_eos": True, "stream": True, **extra}


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


async def test_met_missed_and_refused_are_counted_per_tier_and_objective(
    sim, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [sim.url], slo=SLO))
    await streamed(http, gw)
    await streamed(http, gw)
    await streamed(http, gw, CRITICAL)  # predicted to miss: placed all the same, and misses
    # No replica would serve a sheddable request in a microsecond: refused at once.
    async with http.post(
        f"{gw.url}/v1/chat/completions",
        json=chat(),
        headers={**SHEDDABLE, "x-slo-ttft-ms": "0.001"},
    ) as resp:
        assert resp.status == 429 and (await resp.json())["error"]["code"] == "slo_unreachable"
    await accounted(gw, 3)
    found = await scrape(http, gw)
    assert attained(found) == {
        ("main", "standard", "ttft", "met"): 2.0,
        ("main", "standard", "tpot", "met"): 2.0,
        ("main", "critical", "ttft", "missed"): 1.0,
        ("main", "critical", "tpot", "missed"): 1.0,
        ("main", "sheddable", "ttft", "refused"): 1.0,  # its tier states no TPOT objective
    }
    # The headroom predicted at each grant (the refused request had none): a minute's is near 1,
    # a microsecond's far below 0. Negative buckets: no `_count` (OpenMetrics has none with
    # them), the `+Inf` bucket counts.
    buckets = {
        (s.labels["objective"], s.labels["le"]): s.value
        for s in found["llm_slo_predicted_headroom_bucket"]
    }
    for objective in ("ttft", "tpot"):
        assert [buckets[objective, le] for le in ("-2.0", "0.0", "0.9", "+Inf")] == [1, 1, 1, 3]


async def test_the_response_says_the_objective_and_the_prediction(
    sim, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [sim.url], slo=SLO))
    standard = await streamed(http, gw)
    assert standard["x-gateway-slo-ttft-ms"] == "60000"
    assert standard["x-gateway-slo-tpot-ms"] == "60000"
    assert float(standard["x-gateway-predicted-ttft-ms"]) > 0
    assert float(standard["x-gateway-predicted-tpot-ms"]) > 0
    assert standard["x-gateway-slo"] == "met"
    critical = await streamed(http, gw, CRITICAL)
    assert critical["x-gateway-slo-ttft-ms"] == "0"  # 1 us, in tenths of a millisecond
    assert critical["x-gateway-slo"] == "at-risk"
    sheddable = await streamed(http, gw, SHEDDABLE)  # a TTFT objective only
    assert sheddable["x-gateway-slo-ttft-ms"] == "60000"
    assert "x-gateway-slo-tpot-ms" not in sheddable
    assert sheddable["x-gateway-slo"] == "met"
    await accounted(gw, 2)
    logged = access(gw)
    assert [(x["slo_ttft_s"], x["slo_tpot_s"]) for x in logged] == [
        (60.0, 60.0), (1e-06, 1e-06), (60.0, None)
    ]  # fmt: skip
    for line, headers in zip(logged, (standard, critical, sheddable), strict=True):
        # From arrival: the wait for the slot, then the model's TTFT from the grant.
        assert line["predicted_ttft_s"] > line["queue_wait_s"]
        ms = float(headers["x-gateway-predicted-ttft-ms"])
        # The header rounds to 0.1 ms, the log to 1 us: at most half of each apart.
        assert abs(1000 * line["predicted_ttft_s"] - ms) <= 0.05 + 0.0005 + 1e-9
        assert line["predicted_tpot_s"] > 0


async def test_a_pool_without_slo_has_no_slo_series_headers_or_fields(
    sim, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [sim.url]))
    headers = await streamed(http, gw, {"x-slo-ttft-ms": "100"})
    await accounted(gw, 0)
    assert not [name for name in headers if name.lower().startswith("x-gateway-slo")]
    assert not [name for name in headers if name.lower().startswith("x-gateway-predicted")]
    found = await scrape(http, gw)
    assert "llm_slo_requests_total" not in found
    assert "llm_slo_predicted_headroom_bucket" not in found
    assert not [key for key in access(gw)[0] if "slo" in key or "predicted" in key]


async def test_a_refused_request_is_counted_refused_and_one_that_left_early_not_at_all(
    stub_factory, gateway_factory, tokenizer_dir, http
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
    assert attained(await scrape(http, gw)) == {
        ("main", "standard", "ttft", "refused"): 1.0,
        ("main", "standard", "tpot", "refused"): 1.0,
    }


def test_a_stream_preempted_after_its_first_token_is_refused_not_met() -> None:
    """Cancelled in flight for a critical request (`slo.preempt`): its stream began with a 200
    and ends with the refusal, a want of room like any other, whatever its first token did."""
    ctx = Ctx("r", None, "/v1/chat/completions", None, arrived=0.0)  # type: ignore[arg-type]
    ctx.stream, ctx.status, ctx.first_token, ctx.output_tokens, ctx.ended = True, 200, 0.1, 5, 0.2
    objective = Objective(1.0, 1.0, 1.0)
    assert list(outcomes(ctx, objective)) == [("ttft", "met"), ("tpot", "met")]
    ctx.refusal = Refusal.PREEMPTED
    assert list(outcomes(ctx, objective)) == [("ttft", "refused"), ("tpot", "refused")]
    ctx.refusal = Refusal.UPSTREAM_TIMEOUT  # the replica's failure: what was observed counts
    assert list(outcomes(ctx, objective)) == [("ttft", "met"), ("tpot", "met")]
