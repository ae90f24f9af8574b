"""Prefix-cache hits as vLLM reports them (`--enable-prompt-tokens-details`): each API's cached
tokens read from the answer, whole or streamed, into the access log and the tenant's
`cached_input` tokens; a replica that claims more than the prompt is not believed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from loadtest.sim import Profile, ReplicaOptions, start_replica
from tests.conftest import _serve, accounted, basic_policy
from tests.loadtest.test_simulator import write_profile
from tests.request.test_tenants import hashed

KEY = "sk-tenant-cache-0123456789"
HEADERS = {"Authorization": f"Bearer {KEY}"}
RULES = "You label product reviews. " * 40  # a shared prefix of many cache blocks


@pytest.fixture
def tiny(tmp_path: Path) -> Profile:
    return write_profile(tmp_path)


def tenant_policy(tokenizer_dir: Path, replica: str) -> dict[str, Any]:
    policy = basic_policy(tokenizer_dir, [replica])
    policy["tenants"] = {"acme": {"keys": [hashed(KEY)]}}
    return policy


def logged(gw: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def tenant_tokens(http: Any, gw: Any) -> dict[str, float]:
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    return {
        s.labels["direction"]: s.value
        for s in families["llm_tenant_tokens"].samples
        if s.name.endswith("_total")
    }


BODIES = {  # each API's request for the same rules and a different question
    "/v1/chat/completions": lambda q, stream: {
        "model": "tiny", "max_tokens": 2, "stream": stream,
        "messages": [{"role": "system", "content": RULES}, {"role": "user", "content": q}],
    },
    "/v1/messages": lambda q, stream: {
        "model": "tiny", "max_tokens": 2, "stream": stream, "system": RULES,
        "messages": [{"role": "user", "content": q}],
    },
    "/v1/responses": lambda q, stream: {
        "model": "tiny", "max_output_tokens": 2, "stream": stream, "instructions": RULES,
        "input": q,
    },
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("stream", [False, True])
async def test_cached_tokens_reach_the_log_and_the_tenants_tokens(
    tiny, tokenizer_dir, gateway_factory, http, path, stream
) -> None:
    options = ReplicaOptions(
        time_scale=1000, tokenizer=tokenizer_dir, enable_prompt_tokens_details=True
    )
    replica = await start_replica(tiny, options)
    try:
        gw = await gateway_factory(tenant_policy(tokenizer_dir, replica.url))
        for question in ("Is it good?", "Is it bad?"):
            async with http.post(
                gw.url + path, json=BODIES[path](question, stream), headers=HEADERS
            ) as resp:
                assert resp.status == 200
                await resp.read()
        await accounted(gw, 1)
    finally:
        await replica.close()
    first, second = logged(gw)
    assert first["cached_tokens"] == 0  # a cold cache
    # The rules' full blocks were served from the cache the second time.
    assert 0 < second["cached_tokens"] < second["input_tokens"]
    tokens = await tenant_tokens(http, gw)
    assert tokens["cached_input"] == second["cached_tokens"]
    assert tokens["input"] == first["input_tokens"] + second["input_tokens"]


async def test_without_the_flag_the_log_says_nothing(tiny, tokenizer_dir, gateway_factory, http):
    replica = await start_replica(tiny, ReplicaOptions(time_scale=1000, tokenizer=tokenizer_dir))
    try:
        gw = await gateway_factory(tenant_policy(tokenizer_dir, replica.url))
        body = BODIES["/v1/chat/completions"]("Is it good?", False)
        async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=HEADERS) as resp:
            await resp.read()
        await accounted(gw, 0)
    finally:
        await replica.close()
    (line,) = logged(gw)
    assert line["cached_tokens"] is None
    assert "cached_input" not in await tenant_tokens(http, gw)


async def test_more_cached_tokens_than_the_prompt_are_not_believed(
    tokenizer_dir, gateway_factory, http
) -> None:
    async def lying(request: web.Request) -> web.Response:
        usage = {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21,
                 "prompt_tokens_details": {"cached_tokens": 10**6}}  # fmt: skip
        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"},
                  "finish_reason": "stop"}  # fmt: skip
        return web.json_response({"id": "c", "object": "chat.completion", "model": "tiny",
                                  "choices": [choice], "usage": usage})  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/chat/completions", lying)
    runner, url = await _serve(app)
    try:
        gw = await gateway_factory(tenant_policy(tokenizer_dir, url))
        body = BODIES["/v1/chat/completions"]("Is it good?", False)
        async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=HEADERS) as resp:
            assert resp.status == 200
        await accounted(gw, 0)
    finally:
        await runner.cleanup()
    (line,) = logged(gw)
    assert line["cached_tokens"] is None
    assert "cached_input" not in await tenant_tokens(http, gw)
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        assert 'llm_untrusted_usage_total{field="cached_tokens"' in await resp.text()
