"""Paths a route names for its pool (`routes[].passthrough`): the `openai` SDK's audio
transcription, a multipart upload, through the gateway to a deployment's own speech service
under its own prefix (the gateway admits vLLM's `/v1/audio/*` itself: tests/api/test_audio.py);
admitted by request count under the pool's cap and the tenant's request window, its body
forwarded as it came; every other path still a 404."""

from __future__ import annotations

import asyncio
import io
import socket
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import FormData, web
from prometheus_client.parser import text_string_to_metric_families

from gateway.config.load import PolicyError
from tests.conftest import Handler, _serve, accounted, basic_policy, eventually, write_policy
from tests.request.test_tenants import hashed

KEY = "sk-tenant-audio-0123456789"
AUDIO = bytes(range(256)) * 40  # 10 KB of "audio"
TRANSCRIBE = "/asr/v1/audio/transcriptions"  # the SDK's path under `base_url` .../asr/v1


def audio_policy(tokenizer_dir: Path, replica: str, **pool: Any) -> dict[str, Any]:
    policy = basic_policy(tokenizer_dir, [replica], **pool)
    policy["routes"][0]["passthrough"] = [TRANSCRIBE, "/asr/v1/audio/translations"]
    return policy


def logged(gw: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def test_the_sdks_transcription_is_admitted_and_forwarded(
    replica_app, tokenizer_dir, gateway_factory, http
) -> None:
    async def replica(request: web.Request) -> web.Response:
        await request.post()
        return web.json_response({"text": "hello"})

    policy = audio_policy(tokenizer_dir, await replica_app(replica, TRANSCRIBE))
    policy["tenants"] = {"acme": {"keys": [hashed(KEY)], "rpm": 2}}
    gw = await gateway_factory(policy)
    sdk = openai.AsyncOpenAI(base_url=f"{gw.url}/asr/v1", api_key=KEY, max_retries=0)
    async with sdk:
        text = await sdk.audio.transcriptions.create(
            model="tiny", file=("speech.wav", io.BytesIO(AUDIO), "audio/wav")
        )
        assert text.text
        await sdk.audio.transcriptions.create(model="tiny", file=("b.wav", io.BytesIO(AUDIO)))
        with pytest.raises(openai.RateLimitError):  # the tenant's request window holds
            await sdk.audio.transcriptions.create(model="tiny", file=("c.wav", b"x"))
    await accounted(gw, 2)
    first, _, refused = logged(gw)
    assert first["endpoint"] == "passthrough" and first["status"] == 200
    assert first["pool"] == "main" and first["input_tokens"] == 0 and first["tenant"] == "acme"
    assert refused["status"] == 429 and refused["reason"] == "rate_limit_exceeded"
    assert gw.inflight() == 0
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        assert 'endpoint="passthrough"' in await resp.text()


async def test_the_body_goes_as_it_came_and_a_full_pool_refuses(
    tokenizer_dir, gateway_factory, http
) -> None:
    got: list[tuple[str, bytes]] = []
    release = asyncio.Event()

    async def replica(request: web.Request) -> web.Response:
        got.append((request.headers["Content-Type"], await request.read()))
        await release.wait()
        return web.json_response({"text": "hello"})

    app = web.Application()
    app.router.add_post(TRANSCRIBE, replica)
    runner, url = await _serve(app)
    try:
        policy = audio_policy(
            tokenizer_dir, url, max_concurrency=1, queue={"max_depth": 0, "max_wait_s": 1}
        )
        policy["pools"]["main"]["upstream_priority"] = True  # sent only in bodies it reads
        gw = await gateway_factory(policy)
        form = FormData()
        form.add_field("model", "tiny")
        form.add_field("file", AUDIO, filename="a.wav", content_type="audio/wav")
        first = asyncio.create_task(http.post(gw.url + TRANSCRIBE, data=form))
        await eventually(lambda: gw.inflight() == 1)
        async with http.post(gw.url + TRANSCRIBE, data=b"{}") as resp:  # no room, no queue
            assert resp.status == 429
            assert (await resp.json())["error"]["code"] == "queue_full"
        release.set()
        async with await first as resp:
            assert resp.status == 200 and await resp.json() == {"text": "hello"}
        await eventually(lambda: gw.inflight() == 0)
    finally:
        await runner.cleanup()
    ((content_type, body),) = got
    assert content_type.startswith("multipart/form-data; boundary=")
    assert AUDIO in body and b'name="model"' in body  # unread, unchanged


async def test_paths_no_route_names_stay_404_and_other_methods_405(
    tokenizer_dir, gateway_factory, http
) -> None:
    gw = await gateway_factory(audio_policy(tokenizer_dir, "http://127.0.0.1:9"))
    async with http.post(f"{gw.url}/v1/audio/speech", data=b"x") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    async with http.get(gw.url + TRANSCRIBE) as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"
    assert gw.access_log.getvalue() == b""  # neither reached the pipeline


def test_a_path_is_one_routes_and_never_an_apis(tmp_path: Path, tokenizer_dir: Path) -> None:
    from gateway.policy.compile import load_policy

    policy = audio_policy(tokenizer_dir, "http://127.0.0.1:9")
    # A policy written when the gateway passed vLLM's audio paths through, unread.
    policy["routes"][0]["passthrough"] += ["/v1/embeddings", "/v1/audio/transcriptions"]
    policy["routes"].append({"match": {}, "pool": "main", "passthrough": [TRANSCRIBE]})
    with pytest.raises(PolicyError) as caught:
        load_policy(write_policy(tmp_path, policy))
    text = str(caught.value)
    assert "the gateway's embeddings API" in text and "named by an earlier route" in text
    assert "/v1/audio/transcriptions is the gateway's transcriptions API" in text


# --- a replica that fails: what the client is told, and that nothing is left held -------------


def dead_url() -> str:
    """A loopback port nobody listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def upload() -> FormData:
    form = FormData()
    form.add_field("model", "tiny")
    form.add_field("file", AUDIO, filename="a.wav", content_type="audio/wav")
    return form


async def nothing_held(gw: Any, http: aiohttp.ClientSession, logged: int) -> None:
    """The request was accounted (`logged` lines before it) and left nothing behind: no slot
    held, no one waiting or retrying, and the metrics say so."""
    await accounted(gw, logged)
    pools = gw.gateway.slots.values()
    await eventually(
        lambda: gw.inflight() == gw.waiting() == 0 and all(p.retrying == 0 for p in pools)
    )
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    inflight = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llm_inflight_requests"
    ]
    assert inflight and sum(inflight) == 0


async def transcribe(gw: Any) -> Any:
    sdk = openai.AsyncOpenAI(base_url=f"{gw.url}/asr/v1", api_key="unused", max_retries=0)
    async with sdk, asyncio.timeout(10):  # a hang fails the test, not the run
        return await sdk.audio.transcriptions.create(
            model="tiny", file=("speech.wav", io.BytesIO(AUDIO), "audio/wav")
        )


async def test_an_unreachable_replica_is_the_gateways_502_in_openais_shape(
    tokenizer_dir, gateway_factory, http
) -> None:
    policy = audio_policy(tokenizer_dir, dead_url())
    policy["pools"]["main"]["health"] = {"interval_s": 0}
    gw = await gateway_factory(policy)
    with pytest.raises(openai.InternalServerError) as caught:
        await transcribe(gw)
    assert caught.value.status_code == 502
    assert caught.value.body == {
        "message": "the replica failed before answering",
        "type": "upstream_error",
        "param": None,
        "code": "upstream_error",
    }
    await nothing_held(gw, http, 0)
    [line] = logged(gw)
    assert (line["endpoint"], line["status"], line["reason"]) == (
        "passthrough",
        502,
        "upstream_error",
    )


async def test_a_replicas_500_reaches_the_client_as_it_sent_it(
    replica_app, tokenizer_dir, gateway_factory, http
) -> None:
    error = {
        "message": "decoder crashed",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }

    async def fails(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": error}, status=500)

    gw = await gateway_factory(audio_policy(tokenizer_dir, await replica_app(fails, TRANSCRIBE)))
    with pytest.raises(openai.InternalServerError) as caught:
        await transcribe(gw)
    assert caught.value.status_code == 500 and caught.value.body == error  # as chat relays it
    await nothing_held(gw, http, 0)
    [line] = logged(gw)
    assert (line["endpoint"], line["status"]) == ("passthrough", 500)


async def test_a_503_is_retried_on_another_replica_with_the_same_upload(
    replica_app, tokenizer_dir, gateway_factory, http
) -> None:
    got: list[tuple[int, bytes]] = []

    def answering(status: int) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            got.append((status, await request.read()))
            return web.json_response({"text": "hello"}, status=status)

        return handler

    busy, ok = (
        await replica_app(answering(503), TRANSCRIBE),
        await replica_app(answering(200), TRANSCRIBE),
    )
    policy = audio_policy(tokenizer_dir, busy)
    policy["pools"]["main"]["replicas"] = [busy, ok]
    policy["pools"]["main"]["health"] = {"interval_s": 0}
    gw = await gateway_factory(policy)
    assert (await transcribe(gw)).text == "hello"
    await nothing_held(gw, http, 0)
    [(first, tried), (second, served)] = got
    assert (first, second) == (503, 200) and AUDIO in tried and served == tried
    assert logged(gw)[0]["retries"] == 1


@pytest.mark.parametrize(
    ("timeouts", "code"),
    [
        ({"read_s": 0.3}, "upstream_timeout"),  # the replica's silence
        ({"first_token_s": 0.3}, "upstream_timeout"),  # a passthrough is relayed as a stream
        ({"total_s": 0.3}, "total_timeout"),  # the request's own limit
    ],
)
async def test_a_replica_that_hangs_is_a_504_and_is_told_to_stop(
    replica_app, tokenizer_dir, gateway_factory, http, timeouts, code
) -> None:
    ended = asyncio.Event()

    async def hangs(request: web.Request) -> web.Response:
        await request.read()
        try:
            await asyncio.sleep(60)
        finally:  # cancelled: the gateway closed the connection
            ended.set()
        return web.json_response({"text": "too late"})

    policy = audio_policy(tokenizer_dir, await replica_app(hangs, TRANSCRIBE))
    policy["pools"]["main"]["timeouts"] = timeouts
    gw = await gateway_factory(policy)
    with pytest.raises(openai.InternalServerError) as caught:
        await transcribe(gw)
    assert caught.value.status_code == 504 and caught.value.body["code"] == code
    assert caught.value.body["type"] == "upstream_error"
    await asyncio.wait_for(ended.wait(), 5)
    await nothing_held(gw, http, 0)
    assert (logged(gw)[0]["status"], logged(gw)[0]["reason"]) == (504, code)


async def test_a_replica_that_dies_mid_answer_is_a_502_not_a_hang(
    replica_app, tokenizer_dir, gateway_factory, http
) -> None:
    """A whole (JSON) answer is read whole before the client gets a byte: cut short, it is the
    gateway's 502, as chat's is."""

    async def dies(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b'{"text": "hel')
        await resp.drain()
        assert request.transport is not None
        request.transport.close()  # 13 bytes of 1000, then gone
        return resp

    gw = await gateway_factory(audio_policy(tokenizer_dir, await replica_app(dies, TRANSCRIBE)))
    with pytest.raises(openai.InternalServerError) as caught:
        await transcribe(gw)
    assert caught.value.status_code == 502
    assert caught.value.body["message"] == "the replica broke its answer"
    await nothing_held(gw, http, 0)
    assert (logged(gw)[0]["status"], logged(gw)[0]["reason"]) == (502, "upstream_error")


async def test_a_stream_the_replica_breaks_ends_with_an_error_event_not_a_hang(
    replica_app, tokenizer_dir, gateway_factory, http
) -> None:
    first = b'data: {"type": "transcript.text.delta", "delta": "hel"}\n\n'

    async def breaks(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(first)
        await resp.drain()
        assert request.transport is not None
        request.transport.close()  # mid-stream, no terminating chunk
        return resp

    gw = await gateway_factory(audio_policy(tokenizer_dir, await replica_app(breaks, TRANSCRIBE)))
    async with asyncio.timeout(10), http.post(gw.url + TRANSCRIBE, data=upload()) as resp:
        assert resp.status == 200  # sent before the break
        text = await resp.read()
    assert text.startswith(first) and text.endswith(b"data: [DONE]\n\n")
    [error] = [e for e in text.split(b"\n\n") if e.startswith(b'data: {"error"')]
    assert orjson.loads(error[len(b"data: ") :])["error"]["message"] == (
        "the replica broke the stream"
    )
    await nothing_held(gw, http, 0)
    assert (logged(gw)[0]["status"], logged(gw)[0]["reason"]) == (200, "upstream_error")


# --- a client that leaves -----------------------------------------------------------------------


@pytest.mark.parametrize("pause_s", [0.05, 60], ids=["streaming", "silent"])
async def test_a_client_that_leaves_mid_stream_ends_the_replicas_request(
    replica_app, tokenizer_dir, gateway_factory, http, pause_s
) -> None:
    """Whether the replica is still sending (the next delta would reach no one) or silent (a
    long stretch of audio to decode), the gateway closes its connection: that is how the
    replica learns to stop."""
    ended = asyncio.Event()

    async def streams(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(600):  # deltas for 30 s or more, unless the gateway hangs up
                await resp.write(b'data: {"type": "transcript.text.delta", "delta": "a"}\n\n')
                await asyncio.sleep(pause_s)
        finally:
            ended.set()
        return resp

    gw = await gateway_factory(audio_policy(tokenizer_dir, await replica_app(streams, TRANSCRIBE)))
    async with asyncio.timeout(10):  # the first delta is relayed as it comes, not held
        resp = await http.post(gw.url + TRANSCRIBE, data=upload())
        assert resp.status == 200 and await resp.content.readuntil(b"\n\n")
    resp.close()  # the client hangs up mid-answer
    await asyncio.wait_for(ended.wait(), 5)
    await nothing_held(gw, http, 0)
    assert (logged(gw)[0]["status"], logged(gw)[0]["reason"]) == (499, "client_disconnect")


async def test_a_client_that_leaves_while_the_replica_works_ends_the_replicas_request(
    replica_app, tokenizer_dir, gateway_factory, http
) -> None:
    received, ended = asyncio.Event(), asyncio.Event()

    async def works(request: web.Request) -> web.Response:
        await request.read()
        received.set()
        try:
            await asyncio.sleep(60)  # a long transcription
        finally:
            ended.set()
        return web.json_response({"text": "too late"})

    gw = await gateway_factory(audio_policy(tokenizer_dir, await replica_app(works, TRANSCRIBE)))
    client = asyncio.create_task(http.post(gw.url + TRANSCRIBE, data=upload()))
    await asyncio.wait_for(received.wait(), 5)
    client.cancel()  # the client gives up before any answer
    await asyncio.wait_for(ended.wait(), 5)
    await nothing_held(gw, http, 0)
    assert (logged(gw)[0]["status"], logged(gw)[0]["reason"]) == (499, "client_disconnect")


async def test_an_upload_the_client_abandons_never_reaches_the_replica(
    replica_app, tokenizer_dir, gateway_factory, http
) -> None:
    """The body is read whole (up to `server.max_body_bytes`) before a slot is taken or a byte
    goes upstream: half an upload is nobody's business but the gateway's."""
    asked, got = [0], []

    async def replica(request: web.Request) -> web.Response:
        asked[0] += 1  # before its body: a forwarded half upload counts too
        got.append(await request.read())
        return web.json_response({"text": "hello"})

    gw = await gateway_factory(audio_policy(tokenizer_dir, await replica_app(replica, TRANSCRIBE)))
    host, port = gw.url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    head = f"POST {TRANSCRIBE} HTTP/1.1\r\nHost: {host}\r\nContent-Type: audio/wav\r\n"
    writer.write(f"{head}Content-Length: {len(AUDIO)}\r\n\r\n".encode() + AUDIO[:1000])
    await writer.drain()
    await asyncio.sleep(0.2)  # the gateway is reading the body
    writer.close()  # the client leaves mid-upload
    await writer.wait_closed()
    await nothing_held(gw, http, 0)
    assert (logged(gw)[0]["status"], logged(gw)[0]["reason"]) == (499, "client_disconnect")
    # The whole upload, unlike the half one, goes through.
    async with http.post(gw.url + TRANSCRIBE, data=AUDIO) as resp:
        assert resp.status == 200
    assert (asked[0], got) == (1, [AUDIO])


async def test_an_upload_over_max_body_bytes_is_a_413_and_never_reaches_the_replica(
    replica_app, tokenizer_dir, gateway_factory, http
) -> None:
    got: list[bytes] = []

    async def replica(request: web.Request) -> web.Response:
        got.append(await request.read())
        return web.json_response({"text": "hello"})

    policy = audio_policy(tokenizer_dir, await replica_app(replica, TRANSCRIBE))
    policy["server"] = {"max_body_bytes": len(AUDIO) - 1}
    gw = await gateway_factory(policy)
    async with http.post(gw.url + TRANSCRIBE, data=AUDIO) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"
    await nothing_held(gw, http, 0)
    assert got == []
