"""Hostile input against the logs and the head: no secret in any log, a bounded log under a flood
of bad requests, the OpenAI error shape for what aiohttp's parser refuses, and headers forwarded
as a proxy forwards them (issue 11, items 2 and 7 and the low ones about headers and /metrics).

Raw HTTP/1.1 over loopback sockets: a client library would refuse to send these heads.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.server import logs
from tests.conftest import basic_policy, write_policy

KEY = "sk-acme-hostile-0123456789abcdef"
TOKEN = "admin-hostile-token-fedcba9876543210"
BOUND_S = 10.0  # generous: only "the server answered", never how fast
CHAT = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":3}'


def _sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _tenant_policy(tokenizer_dir: Path, replicas: list[str]) -> dict[str, Any]:
    policy = basic_policy(tokenizer_dir, replicas)
    policy["tenants"] = {"acme": {"keys": [_sha(KEY)], "tier": "standard"}}
    return policy


@dataclass
class Served:
    url: str
    port: int
    proc: asyncio.subprocess.Process
    stdout: bytes = b""
    stderr: bytes = b""

    @property
    def output(self) -> bytes:
        return self.stdout + self.stderr


@contextlib.asynccontextmanager
async def serve(policy_path: Path) -> AsyncIterator[Served]:
    """`llm-gateway serve` with the admin token set, keeping all it writes for the test."""
    env = {**os.environ, "LLM_GATEWAY_ADMIN_TOKEN": TOKEN}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--policy", str(policy_path), "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    head = b""
    try:
        async with asyncio.timeout(60):
            while not (match := re.search(rb"listening on (http://\S+)", head)):
                line = await proc.stderr.readline()
                assert line, f"gateway exited before listening: {head.decode()}"
                head += line
        url = match.group(1).decode()
        served = Served(url, urlsplit(url).port or 0, proc)
        out = asyncio.create_task(proc.stdout.read())
        err = asyncio.create_task(proc.stderr.read())  # or a chatty gateway fills the pipe
        yield served
        proc.terminate()
        async with asyncio.timeout(30):
            await proc.wait()
            served.stdout, served.stderr = await out, head + await err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def exchange(port: int, data: bytes) -> tuple[int, dict[str, Any], bytes]:
    """Send `data` on a fresh connection; the status, the JSON body (or {}), and the raw head."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(BOUND_S):
            answer = await reader.read()
    finally:
        writer.close()
    while answer.startswith(b"HTTP/1.1 100 "):  # an interim answer to `Expect: 100-continue`
        answer = answer.partition(b"\r\n\r\n")[2]
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, (orjson.loads(body) if body.startswith(b"{") else {}), head


def post(path: str, *fields: bytes, body: bytes = CHAT, eol: bytes = b"\r\n") -> bytes:
    lines = [
        b"POST " + path.encode() + b" HTTP/1.1",
        b"Host: gateway",
        b"Content-Type: application/json",
        b"Content-Length: " + str(len(body)).encode(),
        b"Connection: close",
        *fields,
    ]
    return eol.join(lines) + eol + eol + body


BEARER_KEY = b"Authorization: Bearer " + KEY.encode()
BEARER_TOKEN = b"Authorization: Bearer " + TOKEN.encode()
PAD = b"X-Pad: " + b"a" * 20_000  # over the 16 KiB line limit

MALFORMED = {
    "bare LF line endings": (post("/v1/chat/completions", BEARER_KEY, eol=b"\n"), 400),
    "NUL in the key": (post("/v1/chat/completions", BEARER_KEY + b"\x00"), 400),
    "NUL after the admin token": (post("/admin/reload", BEARER_TOKEN + b"\x00"), 400),
    "the key on a line over the limit": (
        post("/v1/chat/completions", BEARER_KEY + b"a" * 20_000),
        431,
    ),
    "a long line after the token": (post("/admin/reload", BEARER_TOKEN, PAD), 431),
    "the key among too many fields": (
        post("/v1/chat/completions", *[b"X-A: b"] * 200, BEARER_KEY),
        431,
    ),
    "a bare-LF admin call": (post("/admin/reload", BEARER_TOKEN, eol=b"\n"), 400),
    "the key in the request line": (
        b"GET /v1/models?key=" + KEY.encode() + b" HTTP/1.1 junk\r\n\r\n",
        400,
    ),
}


def is_openai_error(body: dict[str, Any]) -> bool:
    error = body.get("error")
    return isinstance(error, dict) and {"message", "type", "code"} <= error.keys()


async def test_a_hostile_run_writes_no_secret_to_any_log_and_refusals_are_openai_errors(
    stub, tokenizer_dir, tmp_path
) -> None:
    async with serve(write_policy(tmp_path, _tenant_policy(tokenizer_dir, [stub.url]))) as gw:
        for name, (data, expected) in MALFORMED.items():
            status, body, head = await exchange(gw.port, data)
            assert (status, is_openai_error(body)) == (expected, True), name
            assert b"application/json" in head, name
            assert KEY not in str(body) and TOKEN not in str(body), name
        # and the ordinary ways in, right and wrong, streamed and cut
        wrong = [
            post("/v1/chat/completions", b"Authorization: Bearer " + KEY.encode()[:-1]),
            post("/v1/chat/completions", b"Authorization: Basic " + KEY.encode()),
            post("/admin/reload", b"Authorization: Bearer " + TOKEN.encode() + b"x"),
            post("/admin/reload", b"Authorization: Bearer \xff" + TOKEN.encode()),
            post("/v1/chat/completions", BEARER_KEY, b"X-Note: caf\xe9 " + KEY.encode()),
        ]
        for data in wrong:
            status, body, _ = await exchange(gw.port, data)
            assert status in (400, 401) and is_openai_error(body), data[:80]
        assert (await exchange(gw.port, post("/v1/chat/completions", BEARER_KEY)))[0] == 200
        assert (await exchange(gw.port, post("/admin/reload", BEARER_TOKEN)))[0] == 200
        stream = CHAT.replace(b'"max_tokens":3', b'"max_tokens":30,"stream":true')
        for _ in range(5):
            _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(post("/v1/chat/completions", BEARER_KEY, body=stream))
            await writer.drain()
            writer.transport.abort()
    assert gw.proc.returncode == 0
    assert KEY.encode() not in gw.output
    assert TOKEN.encode() not in gw.output
    assert b"Traceback" not in gw.stderr


async def test_a_flood_of_malformed_heads_writes_a_few_warning_lines(
    stub, tokenizer_dir, tmp_path
) -> None:
    """Before: an 11-line ERROR traceback each (2,000 bad requests, 800 KB of stderr)."""
    async with serve(write_policy(tmp_path, basic_policy(tokenizer_dir, [stub.url]))) as gw:
        for i in range(200):
            data, _ = list(MALFORMED.values())[i % 2]  # two kinds of refusal
            await exchange(gw.port, data)
    refusals = [line for line in gw.stderr.splitlines() if b"aiohttp.server" in line]
    assert refusals and len(refusals) <= 2 * logs.RateLimited().burst
    assert all(b" WARNING aiohttp.server: Error handling request from" in x for x in refusals)
    assert len(gw.stderr.splitlines()) < 40


async def test_a_client_gone_mid_answer_is_one_warning_line(caplog, http, monkeypatch) -> None:
    """The pipeline re-raises a client's disconnect so that aiohttp closes the connection; aiohttp
    logged it as a 40-line ERROR. The gateway's filter on `aiohttp.server` makes it one line."""
    logs.install()
    (installed,) = [
        f
        for f in logging.getLogger(logs.SERVER_LOGGER).filters
        if isinstance(f, logs.ServerLogFilter)
    ]
    monkeypatch.setattr(installed, "limiter", logs.RateLimited())  # other tests' lines spent none

    async def gone(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        raise ConnectionResetError("Cannot write to closing transport")

    app = web.Application()
    app.router.add_get("/", gone)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        with caplog.at_level(logging.INFO, logger="aiohttp.server"):
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"http://127.0.0.1:{runner.addresses[0][1]}/") as resp:
                    await resp.read()
            await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert [(r.levelname, r.exc_info) for r in records] == [("WARNING", None)]
    assert "\n" not in records[0].getMessage()
    assert records[0].getMessage().endswith("ConnectionResetError")


def test_the_rate_limiter_says_how_many_lines_it_suppressed() -> None:
    now = [0.0]
    limiter = logs.RateLimited(burst=2, interval_s=10, clock=lambda: now[0])
    assert [limiter.allow("k") for _ in range(5)] == [0, 0, None, None, None]
    assert limiter.allow("other") == 0
    now[0] = 10.0
    assert limiter.allow("k") == 3  # the next window's first line reports the three dropped


@pytest.fixture
async def admin_gw(stub, gateway_factory, tokenizer_dir, monkeypatch):
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_TOKEN", TOKEN)
    return await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))


@pytest.mark.parametrize(
    ("authorization", "expected"),
    [
        (b"Authorization: Bearer \xff" + TOKEN.encode(), 401),  # before: a plain-text 500
        (b"Authorization: \xffearer " + TOKEN.encode(), 401),
        (b"Authorization: bearer " + TOKEN.encode(), 200),  # before: 401
        (b"Authorization: BEARER  " + TOKEN.encode(), 200),
        (b"Authorization: Bearer " + TOKEN.encode()[:-1], 401),
    ],
)
async def test_admin_auth_takes_any_case_of_bearer_and_survives_non_utf8(
    admin_gw, authorization, expected
) -> None:
    port = urlsplit(admin_gw.url).port
    status, body, _ = await exchange(port, post("/admin/reload", authorization, body=b""))
    assert status == expected
    assert is_openai_error(body) if expected != 200 else body["reloaded"] is True


async def test_a_huge_model_name_is_refused_and_not_echoed(stub, gateway_factory, tokenizer_dir):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    name = "m" * 1_000_000
    body = orjson.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}]})
    status, error, _ = await exchange(
        urlsplit(gw.url).port, post("/v1/chat/completions", body=body)
    )
    assert (status, error["error"]["code"], error["error"]["param"]) == (
        400,
        "model_too_long",
        "model",
    )
    assert len(orjson.dumps(error)) < 1000  # before: a 1 MB 404 naming the model
    assert len(gw.access_log.getvalue()) < 2000  # before: a 1 MB access-log line
    assert stub.stats.headers == []


async def test_an_unknown_long_path_is_not_echoed_whole(gateway_factory, stub, tokenizer_dir):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    data = b"GET /" + b"p" * 10_000 + b" HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n"
    status, body, _ = await exchange(urlsplit(gw.url).port, data)
    assert (status, body["error"]["code"]) == (404, "not_found")
    assert len(body["error"]["message"]) < 300


async def test_a_non_utf8_header_is_refused_instead_of_going_upstream_empty(
    stub, gateway_factory, tokenizer_dir
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    data = post("/v1/chat/completions", b"X-Note: caf\xe9")
    status, body, _ = await exchange(urlsplit(gw.url).port, data)
    assert (status, body["error"]["code"]) == (400, "malformed_request")
    assert "X-Note" in body["error"]["message"]
    assert stub.stats.headers == []
    record = orjson.loads(gw.access_log.getvalue().splitlines()[-1])  # accounted like any refusal
    assert (record["status"], record["reason"]) == (400, "malformed_request")
    utf8 = post("/v1/chat/completions", "X-Note: café".encode())
    assert (await exchange(urlsplit(gw.url).port, utf8))[0] == 200
    assert stub.stats.headers[-1]["x-note"] == "café"


async def test_expect_100_continue_stays_at_the_gateway(stub, gateway_factory, tokenizer_dir):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    data = post("/v1/chat/completions", b"Expect: 100-continue")
    status, _, _ = await exchange(urlsplit(gw.url).port, data)
    assert status == 200
    assert "expect" not in stub.stats.headers[-1]


async def test_the_peer_is_appended_to_x_forwarded_for_and_forwarded(
    stub, gateway_factory, tokenizer_dir
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    port = urlsplit(gw.url).port
    await exchange(port, post("/v1/chat/completions"))
    assert stub.stats.headers[-1]["x-forwarded-for"] == "127.0.0.1"
    assert "forwarded" not in stub.stats.headers[-1]
    sent = post(
        "/v1/chat/completions",
        b"X-Forwarded-For: 203.0.113.7",
        b"X-Forwarded-For: 198.51.100.1",
        b"Forwarded: for=203.0.113.7;proto=https",
    )
    await exchange(port, sent)
    seen = stub.stats.headers[-1]
    assert seen["x-forwarded-for"] == "203.0.113.7, 198.51.100.1, 127.0.0.1"
    assert seen["forwarded"] == "for=203.0.113.7;proto=https, for=127.0.0.1"


async def test_forwarding_the_clients_authorization_is_the_pools_explicit_choice(
    stub, gateway_factory, tokenizer_dir
) -> None:
    kept = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    await exchange(
        urlsplit(kept.url).port, post("/v1/chat/completions", b"Authorization: Bearer u")
    )
    assert stub.stats.headers[-1]["authorization"] == "Bearer u"  # the default, as before
    policy = basic_policy(tokenizer_dir, [stub.url], forward_client_authorization=False)
    dropped = await gateway_factory(policy)
    data = post("/v1/chat/completions", b"Authorization: Bearer u")
    assert (await exchange(urlsplit(dropped.url).port, data))[0] == 200
    assert "authorization" not in stub.stats.headers[-1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_metrics_port_takes_metrics_off_the_public_port(
    stub, tokenizer_dir, tmp_path, http
) -> None:
    metrics_port = _free_port()
    policy = _tenant_policy(tokenizer_dir, [stub.url])
    policy["server"] = {"metrics_port": metrics_port}
    async with serve(write_policy(tmp_path, policy)) as gw:
        async with http.get(f"{gw.url}/metrics") as resp:
            assert resp.status == 404 and is_openai_error(await resp.json())
        async with http.get(f"{gw.url}/healthz") as resp:
            assert resp.status == 200
        async with http.get(f"{gw.url}/readyz") as resp:  # how many, not which
            assert resp.status == 200
            assert (await resp.json())["pools"] == {
                "main": {"healthy": 1, "failing": 0, "ejected": 0, "unchecked": 0}
            }
        async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
            assert resp.status == 200 and "llm_pool_capacity" in await resp.text()
        async with http.get(f"http://127.0.0.1:{metrics_port}/readyz") as resp:
            assert resp.status == 200
            assert (await resp.json())["pools"]["main"]["replicas"] == {stub.url: "healthy"}
        async with http.get(f"http://127.0.0.1:{metrics_port}/healthz") as resp:
            assert resp.status == 404


async def test_with_tenants_the_public_port_serves_no_metrics_and_names_no_replica(
    stub, gateway_factory, tokenizer_dir, tmp_path, http, caplog
) -> None:
    """No `metrics_port`: without tenants `/metrics` and the named `/readyz` stay public, as
    before; once the running policy has tenants (here by a reload) neither is, and the gateway
    says how to scrape it again."""
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    async with http.get(f"{gw.url}/metrics") as resp:
        assert resp.status == 200 and "llm_pool_capacity" in await resp.text()
    async with http.get(f"{gw.url}/readyz") as resp:
        assert (await resp.json())["pools"]["main"]["replicas"] == {stub.url: "healthy"}
    write_policy(tmp_path, _tenant_policy(tokenizer_dir, [stub.url]))
    with caplog.at_level(logging.WARNING, logger="gateway.runtime"):
        await gw.gateway.reload()
    async with http.get(f"{gw.url}/metrics") as resp:
        assert resp.status == 404 and is_openai_error(await resp.json())
    async with http.get(f"{gw.url}/readyz") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert orjson.loads(text)["pools"] == {
        "main": {"healthy": 1, "failing": 0, "ejected": 0, "unchecked": 0}
    }
    assert stub.url not in text and "acme" not in text
    assert any("server.metrics_port" in r.getMessage() for r in caplog.records)
    async with http.get(f"{gw.metrics_url}/metrics") as resp:  # where `metrics_port` serves it
        assert resp.status == 200 and "llm_pool_capacity" in await resp.text()
    async with http.get(f"{gw.metrics_url}/readyz") as resp:
        assert (await resp.json())["pools"]["main"]["replicas"] == {stub.url: "healthy"}
