"""Promise Q: for every tenant and window, the tokens it got stay within its TPM plus its burst,
whatever the estimator learned, whatever the request leaves unbounded, however it leaves.

The replica here is vLLM-like and keeps a ledger of what it really produced: it generates up to
the request's bound (to the context's end without one, as vLLM does), several tokens an event
when asked (speculative decoding, `--stream-interval`), with the running usage on every chat and
completions chunk when asked (`continuous_usage_stats`), and reports its usage honestly unless
told to lie. The ledger, plus the gateway's input counts from its access log, is what the tenant
got.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gateway.state import Limit, TenantWindow
from tests.conftest import RunningGateway, accounted, eventually
from tests.request.test_quotas import ACME_KEY, AUTH, chat, quota_policy, with_clock

MAX_MODEL_LEN = 8192
TPM = 5000
BURST = 512  # the policy's default `burst_tokens`
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
_MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def _sse(event: dict[str, Any], name: str | None = None) -> bytes:
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + orjson.dumps(event) + b"\n\n"


def _running(count: int | None) -> dict[str, Any]:
    """vLLM's running usage on a chunk (its `UsageInfo`, fields in its order), when asked."""
    if count is None:
        return {}
    return {"usage": {"prompt_tokens": 9, "total_tokens": 9 + count, "completion_tokens": count}}


def _delta(path: str, text: str, count: int | None = None) -> bytes:
    """One event of `text`; `count`: the running output count a chat or completions chunk
    carries (None: not asked for)."""
    if path == PATHS["chat"]:
        return _sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {
            "content": text}, "finish_reason": None}], **_running(count)})  # fmt: skip
    if path == PATHS["completions"]:
        choices = [{"index": 0, "text": text}]
        return _sse({"object": "text_completion", "choices": choices, **_running(count)})
    if path == PATHS["messages"]:
        event = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta",
                 "text": text}}  # fmt: skip
        return _sse(event, "content_block_delta")
    event = {"type": "response.output_text.delta", "delta": text}
    return _sse(event, "response.output_text.delta")


def _end(path: str, tokens: int, wants_usage: bool) -> bytes:
    if path in (PATHS["chat"], PATHS["completions"]):
        usage = {"completion_tokens": tokens}
        return (_sse({"choices": [], "usage": usage}) if wants_usage else b"") + b"data: [DONE]\n\n"
    if path == PATHS["messages"]:
        delta = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                 "usage": {"output_tokens": tokens}}  # fmt: skip
        return _sse(delta, "message_delta") + _MESSAGE_STOP
    done = {"type": "response.completed", "response": {"usage": {"output_tokens": tokens}}}
    return _sse(done, "response.completed")


def _whole(path: str, text: str, tokens: int) -> dict[str, Any]:
    if path == PATHS["messages"]:
        return {"type": "message", "content": [{"type": "text", "text": text}],
                "usage": {"output_tokens": tokens}}  # fmt: skip
    if path == PATHS["responses"]:
        return {"object": "response", "output": [], "usage": {"output_tokens": tokens}}
    return {"choices": [{"index": 0, "text": text}], "usage": {"completion_tokens": tokens}}


def _continuous(path: str, body: dict[str, Any]) -> bool:
    """Whether vLLM would put the running usage on every chunk (`should_include_usage`)."""
    options = body.get("stream_options") or {}
    return path in (PATHS["chat"], PATHS["completions"]) and bool(
        options.get("include_usage") and options.get("continuous_usage_stats")
    )


@dataclass
class Replica:
    """Generates `min(bound, natural)` tokens, each the word `tok`, `per_chunk` an event; a
    chat stream starts with vLLM's role chunk. `lie` turns the true running count into the
    one reported."""

    natural: int = MAX_MODEL_LEN
    per_chunk: int = 1
    event_delay_s: float = 0.0
    lie: Callable[[int], int | None] | None = None
    force_usage: bool = False  # the running usage unasked (vLLM's `--enable-force-include-usage`)
    break_after: int | None = None  # tokens sent before the connection is reset (a crashed pod)
    produced: list[int] = field(default_factory=list)  # output tokens, one entry a request
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def _count(self, path: str, body: dict[str, Any], sent: int) -> int | None:
        if not (self.force_usage or _continuous(path, body)):
            return None
        return sent if self.lie is None else self.lie(sent)

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        path = request.path
        bound = next(
            (body[k] for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
             if body.get(k) is not None),
            MAX_MODEL_LEN - 64,  # vLLM's default: what the context leaves
        )  # fmt: skip
        tokens = min(bound, self.natural)
        if not body.get("stream"):
            self.produced.append(tokens)
            return web.json_response(_whole(path, "tok " * tokens, tokens))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0
        try:
            if path == PATHS["messages"]:
                start = {"type": "message_start", "message": {"usage": {"output_tokens": 0}}}
                await resp.write(_sse(start, "message_start"))
            if path == PATHS["chat"]:
                await resp.write(_delta(path, "", self._count(path, body, 0)))
            while sent < tokens:
                step = min(self.per_chunk, tokens - sent)
                sent += step
                await resp.write(_delta(path, "tok " * step, self._count(path, body, sent)))
                if self.break_after is not None and sent >= self.break_after:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                if self.event_delay_s:
                    await asyncio.sleep(self.event_delay_s)
            wants = (body.get("stream_options") or {}).get("include_usage", False)
            await resp.write(_end(path, tokens, wants))
        finally:
            self.produced.append(sent)
        return resp


def _body(endpoint: str, system: str, bound: int | None, **extra: Any) -> dict[str, Any]:
    """A request of `endpoint` under one system prompt, its output bound `bound` (None: none)."""
    if endpoint == "completions":
        body: dict[str, Any] = {"model": "tiny", "prompt": system + " Answer:"}
    elif endpoint == "responses":
        body = {"model": "tiny", "instructions": system, "input": "Answer."}
    else:
        messages = [{"role": "user", "content": "Answer."}]
        body = {"model": "tiny", "messages": messages}
        if endpoint == "messages":
            body["system"] = system
        else:
            messages.insert(0, {"role": "system", "content": system})
    if bound is not None:
        field_name = "max_output_tokens" if endpoint == "responses" else "max_tokens"
        body[field_name] = bound
    return {**body, **extra}


async def _send(
    http: aiohttp.ClientSession, gw: RunningGateway, endpoint: str, body: dict[str, Any]
) -> int:
    async with http.post(gw.url + PATHS[endpoint], json=body, headers=AUTH) as resp:
        await resp.read()
        return resp.status


def _input_served(gw: RunningGateway) -> int:
    """The input tokens of every request a replica served, as the gateway counted them."""
    lines = [orjson.loads(line) for line in gw.access_log.getvalue().splitlines()]
    return sum(line["input_tokens"] for line in lines if line["replica"])


async def _got(gws: list[RunningGateway], replica: Replica) -> int:
    """What the tenant got: every served request's input and all the replica produced."""
    for gw in gws:
        await eventually(lambda gw=gw: gw.gateway.quotas.pending == 0)
    return sum(map(_input_served, gws)) + sum(replica.produced)


SYSTEM = "Classify: yes or no."


@pytest.mark.parametrize(
    ("endpoint", "trained"),
    [("chat", True), ("messages", True), ("chat", False), ("completions", False),
     ("responses", False)],
)  # fmt: skip
async def test_no_trick_takes_a_tenant_past_its_tpm_window_after_window(
    replica_app, gateway_factory, tokenizer_dir, http, endpoint: str, trained: bool
) -> None:
    """Issue 35 item 1: trained on `max_tokens: 1`, 20 concurrent `max_tokens: 3000` requests
    were all admitted (12x); with no bound at all each reserved the default guess while vLLM
    generated to the context's end (5.4x). Three windows in a row: each holds."""
    replica = Replica()
    url = await replica_app(replica, PATHS[endpoint])
    policy = quota_policy(tokenizer_dir, [url], tpm=TPM)
    policy["models"]["tiny"]["max_model_len"] = MAX_MODEL_LEN
    policy["pools"]["main"]["max_concurrency"] = 32
    gw = await gateway_factory(policy)
    clock = await with_clock(gw)
    if trained:  # the estimator learns "one-token answers" under this system prompt
        for _ in range(21):
            assert await _send(http, gw, endpoint, _body(endpoint, SYSTEM, 1)) == 200
        await accounted(gw, 0)
    flood = _body(endpoint, SYSTEM, 3000 if trained else None)
    before = 0
    for _ in range(3):
        statuses = await asyncio.gather(*(_send(http, gw, endpoint, flood) for _ in range(20)))
        got = await _got([gw], replica)
        assert got - before <= TPM + BURST, f"{got - before} tokens in one window"
        assert 200 in statuses and 429 in statuses
        before = got
        clock.now += 60
    if not trained:  # the bound the gateway reserved is the one the replica was given
        assert {body[_bound_field(endpoint)] for body in replica.bodies} == {512}


def _bound_field(endpoint: str) -> str:
    return {"chat": "max_completion_tokens", "responses": "max_output_tokens"}.get(
        endpoint, "max_tokens"
    )


async def test_two_gateways_sharing_redis_hold_the_window_against_a_trained_estimate(
    replica_app, gateway_factory, tokenizer_dir, http, fresh_redis
) -> None:
    """Item 1 with `backend: redis`: the flood split over two gateways that share the window,
    each correction one `State.adjust` call."""
    replica = Replica()
    url = await replica_app(replica, PATHS["chat"])
    policy = quota_policy(tokenizer_dir, [url], tpm=TPM)
    policy["pools"]["main"]["max_concurrency"] = 32
    policy["state"] = {"backend": "redis", "url": fresh_redis.url, "gateways": 2}
    first, second = await gateway_factory(policy), await gateway_factory(policy)
    adjusts = 0
    for gw in (first, second):
        state = gw.gateway.quotas.state
        adjust = state.adjust

        async def counted(corrections: Any, adjust: Any = adjust) -> None:
            nonlocal adjusts
            adjusts += 1
            await adjust(corrections)

        state.adjust = counted  # type: ignore[method-assign]
    for _ in range(21):
        assert await _send(http, first, "chat", _body("chat", SYSTEM, 1)) == 200
    await accounted(first, 0)
    flood = _body("chat", SYSTEM, 3000)
    statuses = await asyncio.gather(
        *(_send(http, gw, "chat", flood) for gw in (first, second) for _ in range(10))
    )
    assert 429 in statuses
    assert await _got([first, second], replica) <= TPM + BURST
    assert adjusts <= 21 + len(statuses)  # at most one call a request


async def _window_used(gw: RunningGateway, tpm: int) -> int:
    await eventually(lambda: gw.gateway.quotas.pending == 0)
    [window] = await gw.gateway.state.peek([Limit(TenantWindow("acme", "tokens"), 0, tpm)])
    return tpm - window.remaining


async def _leave(gw: RunningGateway, endpoint: str, after: int) -> int:
    """Stream a 3,000-token answer and leave once `after` tokens arrived; the tokens received."""
    body = _body(endpoint, SYSTEM, 3000, stream=True)
    received = 0
    async with aiohttp.ClientSession() as leaver:
        async with leaver.post(gw.url + PATHS[endpoint], json=body, headers=AUTH) as resp:
            assert resp.status == 200
            while received < after:
                received += (await resp.content.readuntil(b"\n\n")).count(b"tok ")
    await eventually(lambda: b"client_disconnect" in gw.access_log.getvalue())
    return received


@pytest.mark.parametrize("endpoint", list(PATHS))
async def test_a_client_that_leaves_a_stream_of_multi_token_chunks_pays_what_it_got(
    replica_app, gateway_factory, tokenizer_dir, endpoint: str
) -> None:
    """Issue 35 item 3: with 10 tokens an event, a client that left after 2,706 tokens was
    charged 246: the relayed chunks, not the tokens; then its whole bound. A chat or
    completions stream is settled on the running count of the last chunk relayed: what the
    client got, to the chunks in flight. Messages and Responses events carry no count: those
    settle on the reservation (docs/architecture.md, "Tenants and quotas")."""
    replica = Replica(per_chunk=10, event_delay_s=0.005)
    url = await replica_app(replica, PATHS[endpoint])
    gw = await gateway_factory(quota_policy(tokenizer_dir, [url], tpm=100_000))
    await with_clock(gw)
    received = await _leave(gw, endpoint, 500)
    await eventually(lambda: len(replica.produced) == 1)
    logged = orjson.loads(gw.access_log.getvalue().splitlines()[-1])
    assert received <= replica.produced[0] < 3000  # it left early, and the replica stopped
    charged = await _window_used(gw, 100_000) - logged["input_tokens"]
    if endpoint in ("chat", "completions"):
        assert received <= charged <= replica.produced[0]
        assert logged["output_tokens"] == charged
    else:
        assert charged == 3000


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_a_stream_the_replica_breaks_is_settled_on_what_was_relayed(
    replica_app, gateway_factory, tokenizer_dir, http, endpoint: str
) -> None:
    """A replica reset after 300 tokens of a 3,000-token answer: the client got the 300 and the
    stream's error event, and is charged the 300, not its reservation."""
    replica = Replica(per_chunk=10, break_after=300)
    url = await replica_app(replica, PATHS[endpoint])
    gw = await gateway_factory(quota_policy(tokenizer_dir, [url], tpm=100_000))
    await with_clock(gw)
    body = _body(endpoint, SYSTEM, 3000, stream=True)
    async with http.post(gw.url + PATHS[endpoint], json=body, headers=AUTH) as resp:
        text = await resp.read()
    assert text.count(b"tok ") == 300 and b"the replica broke the stream" in text
    await accounted(gw, 0)
    logged = orjson.loads(gw.access_log.getvalue().splitlines()[-1])
    assert await _window_used(gw, 100_000) == logged["input_tokens"] + 300


LIES = {
    "decreasing": lambda sent: sent if sent < 200 else 150,
    "below the chunks": lambda sent: sent // 20,
    "once above the bound": lambda sent: 4000 if sent == 100 else sent,
    "no longer counting": lambda sent: sent if sent <= 200 else None,
}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("lie", list(LIES))
async def test_a_replica_lying_in_its_running_usage_is_settled_on_the_reservation(
    replica_app, gateway_factory, tokenizer_dir, endpoint: str, lie: str
) -> None:
    """A running count that decreases, falls below the chunks relayed or leaves the bound is
    not believed, then or later, nor one that chunks relayed after it lack: the client that
    leaves pays its reservation. The replica sends
    its counts unasked, as vLLM does with `--enable-force-include-usage`."""
    replica = Replica(per_chunk=10, event_delay_s=0.005, lie=LIES[lie], force_usage=True)
    url = await replica_app(replica, PATHS[endpoint])
    gw = await gateway_factory(quota_policy(tokenizer_dir, [url], tpm=100_000))
    await with_clock(gw)
    await _leave(gw, endpoint, 500)
    logged = orjson.loads(gw.access_log.getvalue().splitlines()[-1])
    assert await _window_used(gw, 100_000) == logged["input_tokens"] + 3000
    async with aiohttp.ClientSession() as http, http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    assert 'field="completion_tokens"' in text and "llm_untrusted_usage_total{" in text


async def test_the_openai_sdk_sees_no_running_usage_it_did_not_ask_for(
    replica_app, gateway_factory, tokenizer_dir
) -> None:
    """The gateway asks vLLM for the running usage on the client's behalf and strips it: an SDK
    stream without `stream_options` gets no usage at all, one with `include_usage` only the
    final chunk's, one asking `continuous_usage_stats` every chunk's. A stop button (the SDK
    closing its stream) is charged what the client got."""
    replica = Replica(natural=40, per_chunk=10)
    url = await replica_app(replica)
    gw = await gateway_factory(quota_policy(tokenizer_dir, [url], tpm=100_000))
    await with_clock(gw)
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=ACME_KEY, max_retries=0)
    messages: Any = [{"role": "user", "content": "Answer."}]

    async def chunks(**options: Any) -> list[Any]:
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=3000, stream=True, **options
        )
        return [chunk async for chunk in stream]

    plain = await chunks()
    assert len(plain) == 5 and all(c.usage is None for c in plain)
    final = await chunks(stream_options={"include_usage": True})
    assert all(c.usage is None for c in final[:-1])
    assert final[-1].choices == [] and final[-1].usage.completion_tokens == 40
    asked = await chunks(stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert [c.usage.completion_tokens for c in asked] == [0, 10, 20, 30, 40, 40]
    sent = replica.bodies[0]["stream_options"]
    assert sent == {"include_usage": True, "continuous_usage_stats": True}

    replica.natural, replica.event_delay_s = 3000, 0.005
    await accounted(gw, 0)
    before = await _window_used(gw, 100_000)
    logged = gw.access_log.getvalue().count(b"\n")
    stream = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3000, stream=True
    )
    received = 0
    async for chunk in stream:
        assert chunk.usage is None
        received += (chunk.choices[0].delta.content or "").count("tok ")
        if received >= 300:
            break
    await stream.close()  # the stop button
    await client.close()
    await accounted(gw, logged)
    await eventually(lambda: len(replica.produced) == 4)
    line = orjson.loads(gw.access_log.getvalue().splitlines()[-1])
    charged = await _window_used(gw, 100_000) - before - line["input_tokens"]
    assert received <= charged <= replica.produced[-1] < 3000


async def test_a_replica_that_sends_no_usage_is_settled_on_the_reservation(
    replica_app, gateway_factory, tokenizer_dir, http
) -> None:
    """A whole answer without usage charged the input alone: a replica (or a proxy) dropping
    `usage` gave the tenant its output free."""

    async def no_usage(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"choices": [{"index": 0, "text": "tok " * 400}]})

    url = await replica_app(no_usage)
    gw = await gateway_factory(quota_policy(tokenizer_dir, [url], tpm=100_000))
    await with_clock(gw)
    assert await _send(http, gw, "chat", _body("chat", SYSTEM, 400)) == 200
    await accounted(gw, 0)
    logged = orjson.loads(gw.access_log.getvalue().splitlines()[-1])
    assert await _window_used(gw, 100_000) == logged["input_tokens"] + 400


async def test_the_charge_is_corrected_to_real_usage(
    replica_app, gateway_factory, tokenizer_dir, http
) -> None:
    """Reserved: input and the bound (the model's default, given by the gateway); charged in
    the end: input and the 16 tokens the replica stopped at."""
    url = await replica_app(Replica(natural=16))
    policy = quota_policy(tokenizer_dir, [url], tpm=10_000)
    policy["models"]["tiny"]["default_output_tokens"] = 3000  # the bound; the replica writes 16
    gw = await gateway_factory(policy)
    await with_clock(gw)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "no max_tokens"}]}
    counted = await gw.gateway.policy.models["tiny"].counter.count_chat(body)

    status, _, headers = await chat(http, gw, body)
    assert status == 200
    assert headers["x-ratelimit-remaining-tokens"] == str(10_000 - counted - 3000)
    status, _, headers = await chat(http, gw, {**body, "stream": True})
    assert status == 200
    # The first now counts what it used (input + 16 generated); the second is still reserved.
    expected = 10_000 - (counted + 16) - (counted + 3000)
    assert headers["x-ratelimit-remaining-tokens"] == str(expected)
    status, _, headers = await chat(http, gw, {**body, "max_tokens": 1})
    assert headers["x-ratelimit-remaining-tokens"] == str(10_000 - 3 * counted - 2 * 16 - 1)
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    assert f'llm_tenant_tokens_total{{direction="input",tenant="acme"}} {3 * counted}.0' in text
    assert 'llm_tenant_tokens_total{direction="output",tenant="acme"} 33.0' in text


async def test_a_bound_is_cut_to_what_the_window_can_take_whole(
    replica_app, gateway_factory, tokenizer_dir, http
) -> None:
    """A tenant of 300 TPM asking no bound is not refused for good for the default's 512: its
    bound is cut to what its window can hold, and the replica is told so."""
    replica = Replica()
    url = await replica_app(replica)
    gw = await gateway_factory(quota_policy(tokenizer_dir, [url], tpm=300))
    await with_clock(gw)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    counted = await gw.gateway.policy.models["tiny"].counter.count_chat(body)
    status, _, headers = await chat(http, gw, body)
    assert status == 200
    assert replica.bodies[0]["max_completion_tokens"] == 300 - counted
    assert headers["x-ratelimit-remaining-tokens"] == "0"


async def test_a_replicas_word_adds_at_most_the_burst_to_a_window(
    replica_app, gateway_factory, http
) -> None:
    """On a model counted by estimate the replica's prompt count is the better one and is
    believed; but a replica claiming 5,000 prompt tokens for a short chat is charged no more
    than the reservation plus the tenant's `burst_tokens`: one replica's word cannot empty a
    tenant's window."""

    async def overstates(request: web.Request) -> web.Response:
        await request.read()
        usage = {"prompt_tokens": 5000, "completion_tokens": 3}
        return web.json_response({"choices": [{"index": 0, "text": "x"}], "usage": usage})

    url = await replica_app(overstates)
    gw = await gateway_factory(quota_policy("estimate", [url], tpm=100_000, burst_tokens=100))
    await with_clock(gw)
    assert await _send(http, gw, "chat", _body("chat", SYSTEM, 3)) == 200
    await accounted(gw, 0)
    logged = orjson.loads(gw.access_log.getvalue().splitlines()[-1])
    assert await _window_used(gw, 100_000) == logged["input_tokens"] + 3 + 100
