"""Tenants: the bearer key names the tenant, strangers get a 401, keys stay inside the gateway."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import aiohttp
import pytest

from gateway.config.load import PolicyError
from tests.conftest import basic_policy, eventually, write_policy

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
ACME_KEY = "sk-acme-0123456789"
BATCH_KEY = "sk-batch-9876543210"


def hashed(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def tenant_policy(tokenizer_dir: Any, replicas: list[str], **pool: Any) -> dict[str, Any]:
    policy = basic_policy(tokenizer_dir, replicas, **pool)
    policy["tenants"] = {
        "acme": {"keys": [hashed(ACME_KEY)], "tier": "critical"},
        "batch-jobs": {"keys": [hashed(BATCH_KEY)], "tier": "standard"},
    }
    return policy


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


@pytest.mark.parametrize(
    "authorization", [None, "Bearer sk-wrong", "Bearer ", "Basic " + ACME_KEY, ACME_KEY]
)
async def test_missing_or_unknown_key_is_401_in_the_openai_shape(
    stub, gateway_factory, tokenizer_dir, http, authorization
) -> None:
    gw = await gateway_factory(tenant_policy(tokenizer_dir, [stub.url]))
    headers = {} if authorization is None else {"Authorization": authorization}
    status, body, _ = await post(http, gw.url, CHAT, **headers)
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "invalid_request_error"
    assert stub.stats.headers == []  # nothing reached the replica


async def test_the_key_names_the_tenant_and_never_leaves_the_gateway(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(tenant_policy(tokenizer_dir, [stub.url]))
    status, _, _ = await post(http, gw.url, CHAT, Authorization=f"Bearer {ACME_KEY}")
    assert status == 200
    assert [h.get("authorization") for h in stub.stats.headers] == [None]
    assert ACME_KEY not in str(stub.stats.headers)
    log = gw.access_log.getvalue().decode()
    assert '"tenant":"acme"' in log
    assert ACME_KEY not in log and hashed(ACME_KEY)[7:] not in log
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        assert ACME_KEY not in await resp.text()


async def test_the_pools_own_key_replaces_the_clients(
    stub, gateway_factory, tokenizer_dir, http, monkeypatch
) -> None:
    monkeypatch.setenv("REPLICA_KEY", "replica-secret")
    gw = await gateway_factory(tenant_policy(tokenizer_dir, [stub.url], api_key_env="REPLICA_KEY"))
    status, _, _ = await post(http, gw.url, CHAT, Authorization=f"Bearer {ACME_KEY}")
    assert status == 200
    assert [h.get("authorization") for h in stub.stats.headers] == ["Bearer replica-secret"]


async def test_listing_models_needs_a_key_too(stub, gateway_factory, tokenizer_dir, http) -> None:
    gw = await gateway_factory(tenant_policy(tokenizer_dir, [stub.url]))
    async with http.get(f"{gw.url}/v1/models") as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "invalid_api_key"
    async with http.get(
        f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {ACME_KEY}"}
    ) as resp:
        assert resp.status == 200
        assert [m["id"] for m in (await resp.json())["data"]] == ["tiny", "tiny-alias"]


async def test_without_tenants_the_gateway_stays_open(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    status, _, _ = await post(http, gw.url, CHAT)
    assert status == 200
    status, _, _ = await post(http, gw.url, CHAT, Authorization="Bearer anything")
    assert status == 200
    assert stub.stats.headers[-1]["authorization"] == "Bearer anything"  # as before tenants


async def test_keys_come_from_a_secret_file_and_the_environment(
    stub, gateway_factory, tokenizer_dir, http, tmp_path, monkeypatch
) -> None:
    (tmp_path / "batch-keys").write_text(f"{BATCH_KEY}\n{hashed('sk-second')}\n")
    monkeypatch.setenv("ACME_KEYS", "sk-from-env")
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["tenants"] = {
        "acme": {"keys_env": "ACME_KEYS"},
        "batch-jobs": {"keys_file": "batch-keys", "tier": "sheddable"},
    }
    gw = await gateway_factory(policy)
    for key in ("sk-from-env", BATCH_KEY, "sk-second"):
        status, _, _ = await post(http, gw.url, CHAT, Authorization=f"Bearer {key}")
        assert status == 200, key
    log = gw.access_log.getvalue().decode()
    assert [log.count('"tenant":"acme"'), log.count('"tenant":"batch-jobs"')] == [1, 2]


def test_a_key_shared_by_two_tenants_or_a_missing_secret_is_refused(
    tmp_path, tokenizer_dir
) -> None:
    from gateway.policy.compile import load_policy

    policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:9"])
    policy["tenants"] = {
        "acme": {"keys": [hashed(ACME_KEY)]},
        "other": {"keys": [hashed(ACME_KEY)]},
        "ghost": {"keys_file": "no-such-file"},
        "unset": {"keys_env": "LLM_GATEWAY_TEST_UNSET_VARIABLE"},
    }
    with pytest.raises(PolicyError) as raised:
        load_policy(write_policy(tmp_path, policy))
    text = str(raised.value)
    assert "also 'acme'" in text and "tenants.ghost.keys_file" in text
    assert "LLM_GATEWAY_TEST_UNSET_VARIABLE is not set" in text
    assert ACME_KEY not in text and hashed(ACME_KEY) not in text


async def test_x_priority_lowers_the_tier_but_never_raises_it(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=0.3)
    gw = await gateway_factory(tenant_policy(tokenizer_dir, [slow.url], max_concurrency=1))
    acme, batch = f"Bearer {ACME_KEY}", f"Bearer {BATCH_KEY}"
    first = asyncio.create_task(post(http, gw.url, CHAT, Authorization=acme))
    await eventually(lambda: gw.inflight() == 1)
    order: list[str] = []

    async def tagged(tag: str, **headers: str) -> None:
        body = {**CHAT, "messages": [{"role": "user", "content": tag}]}
        status, _, _ = await post(http, gw.url, body, **headers)
        assert status == 200
        order.append(tag)

    waiters = []
    for expected, (tag, headers) in enumerate(
        [
            ("standard-asking-critical", {"Authorization": batch, "x-priority": "critical"}),
            ("critical-asking-sheddable", {"Authorization": acme, "x-priority": "sheddable"}),
            ("critical", {"Authorization": acme}),
        ],
        start=1,
    ):
        waiters.append(asyncio.create_task(tagged(tag, **headers)))
        await eventually(lambda n=expected: gw.waiting() == n)
    await asyncio.gather(first, *waiters)
    assert order == ["critical", "standard-asking-critical", "critical-asking-sheddable"]


async def test_a_reload_swaps_keys_and_limits_and_keeps_the_windows(
    stub, gateway_factory, tokenizer_dir, http, tmp_path
) -> None:
    policy = tenant_policy(tokenizer_dir, [stub.url])
    policy["tenants"]["acme"]["rpm"] = 3
    gw = await gateway_factory(policy)
    acme = {"Authorization": f"Bearer {ACME_KEY}"}
    status, _, headers = await post(http, gw.url, CHAT, **acme)
    assert (status, headers["x-ratelimit-remaining-requests"]) == (200, "2")
    policy["tenants"]["acme"]["rpm"] = 2
    policy["tenants"]["newcomer"] = {"keys": [hashed("sk-new")]}
    del policy["tenants"]["batch-jobs"]
    write_policy(tmp_path, policy)
    await gw.gateway.reload()
    status, _, headers = await post(http, gw.url, CHAT, **acme)
    assert (status, headers["x-ratelimit-remaining-requests"]) == (200, "0")  # 2 of the new 2
    assert (await post(http, gw.url, CHAT, **acme))[0] == 429
    assert (await post(http, gw.url, CHAT, Authorization="Bearer sk-new"))[0] == 200
    assert (await post(http, gw.url, CHAT, Authorization=f"Bearer {BATCH_KEY}"))[0] == 401
