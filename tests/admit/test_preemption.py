"""Preemption (`slo.preempt`, gateway/admit/preempt.py): off by default; a critical claim
cancels the newest sheddable request in flight on its replica, paced; the cancelled request's
client is told `preempted` (a 429 before its answer's head, an error event in its stream's own
shape after), is charged only what it was delivered, and its slot comes back.

Through the gateway: a simulated vLLM replica, the real `openai` and `anthropic` SDKs. A
request is held where the test wants it by the simulator's faults: before its head by a first
token delayed for ever, mid-stream by stalling the engine once its client has a token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest

from gateway.admit import Claim, LivePool
from gateway.admit.preempt import CRITICAL, SHEDDABLE, Preemption
from gateway.config.schema import PRIORITIES, PoolSpec, PreemptSpec
from gateway.pick.picker import LeastInflightPicker
from gateway.state import Limit, TenantWindow
from loadtest.sim import Faults, Replica, ReplicaOptions, start_replica
from tests.conftest import RunningGateway, accounted, eventually
from tests.loadtest.test_simulator import write_profile
from tests.request.test_quotas import ACME_KEY, quota_policy

STANDARD = PRIORITIES.index("standard")
TPM = 100_000
MAX_TOKENS = 400  # at the replica's pace, minutes of output: it is preempted long before
SHEDDABLE_HEADERS = {"x-priority": "sheddable"}
FOREVER = Faults(first_token_delay_s=1e9)  # held before its answer's head
STALL = Faults(stall_s=1e9)  # no token after the ones already sent
HANG_S = 30  # a preemption that ends nothing fails the test rather than hanging it


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def spec(preempt: dict[str, Any] | None = None) -> PoolSpec:
    slo = None if preempt is None else {"preempt": preempt}
    return PoolSpec(model="m", replicas=["http://127.0.0.1:9"], max_concurrency=8, slo=slo)


def pool(preempt: dict[str, Any] | None = None) -> LivePool:
    return LivePool("p", spec(preempt), LeastInflightPicker(None))


# --- the registry and its pace ---------------------------------------------------------------


def test_preemption_is_off_by_default() -> None:
    for slots in (pool(), pool({})):
        assert slots.preemption is None
        assert not slots.preempt(slots.replicas[0], Claim(1, CRITICAL))
    assert pool({"enabled": True}).preemption is not None


def test_the_victim_is_the_newest_sheddable_request_never_a_standard_or_critical_one() -> None:
    preemption = Preemption(PreemptSpec(enabled=True, burst=10))
    older = preemption.enter("a", 1.0, SHEDDABLE)
    preemption.enter("a", 2.0, CRITICAL)
    newer = preemption.enter("a", 3.0, SHEDDABLE)
    standard = preemption.enter("a", 4.0, STANDARD)
    elsewhere = preemption.enter("b", 5.0, SHEDDABLE)
    assert preemption.victim("a") is newer
    assert preemption.preempt("a") is newer and newer.cancel.cancelled
    assert preemption.victim("a") is older  # the cancelled one is no victim twice
    assert preemption.preempt("a") is older
    assert preemption.victim("a") is None and preemption.preempt("a") is None
    assert not standard.cancel.cancelled and not elsewhere.cancel.cancelled
    assert preemption.running("a") == 4


def test_only_a_critical_claim_preempts_and_each_preemption_is_counted() -> None:
    slots = pool({"enabled": True})
    assert slots.preemption is not None
    replica = slots.replicas[0]
    slots.preemption.enter(replica.url, 1.0, SHEDDABLE)
    assert not slots.preempt(replica, Claim(1, STANDARD))
    assert not slots.preempt(replica, Claim(1, SHEDDABLE))
    assert slots.preempt(replica, Claim(1, CRITICAL))
    assert not slots.preempt(replica, Claim(1, CRITICAL))  # no sheddable one left
    assert slots.preemptions == {"sheddable": 1}


def test_preemptions_are_paced_per_pool() -> None:
    """`burst` at once, then `max_per_s`: a victim in flight waits for the pace's next token."""
    slots = pool({"enabled": True, "max_per_s": 0.5, "burst": 2})
    assert slots.preemption is not None
    clock = slots.preemption.pace.clock = Clock()
    slots.preemption.pace.updated = clock.now
    replica, critical = slots.replicas[0], Claim(1, CRITICAL)
    for granted in range(5):
        slots.preemption.enter(replica.url, granted, SHEDDABLE)
    assert [slots.preempt(replica, critical) for _ in range(3)] == [True, True, False]
    clock.now += 1.0  # half a token
    assert not slots.preempt(replica, critical)
    clock.now += 1.0
    assert slots.preempt(replica, critical)
    assert not slots.preempt(replica, critical)
    assert slots.preemptions == {"sheddable": 3}


def test_a_reload_keeps_the_registry_of_the_requests_in_flight() -> None:
    slots = pool({"enabled": True, "burst": 1})
    preemption, url = slots.preemption, slots.replicas[0].url
    assert preemption is not None
    inflight = preemption.enter(url, 1.0, SHEDDABLE)
    slots.update(spec({"enabled": True, "burst": 3}), slots.picker)
    assert slots.preemption is preemption and preemption.pace.burst == 3
    assert preemption.victim(url) is inflight
    slots.update(spec({"enabled": False}), slots.picker)
    assert slots.preemption is None  # off; what it registered still leaves it as it ends
    preemption.leave(inflight)
    assert preemption.running(url) == 0


# --- through the gateway -----------------------------------------------------------------------


@pytest.fixture
async def sim(tmp_path: Path, tokenizer_dir: Path) -> AsyncIterator[Replica]:
    """A replica decoding a token every ~20 ms of wall time, counting prompts as vLLM does."""
    replica = await start_replica(
        write_profile(tmp_path), ReplicaOptions(time_scale=0.05, tokenizer=tokenizer_dir)
    )
    yield replica
    await replica.close()


@pytest.fixture
async def gw(sim: Replica, gateway_factory: Any, tokenizer_dir: Path) -> RunningGateway:
    policy = quota_policy(tokenizer_dir, [sim.url], tpm=TPM)
    policy["pools"]["main"]["slo"] = {"preempt": {"enabled": True}}
    return await gateway_factory(policy)


def _critical_preempts(gw: RunningGateway) -> bool:
    slots = gw.gateway.slots["main"]
    return slots.preempt(slots.replicas[0], Claim(1, CRITICAL))


async def _window_used(gw: RunningGateway) -> int:
    await eventually(lambda: gw.gateway.quotas.pending == 0)
    [window] = await gw.gateway.state.peek([Limit(TenantWindow("acme", "tokens"), 0, TPM)])
    return TPM - window.remaining


def _logged(gw: RunningGateway) -> dict[str, Any]:
    return orjson.loads(gw.access_log.getvalue().splitlines()[-1])


async def _nothing_left(gw: RunningGateway, sim: Replica) -> None:
    """The slot is back, the registry empty, and the replica stopped working on the request."""
    await accounted(gw, 0)
    assert gw.inflight() == 0 and gw.waiting() == 0
    preemption = gw.gateway.slots["main"].preemption
    assert preemption is not None and preemption.running(sim.url) == 0
    await eventually(lambda: sim.engine.num_running == 0 and not sim.engine.scheduler.waiting)


async def _preempted_count(gw: RunningGateway, http: Any) -> str:
    async with http.get(gw.metrics_url + "/metrics") as resp:
        text = await resp.text()
    return next(
        line.rsplit(" ", 1)[1]
        for line in text.splitlines()
        if line.startswith('llm_preemptions_total{pool="main",tier="sheddable"}')
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_preempted_before_its_head_the_client_gets_a_retryable_429_and_pays_nothing(
    gw: RunningGateway, sim: Replica, http: Any, stream: bool
) -> None:
    sim.set_faults(FOREVER)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=ACME_KEY, max_retries=0) as sdk:

        async def ask() -> Any:
            return await sdk.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "summarise the listing"}],
                max_tokens=MAX_TOKENS,
                stream=stream,
                extra_headers=SHEDDABLE_HEADERS,
            )

        asking = asyncio.create_task(ask())
        await eventually(lambda: sim.engine.stats.faults.get("first_token_delay") == 1)
        assert _critical_preempts(gw)
        with pytest.raises(openai.RateLimitError) as refused:
            async with asyncio.timeout(HANG_S):
                await asking
    assert refused.value.code == "preempted"
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.response.headers["x-should-retry"] == "true"
    await _nothing_left(gw, sim)
    line = _logged(gw)
    assert line["status"] == 429 and line["reason"] == "preempted"
    assert await _window_used(gw) == 0  # nothing delivered, nothing charged
    assert await _preempted_count(gw, http) == "1.0"


async def test_a_preempted_openai_stream_ends_with_a_preempted_error_event(
    gw: RunningGateway, sim: Replica
) -> None:
    """The SDK raises the stream's error event with its code; the tenant pays the prompt and
    the tokens it got (the running count the gateway asked for), not its reservation."""
    received = 0
    async with (
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=ACME_KEY, max_retries=0) as sdk,
        asyncio.timeout(HANG_S),
    ):
        stream = await sdk.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "summarise the listing"}],
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_headers=SHEDDABLE_HEADERS,
        )
        with pytest.raises(openai.APIError) as ended:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    received += 1
                    if received == 1:
                        sim.set_faults(STALL)
                        assert _critical_preempts(gw)
    assert not isinstance(ended.value, openai.APIStatusError)  # an event, not a status
    assert ended.value.code == "preempted" and "critical" in ended.value.message
    await _nothing_left(gw, sim)
    line = _logged(gw)
    assert line["status"] == 200 and line["reason"] == "preempted"
    assert 1 <= received <= line["output_tokens"] < MAX_TOKENS
    assert await _window_used(gw) == line["input_tokens"] + line["output_tokens"]
    assert gw.gateway.policy.estimator._tables == {}  # a cut answer is no output length


async def test_a_preempted_anthropic_stream_ends_with_an_overloaded_error_event(
    gw: RunningGateway, sim: Replica
) -> None:
    """In Anthropic's shape: an `error` event of type `overloaded_error` (its clients retry
    it). Its events carry no running count: the tenant pays the prompt and the chunks it was
    relayed, not the reservation a client that left would settle on."""
    text = ""
    async with (
        anthropic.AsyncAnthropic(base_url=gw.url, api_key=ACME_KEY, max_retries=0) as sdk,
        asyncio.timeout(HANG_S),
    ):
        with pytest.raises(anthropic.APIStatusError) as ended:
            async with sdk.messages.stream(
                model="tiny",
                messages=[{"role": "user", "content": "summarise the listing"}],
                max_tokens=MAX_TOKENS,
                extra_headers=SHEDDABLE_HEADERS,
            ) as stream:
                async for piece in stream.text_stream:
                    if not text:
                        sim.set_faults(STALL)
                        assert _critical_preempts(gw)
                    text += piece
    assert text
    assert isinstance(ended.value.body, dict)
    error = ended.value.body["error"]
    assert error["type"] == "overloaded_error" and "critical" in error["message"]
    await _nothing_left(gw, sim)
    line = _logged(gw)
    assert line["status"] == 200 and line["reason"] == "preempted"
    assert 1 <= line["output_tokens"] < MAX_TOKENS
    assert await _window_used(gw) == line["input_tokens"] + line["output_tokens"]


async def test_a_critical_request_predicted_to_miss_its_objective_preempts_a_sheddable_one(
    sim: Replica, gateway_factory: Any, tokenizer_dir: Path, http: Any
) -> None:
    policy = quota_policy(tokenizer_dir, [sim.url], tpm=TPM, tier="critical")
    policy["pools"]["main"]["slo"] = {"preempt": {"enabled": True}}
    gw = await gateway_factory(policy)
    sim.set_faults(FOREVER)  # the sheddable request holds the replica without an answer
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=ACME_KEY, max_retries=0) as sdk:

        async def ask(priority: str, **headers: str) -> Any:
            return await sdk.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "summarise the listing"}],
                max_tokens=4,
                extra_headers={"x-priority": priority, **headers},
            )

        shed = asyncio.create_task(ask("sheddable"))
        await eventually(lambda: sim.engine.stats.faults.get("first_token_delay") == 1)
        sim.set_faults(Faults())
        # Met easily: nothing is preempted for it.
        await ask("critical", **{"x-slo-ttft-ms": "60000"})
        assert not shed.done()
        # Predicted to miss (no replica answers in a millisecond): the sheddable one goes.
        answer = await ask("critical", **{"x-slo-ttft-ms": "1"})
        assert answer.choices[0].message.content
        with pytest.raises(openai.RateLimitError) as refused:
            async with asyncio.timeout(HANG_S):
                await shed
    assert refused.value.code == "preempted"
    await _nothing_left(gw, sim)
    assert await _preempted_count(gw, http) == "1.0"
