"""Hostile and failing upstreams (issue 11: items 5, 8, 9 and low ones): huge answers, dead replicas
under load, SSE comments, and what the metrics and the client are told about them.

The misbehaving replicas are small aiohttp apps (or raw sockets) built inside each test, on
loopback, as the stub replica is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import tracemalloc
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import basic_policy, eventually, longest_loop_gap

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
MiB = 1024 * 1024


def dead_url() -> str:
    """A loopback port nobody listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {**CHAT, "messages": [{"role": "user", "content": content}], **extra}


def access(gw: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def scrape(http: aiohttp.ClientSession, gw: Any) -> dict[str, list[Any]]:
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def settled(gw: Any) -> bool:
    pools = gw.gateway.slots.values()
    return (
        gw.inflight() == 0
        and gw.inflight_tokens() == 0
        and gw.waiting() == 0
        and all(p.retrying == 0 for p in pools)
    )


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Read the request and start an SSE answer, as a streaming replica does."""
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp


def completion(usage: dict[str, int], **extra: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "chat.completion",
        "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, **extra}],
        "usage": usage,
    }


# --- 5. a whole (non-streamed) answer is capped ---------------------------------------------


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_whole_answer_over_max_response_bytes_is_a_502_and_frees_the_slot(
    replica_app, gateway_factory, tokenizer_dir, http, framing
) -> None:
    sent, ended = [0], asyncio.Event()
    chunk = b"x" * MiB

    async def huge(request: web.Request) -> web.StreamResponse:
        await request.read()
        if framing == "content-length":
            return web.Response(body=b'{"pad": "' + b"x" * (16 * MiB) + b'"}')
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        try:
            for _ in range(64):  # 64 MiB, unless the gateway hangs up first
                await resp.write(chunk)
                sent[0] += len(chunk)
        finally:
            ended.set()
        return resp

    policy = basic_policy(tokenizer_dir, [await replica_app(huge)])
    policy["server"] = {"max_response_bytes": 2 * MiB}
    policy["pools"]["main"]["health"] = {"interval_s": 0, "consecutive_failures": 1}
    gw = await gateway_factory(policy)
    for _ in range(2):
        status, body = await post(http, gw.url, CHAT)
        assert status == 502
        assert body["error"]["type"] == "upstream_error"
        assert body["error"]["code"] == "response_too_large"
    await eventually(lambda: settled(gw))
    if framing == "chunked":  # the gateway hung up instead of reading it all
        await asyncio.wait_for(ended.wait(), 10)
        assert sent[0] < 32 * MiB, sent  # the limit, plus what the socket buffers held
    # A client may ask for a huge answer: that is not held against the replica.
    assert all(r.up for r in gw.gateway.slots["main"].replicas)
    found = await scrape(http, gw)
    assert sum(s.value for s in found["llm_inflight_requests"]) == 0
    assert sum(s.value for s in found["llm_queue_depth"]) == 0
    assert [
        s.value for s in found["llm_rejections_total"] if s.labels["reason"] == "response_too_large"
    ] == [2.0]


async def test_a_large_whole_answer_is_relayed_and_its_usage_read_without_stalling_the_loop(
    replica_app, gateway_factory, tokenizer_dir, http
) -> None:
    # ~45 MB of logprobs: orjson takes seconds over that on the event loop.
    logprobs = {"content": [{"token": "a", "logprob": -0.1, "top_logprobs": []}] * 1_000_000}
    answer = orjson.dumps(
        completion({"prompt_tokens": 1, "completion_tokens": 2}, logprobs=logprobs)
    )

    async def big(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    gw = await gateway_factory(basic_policy(tokenizer_dir, [await replica_app(big)]))

    async def relayed() -> tuple[aiohttp.ClientResponse, bytes]:
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            return resp, await resp.read()

    (resp, got), worst = await longest_loop_gap(relayed(), tick_s=0.01)
    assert resp.status == 200 and got == answer
    assert access(gw)[-1]["output_tokens"] == 2
    assert worst < 0.5, worst  # generous: a whole parse held it for seconds


async def test_a_usage_nested_thousands_deep_is_not_counted_and_the_answer_still_served(
    replica_app, gateway_factory, tokenizer_dir, http, caplog
) -> None:
    # JSON's decoder recurses per level: this raised RecursionError, a 500 for a good answer.
    answer = b'{"choices": [], "usage": ' + b"[" * 4000 + b"]" * 4000 + b"}"

    async def deep(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    gw = await gateway_factory(basic_policy(tokenizer_dir, [await replica_app(deep)]))
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200 and await resp.read() == answer
    assert access(gw)[-1]["output_tokens"] is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_stream_without_event_separators_is_relayed_in_bounded_memory(
    replica_app, gateway_factory, tokenizer_dir, http
) -> None:
    """Not a fix, a check (issue 11, item 5): the relay passes on a run without `\\n\\n` once it
    is over 64 KiB, so a stream never accumulates, however it is framed."""
    chunk = b"data: " + b"x" * (64 * 1024)
    total = 48 * MiB

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        written = 0
        while written < total:
            await resp.write(chunk)
            written += len(chunk)
        return resp

    gw = await gateway_factory(basic_policy(tokenizer_dir, [await replica_app(endless)]))
    tracemalloc.start()
    try:
        received = 0
        async with http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            async for data in r.content.iter_any():
                received += len(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert received >= total
    assert peak < 16 * MiB, peak  # the whole stream is 48 MiB
    await eventually(lambda: settled(gw))


# --- 8. a dead replica under load -----------------------------------------------------------


async def test_requests_refused_by_a_dead_replica_wait_for_the_busy_live_one(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    live = await stub_factory(delay_s=0.2)
    policy = basic_policy(tokenizer_dir, [dead_url(), live.url], max_concurrency=1)
    policy["pools"]["main"]["health"] = {"interval_s": 0}
    gw = await gateway_factory(policy)
    results = await asyncio.gather(*(post(http, gw.url, chat(f"r{i}")) for i in range(8)))
    assert [status for status, _ in results] == [200] * 8
    assert live.stats.max_running == 1 and live.stats.completed == 8
    assert sum(x["retries"] for x in access(gw)) >= 1  # some did land on the dead one first
    await eventually(lambda: settled(gw))


async def test_with_shared_slots_too(
    fresh_redis, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    live = await stub_factory(delay_s=0.2)
    policy = basic_policy(tokenizer_dir, [dead_url(), live.url], max_concurrency=1)
    policy["pools"]["main"]["health"] = {"interval_s": 0}
    policy["state"] = {"backend": "redis", "url": fresh_redis.url, "timeout_s": 0.3}
    gw = await gateway_factory(policy)
    results = await asyncio.gather(*(post(http, gw.url, chat(f"r{i}")) for i in range(8)))
    assert [status for status, _ in results] == [200] * 8
    assert live.stats.max_running == 1
    await eventually(lambda: settled(gw))


async def _refusing_replica(hold_s: float) -> tuple[asyncio.Server, str]:
    """Takes the connection and the request, then hangs up without answering after `hold_s`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(hold_s)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_refused_request_keeps_its_place_ahead_of_later_arrivals(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    live = await stub_factory(delay_s=0.6)
    server, refusing = await _refusing_replica(0.3)
    try:
        policy = basic_policy(tokenizer_dir, [live.url, refusing], max_concurrency=1)
        # Ejected at its first failure, so the later arrival cannot land on it meanwhile.
        policy["pools"]["main"]["health"] = {"interval_s": 0, "consecutive_failures": 1}
        gw = await gateway_factory(policy)
        first = asyncio.create_task(post(http, gw.url, chat("busy")))  # the live one
        await eventually(lambda: live.stats.running == 1)
        early = asyncio.create_task(post(http, gw.url, chat("early")))  # the refusing one
        await eventually(lambda: gw.inflight() == 2)
        late = asyncio.create_task(post(http, gw.url, chat("late")))  # the queue
        await eventually(lambda: gw.waiting() == 1)
        results = await asyncio.gather(first, early, late)
        assert [status for status, _ in results] == [200] * 3
        order = [b["messages"][0]["content"] for b in live.stats.bodies]
        assert order == ["busy", "early", "late"]
        await eventually(lambda: settled(gw))
    finally:
        server.close()


async def test_a_refused_request_keeps_its_deadline(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    live = await stub_factory(delay_s=3.0)
    server, refusing = await _refusing_replica(0.8)
    try:
        policy = basic_policy(
            tokenizer_dir, [live.url, refusing], max_concurrency=1, queue={"max_wait_s": 1.0}
        )
        policy["pools"]["main"]["health"] = {"interval_s": 0}
        gw = await gateway_factory(policy)
        busy = asyncio.create_task(post(http, gw.url, chat("busy")))
        await eventually(lambda: live.stats.running == 1)
        status, body = await post(http, gw.url, chat("refused"))
        assert (status, body["error"]["code"]) == (429, "queue_timeout")
        record = access(gw)[-1]
        assert record["retries"] == 1
        assert record["replica"] is None  # served by none: no e2e sample, no tokens charged
        # 1 s from its arrival, not another 1 s from its refusal 0.8 s in.
        assert record["queue_wait_s"] < 0.6, record
        assert (await busy)[0] == 200
        await eventually(lambda: settled(gw))
    finally:
        server.close()


# --- 9. the queue-wait histogram and the rejection counter ------------------------------------


def queue_wait_count(found: dict[str, list[Any]]) -> float:
    return sum(s.value for s in found.get("llm_queue_wait_seconds_count", []))


def rejections(found: dict[str, list[Any]]) -> dict[str, float]:
    return {s.labels["reason"]: s.value for s in found.get("llm_rejections_total", [])}


async def test_refusals_that_never_waited_are_no_queue_wait_samples(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=1.0)
    policy = basic_policy(
        tokenizer_dir,
        [slow.url],
        max_concurrency=1,
        queue={"max_depth": 1, "max_wait_s": 0.3, "fail_fast": False},
    )
    gw = await gateway_factory(policy)
    served = asyncio.create_task(post(http, gw.url, CHAT))  # admitted at once: a wait of ~0
    await eventually(lambda: slow.stats.running == 1)
    timed_out = asyncio.create_task(post(http, gw.url, CHAT))  # waits 0.3 s, then 429
    await eventually(lambda: gw.waiting() == 1)
    full = [await post(http, gw.url, CHAT) for _ in range(5)]  # refused at once: no wait
    assert {(s, b["error"]["code"]) for s, b in full} == {(429, "queue_full")}
    assert (await timed_out)[0] == 429 and (await served)[0] == 200
    found = await scrape(http, gw)
    assert queue_wait_count(found) == 2  # the served one and the one that waited
    waited = sum(s.value for s in found["llm_queue_wait_seconds_sum"])
    assert waited >= 0.3  # the time-out's whole wait is in it
    assert rejections(found) == {"queue_full": 5.0, "queue_timeout": 1.0}


async def test_a_client_that_leaves_is_not_a_rejection(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=5.0)
    gw = await gateway_factory(basic_policy(tokenizer_dir, [slow.url]))
    session = aiohttp.ClientSession()
    leaving = asyncio.create_task(session.post(f"{gw.url}/v1/chat/completions", json=CHAT))
    await eventually(lambda: slow.stats.running == 1)
    leaving.cancel()
    await session.close()
    await eventually(lambda: settled(gw) and bool(access(gw)))
    assert access(gw)[-1]["status"] == 499
    found = await scrape(http, gw)
    assert "client_disconnect" not in rejections(found)
    codes = {s.labels["code"]: s.value for s in found["llm_requests_total"]}
    assert codes == {"499": 1.0}  # counted as what it is


async def test_a_client_that_leaves_after_done_was_served(
    replica_app, gateway_factory, tokenizer_dir, http
) -> None:
    """A one-shot client (the OpenAI SDK) closes its connection once it has read `[DONE]`, which
    can be before the replica's stream has ended: the body's last chunk is a write of its own. An
    answer written whole is a success, whatever the client does after; it was logged and counted
    as 499 `client_disconnect`."""

    async def done_then_lingers(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": "a"}}]}))
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        await resp.write(_sse({"choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.Event().wait()  # the body never ends: the gateway closing it ends this
        return resp

    gw = await gateway_factory(basic_policy(tokenizer_dir, [await replica_app(done_then_lingers)]))
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(**CHAT, stream=True)
    assert [c.choices[0].delta.content async for c in stream if c.choices] == ["a"]
    await client.close()
    await eventually(lambda: settled(gw) and bool(access(gw)))
    [line] = access(gw)
    assert (line["status"], line["reason"], line["output_tokens"]) == (200, None, 1)
    found = await scrape(http, gw)
    assert {s.labels["code"]: s.value for s in found["llm_requests_total"]} == {"200": 1.0}


# --- low: what the client is told, `stream: null`, SSE comments ------------------------------


async def test_a_502_names_no_replica_to_the_client_and_logs_it(
    gateway_factory, tokenizer_dir, http, caplog
) -> None:
    url = dead_url()
    policy = basic_policy(tokenizer_dir, [url])
    policy["pools"]["main"]["health"] = {"interval_s": 0}
    gw = await gateway_factory(policy)
    with caplog.at_level(logging.WARNING, logger="gateway.request.forward"):
        async with http.post(
            f"{gw.url}/v1/chat/completions", json=CHAT, headers={"x-request-id": "req-502"}
        ) as resp:
            status, body = resp.status, await resp.json()
    assert (status, body["error"]["code"]) == (502, "upstream_error")
    message = body["error"]["message"]
    assert message == "the replica failed before answering"
    lines = [r for r in caplog.records if r.name == "gateway.request.forward"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "req-502" in lines[0].getMessage() and url in lines[0].getMessage()
    assert lines[0].exc_info is None  # one line, no traceback


async def test_a_504_names_no_replica_to_the_client(
    stub_factory, gateway_factory, tokenizer_dir, http, caplog
) -> None:
    slow = await stub_factory(delay_s=2.0)
    policy = basic_policy(tokenizer_dir, [slow.url])
    policy["pools"]["main"]["timeouts"] = {"read_s": 0.3}
    gw = await gateway_factory(policy)
    with caplog.at_level(logging.WARNING, logger="gateway.request.forward"):
        status, body = await post(http, gw.url, CHAT)
    assert (status, body["error"]["code"]) == (504, "upstream_timeout")
    assert body["error"]["message"] == "the replica did not answer in time"
    assert any(
        slow.url in r.getMessage() for r in caplog.records if r.name == "gateway.request.forward"
    )


async def test_a_broken_stream_names_no_replica_to_the_client(
    replica_app, gateway_factory, tokenizer_dir, http
) -> None:
    async def breaks(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n')
        assert request.transport is not None
        request.transport.abort()  # mid-stream, no terminating chunk
        return resp

    url = await replica_app(breaks)
    gw = await gateway_factory(basic_policy(tokenizer_dir, [url]))
    async with http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        text = (await r.read()).decode()
    events = [e for e in text.split("\n\n") if e.startswith("data: {")]
    error = json.loads(events[-1][len("data: ") :])["error"]
    assert error == {
        "message": "the replica broke the stream",
        "type": "upstream_error",
        "param": None,
        "code": "upstream_error",
    }
    assert url.split("//")[1] not in text


async def test_stream_null_is_not_streaming(stub, gateway_factory, tokenizer_dir, http) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    status, body = await post(http, gw.url, {**CHAT, "stream": None})
    assert status == 200 and body["object"] == "chat.completion"


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def test_sse_comments_keep_a_stream_past_first_token_s(
    replica_app, gateway_factory, tokenizer_dir, http
) -> None:
    async def pings_then_tokens(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        for _ in range(6):  # 1.2 s of pings: a long prefill behind a proxy that keeps it alive
            await resp.write(b": ping\n\n")
            await asyncio.sleep(0.2)
        for token in ("a", "b"):
            await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": token}}]}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    policy = basic_policy(tokenizer_dir, [await replica_app(pings_then_tokens)])
    policy["pools"]["main"]["timeouts"] = {"first_token_s": 0.5, "read_s": 5}
    gw = await gateway_factory(policy)
    async with http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        text = (await r.read()).decode()
    assert '"error"' not in text
    assert text.count(": ping") == 6 and text.endswith("data: [DONE]\n\n")
    assert access(gw)[-1]["status"] == 200
    await eventually(lambda: settled(gw))


async def test_a_stream_of_nothing_but_comments_still_ends_at_total_s(
    replica_app, gateway_factory, tokenizer_dir, http
) -> None:
    async def pings(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        while True:
            await resp.write(b": ping\n\n")
            await asyncio.sleep(0.1)

    policy = basic_policy(tokenizer_dir, [await replica_app(pings)])
    policy["pools"]["main"]["timeouts"] = {"first_token_s": 0.3, "total_s": 1.0}
    gw = await gateway_factory(policy)
    async with http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        text = (await r.read()).decode()
    assert '"code":"total_timeout"' in text and text.endswith("data: [DONE]\n\n")
    assert access(gw)[-1]["reason"] == "total_timeout"
    await eventually(lambda: settled(gw))


async def test_a_replicas_usage_is_bounded_before_it_is_settled(
    replica_app, gateway_factory, tokenizer_dir, http, caplog
) -> None:
    """Issue 27: `prompt_tokens: -1000000` left a 20,000 tokens/min tenant 1,019,974 tokens.
    Usage that is no count, more than the request could make, or a prompt far from the
    gateway's own exact count is not believed: the tenant's window settles on what the request
    reserved (its input and its `max_tokens`); counted and logged once."""
    from tests.request.test_tenants import hashed

    usages = [
        {"prompt_tokens": -1_000_000, "completion_tokens": 2},
        {"prompt_tokens": 5, "completion_tokens": 10**9},
        {"prompt_tokens": 5, "completion_tokens": "7"},
        {"prompt_tokens": 5, "completion_tokens": True},
        {"prompt_tokens": 0, "completion_tokens": 2},  # a prompt undercharged
        {"prompt_tokens": 5000, "completion_tokens": 1},  # overcharged, within the context
    ]

    async def lying(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.json_response(completion(usages.pop(0)))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": "tiny"}
        delta = {**chunk, "choices": [{"index": 0, "delta": {"content": "ok"}}]}
        usage = {**chunk, "choices": [], "usage": usages.pop(0)}
        for event in (delta, usage):
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    key = "sk-tenant-usage-0123456789"
    policy = basic_policy(tokenizer_dir, [await replica_app(lying)])
    policy["tenants"] = {"t": {"keys": [hashed(key)], "tpm": 20_000}}
    gw = await gateway_factory(policy)
    headers = {"Authorization": f"Bearer {key}"}
    for body in [CHAT] * 5 + [chat("hello", stream=True)]:
        async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            await resp.read()
    await eventually(lambda: len(access(gw)) == 6 and gw.gateway.quotas.pending == 0)
    records = access(gw)
    assert [r["output_tokens"] for r in records] == [2, 3, 3, 3, 2, 1]  # max_tokens 3 each
    usages.append({"prompt_tokens": records[0]["input_tokens"], "completion_tokens": 1})  # true
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        await resp.read()
        remaining = int(resp.headers["x-ratelimit-remaining-tokens"])
    # None was believed: each settled on its reservation, its input and `max_tokens: 3`.
    used = sum(r["input_tokens"] + 3 for r in records)
    assert remaining == 20_000 - used - (records[0]["input_tokens"] + 3)  # this one reserved
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    counted = {
        s.labels["field"]: s.value
        for s in families["llm_untrusted_usage"].samples
        if s.name.endswith("_total")
    }
    assert counted == {"prompt_tokens": 3, "completion_tokens": 3}
    warned = [r for r in caplog.records if "not a count" in r.getMessage()]
    assert len(warned) == 1
