"""The official `anthropic` SDK pointed at the gateway, in front of a simulated vLLM replica that
serves `/v1/messages` as vLLM does, like any Anthropic client (Claude Code, an agent) would use it."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import orjson
import pytest
from aiohttp import web

from loadtest.loadgen.progress import Progress
from loadtest.loadgen.sweep import SweepConfig, Target, run_sweep
from loadtest.loadgen.workloads import Fixed, Session, Workload, WorkloadClass, load_workload
from loadtest.sim import Profile, ReplicaOptions, start_replica
from tests.conftest import _serve, accounted, basic_policy, eventually
from tests.loadtest.test_simulator import write_profile

KEY = "sk-ant-tenant-key"
HELLO = [{"role": "user", "content": "review this product"}]


@pytest.fixture
def tiny(tmp_path: Path) -> Profile:
    return write_profile(tmp_path)


@pytest.fixture
async def sim(tiny: Profile, tokenizer_dir: Path) -> AsyncIterator[str]:
    """A replica counting prompts with the model's own tokenizer, as vLLM does."""
    replica = await start_replica(tiny, ReplicaOptions(time_scale=1000, tokenizer=tokenizer_dir))
    yield replica.url
    await replica.close()


@pytest.fixture
async def gw(sim, gateway_factory, tokenizer_dir):
    return await gateway_factory(basic_policy(tokenizer_dir, [sim]))


def client(gw: Any, **options: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=gw.url, api_key=options.pop("api_key", "unused"), max_retries=0, **options
    )


def logged(gw: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def test_create_counts_the_prompt_as_the_replica_does(gw) -> None:
    async with client(gw) as sdk:
        reply = await sdk.messages.create(
            model="tiny",
            system="You are a terse reviewer.",
            messages=HELLO,
            max_tokens=4,
        )
        counted = await sdk.messages.count_tokens(
            model="tiny", system="You are a terse reviewer.", messages=HELLO
        )
    assert reply.type == "message" and reply.content[0].type == "text"
    assert 1 <= reply.usage.output_tokens <= 4
    # The replica rendered the converted chat with the model's template; so did the gateway.
    assert counted.input_tokens == reply.usage.input_tokens
    await accounted(gw, 0)
    (line,) = logged(gw)
    assert line["endpoint"] == "messages" and line["status"] == 200
    assert line["input_tokens"] == reply.usage.input_tokens
    assert line["output_tokens"] == reply.usage.output_tokens


async def test_stream_relays_anthropics_events_and_reads_their_usage(gw) -> None:
    async with (
        client(gw) as sdk,
        sdk.messages.stream(model="tiny", messages=HELLO, max_tokens=6) as stream,
    ):
        text = "".join([chunk async for chunk in stream.text_stream])
        final = await stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.usage.output_tokens >= 1 and final.usage.input_tokens > 0
    await accounted(gw, 0)
    (line,) = logged(gw)
    assert line["output_tokens"] == final.usage.output_tokens
    assert line["input_tokens"] == final.usage.input_tokens


async def test_tools_and_tool_results_are_served(gw) -> None:
    weather = {
        "name": "weather",
        "description": "Current weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C, sun"}],
        },
    ]
    async with client(gw) as sdk:
        reply = await sdk.messages.create(
            model="tiny", messages=conversation, tools=[weather], max_tokens=3
        )
        counted = await sdk.messages.count_tokens(
            model="tiny", messages=conversation, tools=[weather]
        )
    assert counted.input_tokens == reply.usage.input_tokens


async def test_an_invalid_request_is_a_bad_request_in_anthropics_shape(gw) -> None:
    async with client(gw) as sdk:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await sdk.messages.create(
                model="tiny",
                messages=[{"role": "user", "content": [{"type": "video", "text": "x"}]}],
                max_tokens=3,
            )
        with pytest.raises(anthropic.NotFoundError) as missing:
            await sdk.messages.create(model="nope", messages=HELLO, max_tokens=3)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert missing.value.body["error"]["type"] == "not_found_error"


class Spy:
    """A replica answering `/v1/messages` with a fixed message, recording each request's
    headers; with `gate`, each answer waits for it."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.gate: asyncio.Event | None = None
        self.running = 0

    async def messages(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        self.running += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.running -= 1
        answer = {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "tiny",
            "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
            "usage": {"input_tokens": 12, "output_tokens": 1},
        }  # fmt: skip
        return web.json_response(answer)


@pytest.fixture
async def spy() -> AsyncIterator[tuple[Spy, str]]:
    spy = Spy()
    app = web.Application()
    app.router.add_post("/v1/messages", spy.messages)
    runner, url = await _serve(app)
    yield spy, url
    await runner.cleanup()


def with_tenant(policy: dict[str, Any], **limits: Any) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()
    policy["tenants"] = {"acme": {"keys": [digest], **limits}}
    return policy


async def test_x_api_key_names_the_tenant_and_never_reaches_the_replica(
    spy, gateway_factory, tokenizer_dir
) -> None:
    recorder, url = spy
    gw = await gateway_factory(with_tenant(basic_policy(tokenizer_dir, [url])))
    async with client(gw, api_key=KEY) as sdk:
        reply = await sdk.messages.create(model="tiny", messages=HELLO, max_tokens=3)
    async with client(gw, api_key="sk-ant-wrong") as stranger:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await stranger.messages.create(model="tiny", messages=HELLO, max_tokens=3)
    assert reply.content[0].text == "ok"
    (sent,) = recorder.headers
    lowered = {name.lower() for name in sent}
    assert "x-api-key" not in lowered and "authorization" not in lowered
    assert sent["anthropic-version"]  # the client's own headers go through
    assert refused.value.body["error"]["type"] == "authentication_error"


async def test_a_tenant_out_of_requests_gets_a_rate_limit_error(
    spy, gateway_factory, tokenizer_dir
) -> None:
    _, url = spy
    gw = await gateway_factory(with_tenant(basic_policy(tokenizer_dir, [url]), rpm=1))
    async with client(gw, api_key=KEY) as sdk:
        first = await sdk.messages.with_raw_response.create(
            model="tiny", messages=HELLO, max_tokens=3
        )
        with pytest.raises(anthropic.RateLimitError) as refused:
            await sdk.messages.create(model="tiny", messages=HELLO, max_tokens=3)
    assert first.headers["anthropic-ratelimit-requests-limit"] == "1"
    assert first.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert first.headers["x-ratelimit-remaining-requests"] == "0"  # OpenAI's, beside
    headers = refused.value.response.headers
    assert refused.value.status_code == 429
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert int(headers["retry-after"]) >= 1
    assert headers["anthropic-ratelimit-requests-reset"].endswith("Z")


async def test_a_full_pool_is_overloaded(spy, gateway_factory, tokenizer_dir) -> None:
    recorder, url = spy
    recorder.gate = asyncio.Event()
    policy = basic_policy(tokenizer_dir, [url], max_concurrency=1, queue={"max_depth": 0})
    gw = await gateway_factory(policy)
    async with client(gw) as sdk:
        held = asyncio.create_task(sdk.messages.create(model="tiny", messages=HELLO, max_tokens=3))
        await eventually(lambda: recorder.running == 1)
        with pytest.raises(anthropic.InternalServerError) as refused:
            await sdk.messages.create(model="tiny", messages=HELLO, max_tokens=3)
        recorder.gate.set()
        await held
    assert refused.value.status_code == 529
    if hasattr(anthropic, "OverloadedError"):
        assert isinstance(refused.value, anthropic.OverloadedError)
    assert refused.value.body["error"]["type"] == "overloaded_error"
    assert refused.value.response.headers["x-should-retry"] == "true"
    await accounted(gw, 1)
    refusal = next(line for line in logged(gw) if line["status"] != 200)
    assert refusal["status"] == 529 and refusal["reason"] == "queue_full"  # what the client got


@pytest.mark.parametrize("stream", [True, False])
async def test_the_load_generator_drives_an_agent_mix_over_messages(
    gw, tokenizer_dir, stream: bool
) -> None:
    """Single requests and multi-turn sessions on `/v1/messages`, through the gateway to the
    simulator: the prompts are fitted as the chat they convert to, so the replica's count is the
    planned one."""
    agent = Workload(
        name="agent",
        classes=[
            WorkloadClass(
                name="turns", endpoint="messages", isl=Fixed(value=40), osl=Fixed(value=4),
                session=Session(turns=Fixed(value=3)),
            ),
            WorkloadClass(name="one-shot", endpoint="messages", isl=Fixed(value=120), osl=Fixed(value=3)),
        ],
    )  # fmt: skip
    config = SweepConfig(
        targets=(Target(gw.url, "tiny", str(tokenizer_dir)),),
        workloads=(agent,),
        users=(2,),
        requests_per_level=8,
        stream=stream,
    )
    result = await run_sweep(config, Progress(live=False))
    records = result.series[0].levels[0][1].records
    assert records and all(r.ok for r in records), [r.outcome for r in records]
    for rec in records:
        assert rec.output_tokens is not None and 1 <= rec.output_tokens <= rec.osl
        if rec.session is None:
            assert rec.input_tokens == rec.isl
        if stream:
            assert rec.ttft_s is not None
    assert any(r.turn for r in records)  # later turns, with the answers in their history
    assert {line["endpoint"] for line in logged(gw)} == {"messages"}


async def test_the_builtin_agent_workload_runs_over_messages(gw, tokenizer_dir) -> None:
    agent = load_workload("agent")
    assert {c.endpoint for c in agent.classes} == {"messages"}
    config = SweepConfig(
        targets=(Target(gw.url, "tiny", str(tokenizer_dir)),),
        workloads=(agent,),
        users=(2,),
        requests_per_level=24,
        max_seconds_per_level=60,
    )
    result = await run_sweep(config, Progress(live=False))
    records = result.series[0].levels[0][1].records
    # The simulated tiny model has 2,048 tokens of context: a conversation's later turns outgrow
    # it (the replica's own 400); its first turns and the one-off calls fit.
    fits = [r for r in records if r.session is None or (r.turn or 0) < 2]
    bad = [(r.cls, r.turn, r.outcome) for r in fits if not r.ok]
    assert fits and not bad, bad
    assert any(r.ok and r.session for r in records) and any(r.ok and not r.session for r in records)
