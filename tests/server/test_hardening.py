"""Hostile clients: size limits, slow loris, smuggling, and no say over which upstream is contacted.

Most tests talk raw HTTP/1.1 over a loopback socket, because a real client library would refuse to
send (or would fix up) exactly what these tests need to send.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import orjson
import pytest

from tests.conftest import basic_policy

MESSAGES = [{"role": "user", "content": "hello"}]
BOUND_S = 10.0  # generous: only "the server closed it", never how fast


@pytest.fixture
async def gw(stub, gateway_factory, tokenizer_dir):
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["server"] = {
        "max_headers": 16,
        "max_header_bytes": 2048,
        "max_json_depth": 8,
        "max_messages": 4,
        "max_content_parts": 4,
        "max_n": 4,
        "max_prompt_chars": 100,
        "idle_timeout_s": 0.5,
        "body_timeout_s": 0.5,
    }
    return await gateway_factory(policy)


async def _exchange(url: str, head: bytes, body: bytes = b"") -> bytes:
    """Send `head` and `body` on a fresh connection; return all the server sent until it closed."""
    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        writer.write(head + body)
        await writer.drain()
        async with asyncio.timeout(BOUND_S):
            return await reader.read()
    finally:
        writer.close()


def _request(url: str, body: bytes, *, extra: str = "") -> bytes:
    host = urlsplit(url).netloc
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    ).encode()


def _status_and_error(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    answer_body = orjson.loads(body) if body.startswith(b"{") else {}
    return status, answer_body.get("error", {})


def _chat(**fields: object) -> bytes:
    return orjson.dumps({"model": "tiny", "messages": MESSAGES, **fields})


@pytest.mark.parametrize(
    ("endpoint", "body", "code", "param"),
    [
        ("chat/completions", _chat(extra={"a": [[[[[[[[1]]]]]]]]}), "json_too_deep", None),
        ("chat/completions", _chat(messages=MESSAGES * 5), "too_many_messages", "messages"),
        (
            "chat/completions",
            _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 3}] * 2),
            "too_many_parts",
            "messages",
        ),
        (
            "chat/completions",
            _chat(messages=[{"role": "user", "content": "x" * 60}] * 2),
            "prompt_too_long",
            "messages",
        ),
        (
            "chat/completions",
            _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x" * 101}]}]),
            "prompt_too_long",
            "messages",
        ),
        (
            "completions",
            orjson.dumps({"model": "tiny", "prompt": ["x" * 50, "y" * 51]}),
            "prompt_too_long",
            "prompt",
        ),
        ("chat/completions", _chat(n=5, max_tokens=1000), "too_many_choices", "n"),
        (
            "completions",
            orjson.dumps({"model": "tiny", "prompt": "x", "n": 5}),
            "too_many_choices",
            "n",
        ),
    ],
)
async def test_body_limits_are_400_before_any_tokenizer_work(
    gw, stub, http, endpoint, body, code, param
) -> None:
    async with http.post(
        f"{gw.url}/v1/{endpoint}", data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["code"] == code and error["param"] == param
    assert stub.stats.requests == 0 and gw.inflight() == 0


async def test_at_the_limits_is_served(gw, stub, http) -> None:
    body = {
        "model": "tiny",
        # 100 characters a template may print: four roles of 4 and four contents of 21
        "messages": [{"role": "user", "content": "x" * 21}] * 4,
        "extra": {"a": [[[[[1]]]]]},  # depth 7 with the body itself
        "n": 4,
    }
    async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    assert stub.stats.requests == 1


@pytest.mark.parametrize(
    "extra",
    [
        "".join(f"X-Pad-{i}: 1\r\n" for i in range(20)),  # 26 fields, over 16
        "".join(f"X-Pad-{i}: {'v' * 400}\r\n" for i in range(6)),  # 2.4 KB, over 2 KB
    ],
)
async def test_headers_over_the_limit_are_431(gw, stub, extra) -> None:
    body = _chat()
    status, error = _status_and_error(
        await _exchange(gw.url, _request(gw.url, body, extra=extra), body)
    )
    assert status == 431
    assert error["code"] == "headers_too_large" and error["type"] == "invalid_request_error"
    assert stub.stats.requests == 0


@pytest.mark.parametrize(
    "extra",
    [
        "".join(f"X-Pad-{i}: 1\r\n" for i in range(40)),  # past the parser's 2 x 16 backstop
        f"X-Pad: {'v' * 3000}\r\n",  # one line longer than all headers may be
    ],
)
async def test_parser_backstop_refuses_and_closes(gw, stub, extra) -> None:
    answer = await _exchange(gw.url, _request(gw.url, b"", extra=extra))
    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n", 1)[0]
    assert stub.stats.requests == 0


async def test_headers_sent_byte_by_byte_are_cut_off(gw, stub) -> None:
    address = urlsplit(gw.url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    head = _request(gw.url, _chat())
    try:
        async with asyncio.timeout(BOUND_S):
            for byte in head[:-2]:  # never the blank line that ends the head
                if reader.at_eof():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.01)
            assert await reader.read() == b""  # closed, without an answer
    except ConnectionResetError:
        pass  # closed while we were writing: just as good
    finally:
        writer.close()
    assert stub.stats.requests == 0


async def test_idle_connection_is_closed(gw) -> None:
    address = urlsplit(gw.url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        async with asyncio.timeout(BOUND_S):
            assert await reader.read() == b""
    finally:
        writer.close()


async def test_body_never_finished_is_408_and_closed(gw, stub) -> None:
    body = _chat()
    answer = await _exchange(gw.url, _request(gw.url, body + b" " * 100), body)  # 100 bytes short
    status, error = _status_and_error(answer)
    assert status == 408 and error["code"] == "request_timeout"
    assert stub.stats.requests == 0
    assert gw.inflight() == 0 and gw.inflight_tokens() == 0 and gw.waiting() == 0
    assert b'"reason":"request_timeout"' in gw.access_log.getvalue()


@pytest.mark.parametrize(
    "framing",
    [
        "Transfer-Encoding: chunked\r\n",  # with the Content-Length _request sends
        "Content-Length: 3\r\n",  # a second, different length
    ],
)
async def test_ambiguous_framing_is_refused(gw, stub, framing) -> None:
    body = _chat()
    answer = await _exchange(gw.url, _request(gw.url, body, extra=framing), body)
    assert b" 400 " in answer.split(b"\r\n", 1)[0]
    assert stub.stats.requests == 0


async def test_connection_nominated_headers_are_not_forwarded(gw, stub) -> None:
    body = _chat()
    head = _request(gw.url, body, extra="X-Secret: 1\r\nX-Kept: 1\r\n").replace(
        b"Connection: close", b"Connection: close, X-Secret"
    )
    status, _ = _status_and_error(await _exchange(gw.url, head, body))
    assert status == 200
    (sent,) = stub.stats.headers
    assert "x-secret" not in sent and "connection" not in sent
    assert sent["x-kept"] == "1"


async def test_the_client_never_chooses_the_upstream(gw, stub, stub_factory) -> None:
    """Absolute-form target, a hostile Host and X-Forwarded-Host all name another server: the
    request still goes to the configured replica, and the other server hears nothing."""
    other = await stub_factory()
    elsewhere = urlsplit(other.url).netloc
    body = _chat()
    head = (
        f"POST http://{elsewhere}/v1/chat/completions HTTP/1.1\r\nHost: {elsewhere}\r\n"
        f"X-Forwarded-Host: {elsewhere}\r\nForwarded: host={elsewhere}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    status, _ = _status_and_error(await _exchange(gw.url, head, body))
    assert status == 200
    assert stub.stats.requests == 1 and other.stats.requests == 0
    assert stub.stats.headers[0]["host"] == urlsplit(stub.url).netloc
