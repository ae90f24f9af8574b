"""What the load generator asks of an SLO-admitting gateway and what it keeps of the answers:
the tier and objectives as headers (over the time scale), the gateway's predictions and a
refusal's error code in the record. A replica on loopback plays the gateway's part."""

from __future__ import annotations

import argparse
import random
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from loadtest.autoscale.cli import slos as autoscale_slos
from loadtest.autoscale.loop import wall_slo
from loadtest.autoscale.trace import load_trace
from loadtest.loadgen.compare import SLO, parse_slo
from loadtest.loadgen.progress import Progress
from loadtest.loadgen.prompts import PromptBuilder
from loadtest.loadgen.runner import run_level
from loadtest.loadgen.sweep import session
from loadtest.loadgen.workloads import BUILTIN, Workload, load_workload, plan

QUIET = Progress(live=False)


def _chunk(data: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


@pytest.fixture
async def gateway_part() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """Answers a sheddable request with a 429 in the gateway's error shape, a critical one with
    a prediction header that is no number, the rest streamed with both predictions."""
    seen: list[dict[str, str]] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        seen.append(dict(request.headers))
        tier = request.headers.get("x-priority")
        if tier == "sheddable":
            error = {"message": "predicted TTFT 900 ms", "type": "rate_limit_exceeded"}
            body = {"error": {**error, "param": None, "code": "slo_unreachable"}}
            return web.json_response(body, status=429)
        predicted = "nan" if tier == "critical" else "150"
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "x-gateway-predicted-ttft-ms": predicted,
                "x-gateway-predicted-tpot-ms": "12.5",
            }
        )
        await response.prepare(request)
        await response.write(_chunk({"choices": [{"delta": {"content": "a"}}]}))
        await response.write(_chunk({"choices": [{"delta": {"content": "b"}}]}))
        usage = {"prompt_tokens": 10, "completion_tokens": 2}
        await response.write(_chunk({"choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    await runner.cleanup()


async def test_tiers_and_objectives_go_out_and_predictions_and_codes_come_back(
    gateway_part: tuple[str, list[dict[str, str]]],
) -> None:
    url, seen = gateway_part
    workload = load_workload("slo-mixed")
    planned = plan(workload, 24, random.Random(3))
    bodies = PromptBuilder().bodies("tiny", planned, stream=True)
    async with session(10) as http:
        run = await run_level(http, url, planned, bodies, 4, 10, True, QUIET, time_scale=10)

    assert len(seen) == len(planned) == len(run.records)
    for headers in seen:  # simulated ms over the time scale: what the gateway's wall clock reads
        assert headers["x-priority"] in ("critical", "standard", "sheddable")
        assert headers["x-slo-ttft-ms"] in ("150", "200")
    assert {h.get("x-slo-tpot-ms") for h in seen} == {None, "5"}  # classification asks none
    for rec in run.records:
        assert rec.priority is not None
        if rec.priority == "sheddable":
            assert (rec.status, rec.code, rec.predicted_ttft_s) == (429, "slo_unreachable", None)
        elif rec.priority == "critical":  # "nan" is not a prediction: the answer is hostile input
            assert rec.ok and rec.predicted_ttft_s is None and rec.predicted_tpot_s == 0.0125
        else:
            assert rec.ok and (rec.predicted_ttft_s, rec.predicted_tpot_s) == (0.15, 0.0125)
            assert rec.code is None
        assert rec.row()["priority"] == rec.priority
    assert {r.priority for r in run.records} == {"critical", "standard", "sheddable"}


def test_a_workload_without_tiers_plans_and_sends_as_before() -> None:
    mixed: Workload = BUILTIN["mixed"]
    planned = plan(mixed, 50, random.Random(1))
    assert all(p.priority is None and p.slo is None for p in planned)
    # The draws for tiers are only made for classes that have several: the plan is unchanged.
    again = plan(mixed.model_copy(update={"name": "other"}), 50, random.Random(1))
    assert [(p.cls, p.isl) for p in planned] == [(p.cls, p.isl) for p in again]


def test_a_tier_names_one_or_weights_several_and_unknown_ones_are_refused() -> None:
    one = Workload.model_validate(
        {"name": "w", "classes": [{"name": "c", "isl": 10, "osl": 2, "priority": "critical"}]}
    )
    assert one.classes[0].priority == {"critical": 1.0}
    with pytest.raises(ValueError, match="urgent"):
        Workload.model_validate(
            {"name": "w", "classes": [{"name": "c", "isl": 10, "osl": 2, "priority": "urgent"}]}
        )
    with pytest.raises(ValueError, match="ttft_ms, tpot_ms or both"):
        Workload.model_validate(
            {"name": "w", "classes": [{"name": "c", "isl": 10, "osl": 2, "slo": {}}]}
        )


def test_a_pool_slo_in_simulated_time_is_written_in_wall_time() -> None:
    slo = {
        "objectives": {"standard": {"ttft_ms": 2000, "tpot_ms": 50}},
        "model": {"ttft_base_ms": 20.0, "ttft_per_1k_prefill_ms": 30.0, "forgetting": 0.99},
        "adaptive": {"target": {"ttft_ms": 1500}, "interval_s": 5.0, "min_samples": 8},
        "preempt": {"enabled": False, "max_per_s": 1.0},
    }
    wall = wall_slo(slo, 10)
    assert wall["objectives"] == {"standard": {"ttft_ms": 200, "tpot_ms": 5}}
    assert wall["model"] == {"ttft_base_ms": 2.0, "ttft_per_1k_prefill_ms": 3.0, "forgetting": 0.99}
    assert wall["adaptive"] == {"target": {"ttft_ms": 150}, "interval_s": 0.5, "min_samples": 8}
    assert wall["preempt"] == {"enabled": False, "max_per_s": 10.0}  # a rate: times K
    assert slo["objectives"]["standard"]["ttft_ms"] == 2000  # the input is not changed


def test_bursts_repeat_from_their_start() -> None:
    trace = load_trace("bursts:base=1,peak=4,start=10,every=30,length=5,duration=70", "w")
    rates = {t: trace.rate(t) for t in (0, 9, 10, 14, 16, 40, 44, 46, 70, 71)}
    assert rates == {0: 1, 9: 1, 10: 4, 14: 4, 16: 1, 40: 4, 44: 4, 46: 1, 70: 1, 71: 0}
    with pytest.raises(ValueError, match="length <= every"):
        load_trace("bursts:every=10,length=20", "w")


def test_the_autoscaling_report_holds_a_workload_to_its_own_objectives() -> None:
    args = argparse.Namespace(slo=[parse_slo("generation:tpot=0.03")], slo_e2e_s=None)
    held = autoscale_slos(args, ["classification", "generation"], ["slo-mixed"])
    assert held["classification"] == SLO(ttft_s=1.5)  # not the default E2E 2 s
    assert held["generation"] == SLO(tpot_s=0.03)  # --slo still has the last word
