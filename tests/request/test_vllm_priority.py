"""vLLM's own `priority`: a pool that says so sends the request's tier upstream (lower runs
first, as in vLLM's priority scheduler), and a client's own priority never reaches a replica."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from gateway.config.load import PolicyError
from gateway.policy.compile import load_policy
from tests.conftest import basic_policy, write_policy

TIERS = ("critical", "standard", "sheddable")


def chat(**extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return {**body, **extra}


async def sent_priorities(gw_url: str, stub: Any, http: Any, **body: Any) -> list[Any]:
    """What the replica got in `priority` for a request of each tier (absent: "-")."""
    start = len(stub.stats.bodies)
    for tier in TIERS:
        async with http.post(
            f"{gw_url}/v1/chat/completions", json=chat(**body), headers={"x-priority": tier}
        ) as resp:
            assert resp.status == 200
    return [b.get("priority", "-") for b in stub.stats.bodies[start:]]


async def test_the_tier_goes_upstream_lowest_first(stub, gateway_factory, tokenizer_dir, http):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url], upstream_priority=True))
    assert await sent_priorities(gw.url, stub, http) == [0, 1, 2]


async def test_a_mapping_gives_each_tier_its_number(stub, gateway_factory, tokenizer_dir, http):
    mapping = {"critical": -10, "standard": 0, "sheddable": 10}
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url], upstream_priority=mapping))
    assert await sent_priorities(gw.url, stub, http) == [-10, 0, 10]


async def test_no_priority_is_sent_by_default_and_the_body_is_untouched(
    stub, gateway_factory, tokenizer_dir, http
):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    assert await sent_priorities(gw.url, stub, http) == ["-", "-", "-"]
    assert stub.stats.bodies[-1] == chat()


@pytest.mark.parametrize("upstream", [True, False])
async def test_a_clients_priority_never_reaches_the_replica(
    stub, gateway_factory, tokenizer_dir, http, upstream
):
    """Neither in the body nor in the header vLLM reads over it (`X-Vllm-Priority`): a tenant
    that could set either would pick its own place in the replica's queue."""
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url], upstream_priority=upstream))
    async with http.post(
        f"{gw.url}/v1/chat/completions",
        json=chat(priority=-1000),
        headers={"x-priority": "sheddable", "X-Vllm-Priority": "-1000"},
    ) as resp:
        assert resp.status == 200
    assert stub.stats.bodies[-1].get("priority", "-") == (2 if upstream else "-")
    assert "x-vllm-priority" not in stub.stats.headers[-1]


async def test_a_tenants_tier_is_what_goes_upstream(stub, gateway_factory, tokenizer_dir, http):
    """With tenants, the tier is the tenant's (or lower by x-priority, never higher)."""
    policy = basic_policy(tokenizer_dir, [stub.url], upstream_priority=True)
    policy["tenants"] = {"batch": {"keys_env": "TEST_VLLM_PRIORITY_KEY", "tier": "sheddable"}}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TEST_VLLM_PRIORITY_KEY", "batch-key")
        gw = await gateway_factory(policy)
    async with http.post(
        f"{gw.url}/v1/chat/completions",
        json=chat(),
        headers={"Authorization": "Bearer batch-key", "x-priority": "critical"},
    ) as resp:
        assert resp.status == 200
    assert stub.stats.bodies[-1]["priority"] == 2


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ({"critical": 0, "standard": 1}, "give an integer for each tier"),
        ({"critical": 5, "standard": 1, "sheddable": 2}, "a higher tier needs a lower"),
        ({"critical": 0, "standard": 1, "sheddable": 2**63}, "must be <= 9223372036854775807"),
    ],
)
def test_a_mapping_must_order_every_tier(tmp_path, given, problem) -> None:
    policy = basic_policy("estimate", ["http://127.0.0.1:1"], upstream_priority=given)
    with pytest.raises(PolicyError, match=problem):
        load_policy(write_policy(tmp_path, policy), load_tokenizers=False)


def test_explain_shows_the_priority_sent(tmp_path, tokenizer_dir) -> None:
    mapping = {"critical": -1, "standard": 0, "sheddable": 1}
    policy = write_policy(
        tmp_path, basic_policy(tokenizer_dir, ["http://127.0.0.1:1"], upstream_priority=mapping)
    )
    request = tmp_path / "request.json"
    request.write_text(json.dumps(chat()))
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "explain", "--json", "--policy", str(policy), str(request)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert json.loads(out.stdout)["upstream_priority"] == 0  # standard, the default tier
