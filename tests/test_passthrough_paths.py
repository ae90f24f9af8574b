"""Paths a route names for its pool (`routes[].passthrough`): the `openai` SDK's audio
transcription, a multipart upload, through the gateway to a simulated replica; admitted by
request count under the pool's cap and the tenant's request window, its body forwarded as it
came; every other path still a 404."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from aiohttp import FormData, web

from gateway.policy.load import PolicyError
from loadtest.sim import Profile, ReplicaOptions, start_replica
from tests.conftest import _serve, accounted, basic_policy, eventually, write_policy
from tests.test_simulator import write_profile
from tests.test_tenants import hashed

KEY = "sk-tenant-audio-0123456789"
AUDIO = bytes(range(256)) * 40  # 10 KB of "audio"
TRANSCRIBE = "/v1/audio/transcriptions"


def audio_policy(tokenizer_dir: Path, replica: str, **pool: Any) -> dict[str, Any]:
    policy = basic_policy(tokenizer_dir, [replica], **pool)
    policy["routes"][0]["passthrough"] = [TRANSCRIBE, "/v1/audio/translations"]
    return policy


def logged(gw: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in gw.access_log.getvalue().splitlines()]


@pytest.fixture
def tiny(tmp_path: Path) -> Profile:
    return write_profile(tmp_path)


async def test_the_sdks_transcription_is_admitted_and_forwarded(
    tiny, tokenizer_dir, gateway_factory, http
) -> None:
    replica = await start_replica(tiny, ReplicaOptions(time_scale=1000, tokenizer=tokenizer_dir))
    try:
        policy = audio_policy(tokenizer_dir, replica.url)
        policy["tenants"] = {"acme": {"keys": [hashed(KEY)], "rpm": 2}}
        gw = await gateway_factory(policy)
        sdk = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
        async with sdk:
            text = await sdk.audio.transcriptions.create(
                model="tiny", file=("speech.wav", io.BytesIO(AUDIO), "audio/wav")
            )
            assert text.text
            await sdk.audio.transcriptions.create(model="tiny", file=("b.wav", io.BytesIO(AUDIO)))
            with pytest.raises(openai.RateLimitError):  # the tenant's request window holds
                await sdk.audio.transcriptions.create(model="tiny", file=("c.wav", b"x"))
        await accounted(gw, 2)
    finally:
        await replica.close()
    first, _, refused = logged(gw)
    assert first["endpoint"] == "passthrough" and first["status"] == 200
    assert first["pool"] == "main" and first["input_tokens"] == 0 and first["tenant"] == "acme"
    assert refused["status"] == 429 and refused["reason"] == "rate_limit_exceeded"
    assert gw.inflight() == 0
    async with http.get(f"{gw.url}/metrics") as resp:
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
    policy["routes"][0]["passthrough"] += ["/v1/embeddings"]
    policy["routes"].append({"match": {}, "pool": "main", "passthrough": [TRANSCRIBE]})
    with pytest.raises(PolicyError) as caught:
        load_policy(write_policy(tmp_path, policy))
    text = str(caught.value)
    assert "the gateway's embeddings API" in text and "named by an earlier route" in text
