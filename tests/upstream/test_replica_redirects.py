"""A replica's redirect is never followed (issue 35, item 7): a replica answering 3xx would
otherwise have the gateway fetch whatever its `Location` names, another local service included,
and relay that service's answer to a tenant. Every upstream call of the gateway is checked: the
forward stage's own client, and each aiohttp session (`replica_session`, the only maker of one).

The replicas are small aiohttp apps on loopback; the "internal service" they point at counts
every request it gets, so a followed redirect is seen even when its answer would not be.
"""

from __future__ import annotations

import ast
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.upstream import Redirected, replica_session
from tests.conftest import _serve, basic_policy, eventually

SECRET = "internal service: not for tenants"
PACKAGE = Path(__file__).resolve().parents[2] / "gateway"


@dataclass
class Internal:
    url: str
    hits: list[str]


@pytest.fixture
async def servers() -> AsyncIterator[list[web.AppRunner]]:
    runners: list[web.AppRunner] = []
    yield runners
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def internal(servers: list[web.AppRunner]) -> Internal:
    """A service the gateway can reach and a tenant must not: it answers anything with SECRET."""
    hits: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"id": "resp_x", "object": "response", "secret": SECRET})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner, url = await _serve(app)
    servers.append(runner)
    return Internal(url, hits)


async def redirecting(servers: list[web.AppRunner], to: str, **routes: Any) -> str:
    """A replica that answers `POST /v1/responses` as vLLM does (the gateway's id as the
    response's) and everything else with a 302 to `to`."""

    async def create(request: web.Request) -> web.Response:
        body = await request.json()
        usage = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}
        return web.json_response({"id": body["request_id"], "object": "response", "usage": usage})

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound(to + request.path)

    app = web.Application()
    app.router.add_post("/v1/responses", create)
    app.router.add_route("*", "/{tail:.*}", moved)
    runner, url = await _serve(app)
    servers.append(runner)
    return url


async def test_a_stored_response_redirected_elsewhere_is_a_502_and_nothing_is_fetched(
    servers, internal, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await redirecting(servers, internal.url)
    gw = await gateway_factory(basic_policy(tokenizer_dir, [replica], health={"interval_s": 0}))
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 1}
    async with http.post(f"{gw.url}/v1/responses", json=body) as resp:
        assert resp.status == 200
        made = await resp.json()
    for method, path in (("GET", ""), ("POST", "/cancel")):
        url = f"{gw.url}/v1/responses/{made['id']}{path}"
        async with http.request(method, url, allow_redirects=False) as resp:
            status, answer = resp.status, await resp.text()
            assert "Location" not in resp.headers
        assert status == 502, answer
        assert SECRET not in answer
        assert orjson.loads(answer)["error"]["type"] == "upstream_error"  # OpenAI's shape
    assert internal.hits == []


async def test_a_forwarded_request_redirected_is_a_502_without_its_location(
    servers, internal, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await redirecting(servers, internal.url)
    gw = await gateway_factory(basic_policy(tokenizer_dir, [replica], health={"interval_s": 0}))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for stream in (False, True):
        async with http.post(
            f"{gw.url}/v1/chat/completions", json={**chat, "stream": stream}, allow_redirects=False
        ) as resp:
            status, answer = resp.status, await resp.json()
            assert "Location" not in resp.headers
        assert (status, answer["error"]["type"]) == (502, "upstream_error")
    assert internal.hits == []
    await eventually(lambda: gw.inflight() == 0)


async def test_a_health_probe_redirected_to_a_healthy_service_fails(
    servers, internal, stub, gateway_factory, tokenizer_dir
) -> None:
    replica = await redirecting(servers, internal.url)
    health = {"interval_s": 0.05, "consecutive_failures": 1, "timeout_s": 1}
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url, replica], health=health))
    pool = gw.gateway.slots["main"]
    await eventually(lambda: not next(r for r in pool.replicas if r.url == replica).up)
    assert internal.hits == []


async def test_a_replica_session_refuses_every_redirect(servers, internal) -> None:
    replica = await redirecting(servers, internal.url)
    async with replica_session() as session:
        for method in ("GET", "POST", "PUT", "DELETE"):
            with pytest.raises(Redirected) as caught:
                async with session.request(method, replica + "/v1/models"):
                    pass
            assert caught.value.status == 302
    assert internal.hits == []


def test_no_module_but_upstream_makes_an_aiohttp_session() -> None:
    """One maker, so a new upstream call cannot forget the redirect refusal."""
    makers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            called = node.func if isinstance(node, ast.Call) else None
            name = getattr(called, "attr", None) or getattr(called, "id", None)
            if name == "ClientSession":
                makers.append(str(path.relative_to(PACKAGE)))
    assert makers == ["upstream.py"]
