"""Bad input gets the right 4xx in the OpenAI error shape, and leaves nothing behind."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.errors import GatewayError
from tests.conftest import accounted, basic_policy

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def gw(stub, gateway_factory, tokenizer_dir):
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["models"]["tiny"]["max_model_len"] = 64
    policy["server"] = {"max_body_bytes": 4096}
    return await gateway_factory(policy)


CASES = [
    ("chat/completions", b"{not json", "application/json", 400, "invalid_json"),
    (
        "chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "reasoning_effort": []}',
        "application/json",
        400,
        "invalid_request",
    ),
    ("responses", b'{"model": "tiny", "input": 7}', "application/json", 400, "invalid_type"),
    ("chat/completions", b"[1, 2]", "application/json", 400, "invalid_json"),
    (
        "chat/completions",
        b'{"model": "tiny", "messages": []}',
        "text/plain",
        415,
        "unsupported_media_type",
    ),
    # The stdlib e-mail parser behind aiohttp's `content_type` raises on this one.
    ("chat/completions", b"{}", ";0*", 415, "unsupported_media_type"),
    (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}]}',
        "application/json",
        400,
        "invalid_request",
    ),
    ("chat/completions", b'{"model": "tiny"}', "application/json", 400, "invalid_request"),
    (
        "chat/completions",
        b'{"model": "tiny", "messages": [{"content": "x"}]}',
        "application/json",
        400,
        "invalid_request",
    ),
    ("completions", b'{"model": "tiny"}', "application/json", 400, "invalid_request"),
    (
        "completions",
        b'{"model": "tiny", "prompt": {"a": 1}}',
        "application/json",
        400,
        "invalid_request",
    ),
    (
        "chat/completions",
        b'{"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}',
        "application/json",
        404,
        "model_not_found",
    ),
    (
        "chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}',
        "application/json",
        400,
        "invalid_value",
    ),
    (
        "chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}',
        "application/json",
        400,
        "invalid_type",
    ),
    (
        "chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 60}',
        "application/json",
        400,
        "context_length_exceeded",
    ),
    (
        "completions",
        b'{"model": "tiny", "prompt": [' + b"1," * 70 + b"1]}",
        "application/json",
        400,
        "context_length_exceeded",
    ),
    (
        "chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "maybe"}',
        "application/json",
        400,
        "invalid_type",
    ),
]


@pytest.mark.parametrize(("path", "body", "content_type", "status", "code"), CASES)
async def test_bad_request_is_refused_cleanly(
    gw, stub, http, path, body, content_type, status, code
) -> None:
    async with http.post(
        f"{gw.url}/v1/{path}", data=body, headers={"Content-Type": content_type}
    ) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert error["code"] == code
    assert error["message"] and error["type"]
    assert stub.stats.requests == 0
    assert gw.inflight() == 0 and gw.inflight_tokens() == 0 and gw.waiting() == 0
    logged = json.loads(gw.access_log.getvalue().splitlines()[-1])
    assert logged["reason"] == code  # what the client was told, so the two can be matched


async def test_body_over_the_limit_is_413(gw, stub, http) -> None:
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 10_000}]}
    async with http.post(f"{gw.url}/v1/chat/completions", json=big) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"
    assert stub.stats.requests == 0 and gw.inflight() == 0


async def test_unknown_priority_is_400(gw, http) -> None:
    body = {"model": "tiny", "messages": MESSAGES}
    async with http.post(
        f"{gw.url}/v1/chat/completions", json=body, headers={"x-priority": "urgent"}
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "x-priority"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/images/generations", 404),
        ("POST", "/admin", 404),
        ("GET", "/v1/chat/completions", 405),
        ("GET", "/v1/embeddings", 405),
    ],
)
async def test_not_an_open_proxy(gw, stub, http, method, path, status) -> None:
    async with http.request(method, f"{gw.url}{path}") as resp:
        assert resp.status == status
        assert "message" in (await resp.json())["error"]
    assert stub.stats.requests == 0


async def test_a_wrong_method_is_told_the_allowed_ones(gw, http) -> None:
    async with http.delete(f"{gw.url}/v1/models") as resp:
        assert (resp.status, resp.headers["Allow"]) == (405, "GET,HEAD")
        assert (await resp.json())["error"]["code"] == "method_not_allowed"
    async with http.get(f"{gw.url}/v1/chat/completions") as resp:
        assert (resp.status, resp.headers["Allow"]) == (405, "POST")


async def test_replica_errors_reach_the_client_intact(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    strict = await stub_factory(served_models=("other",))
    gw = await gateway_factory(basic_policy(tokenizer_dir, [strict.url]))
    async with http.post(
        f"{gw.url}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES}
    ) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "NotFoundError"
        assert resp.headers["x-request-id"]
    assert gw.inflight() == 0


async def test_request_id_is_kept_or_made_and_the_replica_gets_only_the_gateways(
    gw, stub, http
) -> None:
    """vLLM makes the `x-request-id` it gets its engine's request id: a client's would let one
    tenant collide with another's request, a counter would let it guess one. The client's id is
    echoed and logged; the replica gets a random one of the gateway's, logged beside it."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    for _ in range(2):
        async with http.post(
            f"{gw.url}/v1/chat/completions", json=body, headers={"x-request-id": "abc-123"}
        ) as resp:
            assert resp.headers["x-request-id"] == "abc-123"
    made = []
    for _ in range(2):
        async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            made.append(resp.headers["x-request-id"])
    await accounted(gw, 3)
    sent = [h["x-request-id"] for h in stub.stats.headers[-4:]]
    assert "abc-123" not in sent and len(set(sent)) == 4
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in sent)
    assert sent[2:] == made  # a request without an id: the one made for it, to both
    assert made[0][:16] != made[1][:16]  # random whole, not a prefix and a counter
    lines = [json.loads(line) for line in gw.access_log.getvalue().splitlines()[-4:]]
    assert [(x["request_id"], x["upstream_request_id"]) for x in lines] == list(
        zip(["abc-123", "abc-123", *made], sent, strict=True)
    )


def _refusals(cls: type[GatewayError]) -> Iterator[type[GatewayError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _refusals(sub)


def test_every_error_code_is_in_the_api_docs_error_table() -> None:
    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    table = [line for line in api.splitlines() if line.startswith("| 4") or line.startswith("| 5")]
    codes = {GatewayError.code} | {cls.code for cls in _refusals(GatewayError)}
    missing = sorted(c for c in codes if not any(f"`{c}`" in row for row in table))
    assert not missing, f"docs/api.md's error table lacks {missing}"
