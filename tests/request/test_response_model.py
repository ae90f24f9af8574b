"""`server.response_model`: answers name the model the replica reports (default) or, with
`requested`, the alias the client sent, in a JSON answer and in every event of a stream as it
passes. Real replicas on loopback: the stub, and small aiohttp apps that split events."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.config.load import PolicyError
from gateway.policy.compile import load_policy
from tests.conftest import basic_policy, write_policy

ALIAS = "tiny-alias"  # basic_policy routes it to the pool of model `tiny`
# What a client may legitimately write: the rewrite must leave the text of an answer alone.
TRICKY = 'say "model": "tiny" and {"model":"tiny"}'


def policy(tokenizer_dir: Any, url: str, response_model: str | None) -> dict[str, Any]:
    out = basic_policy(tokenizer_dir, [url])
    if response_model is not None:
        out["server"] = {"response_model": response_model}
    return out


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.append(orjson.loads(line[len(b"data: ") :]))
    return out


@pytest.mark.parametrize(
    ("setting", "seen"), [(None, "tiny"), ("upstream", "tiny"), ("requested", ALIAS)]
)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_answer_names_the_model_the_setting_says(
    stub_factory, gateway_factory, tokenizer_dir, http, setting, seen, stream
) -> None:
    stub = await stub_factory()
    gw = await gateway_factory(policy(tokenizer_dir, stub.url, setting))
    body = {**chat(ALIAS), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}  # the usage chunk is renamed too
    async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert stub.stats.bodies[-1]["model"] == "tiny"  # upstream always gets the pool's model
    chunks = events(raw) if stream else [orjson.loads(raw)]
    assert len(chunks) == (6 if stream else 1)  # 4 tokens, the finish and the usage chunk
    assert {chunk["model"] for chunk in chunks} == {seen}
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    if stream:
        assert resp.headers.get("Content-Length") is None


async def test_a_model_asked_by_its_own_name_is_left_as_the_replica_says(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    stub = await stub_factory()
    gw = await gateway_factory(policy(tokenizer_dir, stub.url, "requested"))
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat("tiny")) as resp:
        assert (resp.status, (await resp.json())["model"]) == (200, "tiny")


def chunk(content: str | None) -> bytes:
    delta = {"content": content} if content is not None else {}
    return orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "model": "tiny",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }
    )


async def test_events_split_across_reads_are_renamed_as_they_pass(
    replica_app, gateway_factory, tokenizer_dir, http
) -> None:
    """The first event arrives in three writes cut inside its `"model"` key; the client must get
    it renamed, and before the replica sends the second one (nothing is held back)."""
    go = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = b"data: " + chunk(TRICKY) + b"\n\n"
        cut = first.index(b'"model"') + 3
        for piece in (first[:cut], first[cut : cut + 12], first[cut + 12 :]):
            await resp.write(piece)
            await asyncio.sleep(0.05)  # separate TCP reads at the gateway
        await asyncio.wait_for(go.wait(), 10)
        await resp.write(b"data: " + chunk(None) + b"\n\ndata: [DONE]\n\n")
        return resp

    url = await replica_app(handler)
    gw = await gateway_factory(policy(tokenizer_dir, url, "requested"))
    body = {**chat(ALIAS), "stream": True}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
        go.set()
        rest = await resp.read()
    renamed = events(first)
    assert renamed == [{**orjson.loads(chunk(TRICKY)), "model": ALIAS}]
    assert renamed[0]["choices"][0]["delta"]["content"] == TRICKY
    assert [e["model"] for e in events(rest)] == [ALIAS]
    assert rest.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_replica_naming_another_served_name_in_spaced_json_is_renamed(
    replica_app, gateway_factory, tokenizer_dir, http, stream
) -> None:
    """vLLM may answer with its first `--served-model-name` rather than the one it was sent, and
    another server may space its JSON: the exact-bytes shortcut does not apply, the rename does."""
    answer = {"id": "c", "object": "chat.completion", "model": "tiny-2026-01", "choices": []}

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if not stream:
            return web.Response(text=json.dumps(answer), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        spaced = {**answer, "choices": [{"index": 0, "delta": {"content": TRICKY}}]}
        # one read holding an event of each kind: the exact bytes and the spaced other name
        await resp.write(b"data: " + chunk("a") + b"\n\ndata: " + json.dumps(spaced).encode())
        await resp.write(b"\n\ndata: [DONE]\n\n")
        return resp

    url = await replica_app(handler)
    gw = await gateway_factory(policy(tokenizer_dir, url, "requested"))
    async with http.post(
        f"{gw.url}/v1/chat/completions", json={**chat(ALIAS), "stream": stream}
    ) as resp:
        assert resp.status == 200
        raw = await resp.read()
    got = events(raw) if stream else [orjson.loads(raw)]
    assert len(got) == (2 if stream else 1)
    assert {e["model"] for e in got} == {ALIAS}
    if stream:
        assert got[1]["choices"][0]["delta"]["content"] == TRICKY


@pytest.mark.parametrize("usage_first", [False, True])
async def test_a_json_answer_is_renamed_at_its_key_only(
    replica_app, gateway_factory, tokenizer_dir, http, usage_first
) -> None:
    usage = {"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    answer = {
        **(usage if usage_first else {}),
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": TRICKY}}],
        **usage,
    }

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    url = await replica_app(handler)
    gw = await gateway_factory(policy(tokenizer_dir, url, "requested"))
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat(ALIAS)) as resp:
        assert resp.status == 200
        got = await resp.json()
        assert int(resp.headers["Content-Length"]) == len(orjson.dumps(got))
    assert got == {**answer, "model": ALIAS}
    # The usage is read after the rename moved it (by the names' difference), or did not.
    assert json.loads(gw.access_log.getvalue().splitlines()[-1])["output_tokens"] == 2


async def test_an_error_answer_is_passed_on_untouched(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    stub = await stub_factory(served_models=("other",))  # answers 404 naming the model it got
    gw = await gateway_factory(policy(tokenizer_dir, stub.url, "requested"))
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat(ALIAS)) as resp:
        assert resp.status == 404
        assert "`tiny`" in (await resp.json())["error"]["message"]


def test_an_unknown_setting_is_a_policy_error(tmp_path, tokenizer_dir) -> None:
    path = write_policy(tmp_path, policy(tokenizer_dir, "http://127.0.0.1:1", "alias"))
    with pytest.raises(PolicyError, match="response_model"):
        load_policy(path)
