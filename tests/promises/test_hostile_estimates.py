"""Output estimates under attack: one tenant's traffic shapes only its own estimates, a refusal no
wait can lift rests on the client's own numbers, and an estimate nothing refreshes fades away.

The attacks are issue 11's: tenant A teaches the shared system prompt a 5,000-token output, after
which tenant B (4,000 TPM) was refused for ever with `request_over_limit`; or teaches it 1 token,
after which B's requests were under-reserved and classed as A's were.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from gateway.request.estimate import RollingQuantileEstimator
from tests.conftest import RunningGateway, accounted, basic_policy
from tests.request.test_tenants import hashed

A_KEY, B_KEY = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
SYSTEM = "You review product listings against the marketplace rules. " * 8


def two_tenants(tokenizer_dir: Any, replica: str, **b: Any) -> dict[str, Any]:
    policy = basic_policy(tokenizer_dir, [replica])
    policy["tenants"] = {
        "a": {"keys": [hashed(A_KEY)], "tpm": 10_000_000},
        "b": {"keys": [hashed(B_KEY)], **b},
    }
    return policy


def review(product: str, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": product}]
    return {"model": "tiny", "messages": messages, **fields}


async def send(
    http: aiohttp.ClientSession, gw: RunningGateway, key: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"}
    logged = gw.access_log.getvalue().count(b"\n")
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
        answer = await resp.json()
        status = resp.status
    await accounted(gw, logged)
    return status, answer


def last_record(gw: RunningGateway) -> dict[str, Any]:
    record: dict[str, Any] = orjson.loads(gw.access_log.getvalue().splitlines()[-1])
    return record


async def test_a_tenant_teaching_long_outputs_leaves_another_tenants_quota_alone(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(two_tenants(tokenizer_dir, stub.url, tpm=4000))
    for i in range(22):  # past min_samples: the shared prompt "learns" 5,000 tokens for A
        status, _ = await send(http, gw, A_KEY, review(f"listing {i}", max_tokens=5000))
        assert status == 200
    status, _ = await send(http, gw, A_KEY, review("one more"))
    assert last_record(gw)["estimate_source"] == "learned"  # A's own estimate is in force

    for i in range(3):
        status, answer = await send(http, gw, B_KEY, review(f"b listing {i}"))
        assert status == 200, answer  # was 429 request_over_limit ("needs 5,149 tokens")
        record = last_record(gw)
        assert (record["tenant"], record["estimate_source"]) == ("b", "default")


async def test_a_tenant_teaching_one_token_outputs_does_not_shrink_another_tenants_reservation(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(two_tenants(tokenizer_dir, stub.url, tpm=1_000_000))
    status, _ = await send(http, gw, B_KEY, review("before"))
    before = last_record(gw)
    for i in range(22):
        status, _ = await send(http, gw, A_KEY, review(f"listing {i}", max_tokens=1))
        assert status == 200
    status, _ = await send(http, gw, B_KEY, review("after"))
    after = last_record(gw)
    assert status == 200
    assert after["estimate_source"] == before["estimate_source"] == "default"
    assert after["expected_output_tokens"] == before["expected_output_tokens"] == 512


async def test_an_output_the_gateway_guessed_never_makes_a_request_unservable(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    # 300 TPM: the model's default output (512) alone is over the window, the prompt is not.
    gw = await gateway_factory(two_tenants(tokenizer_dir, stub.url, tpm=300))
    status, answer = await send(http, gw, B_KEY, review("short"))
    assert status == 200, answer  # was 429 request_over_limit on the default estimate alone
    assert last_record(gw)["estimate_source"] == "default"

    # The client's own bound over the window still is a refusal no wait can lift.
    status, answer = await send(http, gw, B_KEY, review("short", max_tokens=1000))
    assert (status, answer["error"]["code"]) == (429, "request_over_limit")
    assert "needs 1" in answer["error"]["message"]  # input + the client's 1,000, not a guess


async def test_a_reservation_cut_to_the_window_is_settled_to_what_was_used(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(two_tenants(tokenizer_dir, stub.url, tpm=300))
    headers = {"Authorization": f"Bearer {B_KEY}"}
    logged = gw.access_log.getvalue().count(b"\n")
    async with http.post(
        f"{gw.url}/v1/chat/completions", json=review("short"), headers=headers
    ) as resp:
        assert resp.status == 200
        assert resp.headers["x-ratelimit-remaining-tokens"] == "0"  # the whole window, no more
        await resp.read()
    await accounted(gw, logged)
    first = last_record(gw)
    # The bound the gateway gave it is cut with it: the replica may produce no more than fits.
    assert stub.stats.bodies[-1]["max_completion_tokens"] == 300 - first["input_tokens"]
    assert first["input_tokens"] + first["output_tokens"] == 300


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_estimates_are_kept_per_tenant_and_bounded_per_tenant() -> None:
    est = RollingQuantileEstimator(RollingQuantileEstimator.Params(min_samples=10, max_keys=3))
    shared = ("a", "chat", "m", 1)
    for tokens in range(1, 11):
        est.observe(shared, tokens)
    assert est.estimate(shared) == 9
    assert est.estimate(("b", "chat", "m", 1)) is None  # the same prompt, another tenant
    for other in range(100):  # tenant b floods new prompts: a's estimate survives
        for _ in range(2):
            est.observe(("b", "chat", "m", 1000 + other), 5)
    assert est.estimate(shared) == 9


def test_an_estimate_nothing_refreshes_returns_to_the_prior() -> None:
    clock = Clock()
    params = RollingQuantileEstimator.Params(min_samples=5, max_age_s=600)
    est = RollingQuantileEstimator(params, clock=clock)
    key = (None, "chat", "m", 7)
    for _ in range(5):
        est.observe(key, 5000)
    assert est.estimate(key) == 5000
    clock.now += 599
    assert est.estimate(key) == 5000
    clock.now += 2
    assert est.estimate(key) is None  # forgotten: max_tokens or the model's default again
    for _ in range(4):  # and the old samples do not come back with the next few
        est.observe(key, 10)
    assert est.estimate(key) is None
    est.observe(key, 10)
    assert est.estimate(key) == 10


async def test_a_request_that_forces_its_length_reserves_that_length(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    """Issue 27: a tenant taught its estimate 1 token with `max_tokens: 1`, then sent
    `max_tokens: 7000, ignore_eos: true`: each reserved the estimate and generated 7,000."""
    gw = await gateway_factory(two_tenants(tokenizer_dir, stub.url, tpm=1_000_000))
    for _ in range(22):
        status, _ = await send(http, gw, B_KEY, review("the same listing", max_tokens=1))
        assert status == 200
    status, _ = await send(http, gw, B_KEY, review("the same listing", max_tokens=200))
    assert last_record(gw)["estimate_source"] == "learned"  # the lesson took
    assert last_record(gw)["expected_output_tokens"] == 1

    status, _ = await send(
        http, gw, B_KEY, review("the same listing", max_tokens=200, ignore_eos="true")
    )
    assert status == 200
    assert (last_record(gw)["estimate_source"], last_record(gw)["expected_output_tokens"]) == (
        "max_tokens", 200,
    )  # fmt: skip
    status, _ = await send(
        http, gw, B_KEY, review("the same listing", max_tokens=200, min_tokens=150)
    )
    assert status == 200
    assert last_record(gw)["expected_output_tokens"] == 150  # at least what it forces
    status, _ = await send(http, gw, B_KEY, review("the same listing", ignore_eos=True))
    record = last_record(gw)
    # No bound of its own: a TPM-limited tenant's request generates to the gateway's bound
    # (the model's default), not to the context's end, and reserves it.
    assert (record["estimate_source"], record["expected_output_tokens"]) == ("default", 512)
    assert stub.stats.bodies[-1]["max_completion_tokens"] == 512


async def test_min_tokens_over_max_tokens_is_refused_as_vllm_refuses_it(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(two_tenants(tokenizer_dir, stub.url, tpm=1_000_000))
    status, answer = await send(http, gw, B_KEY, review("x", max_tokens=5, min_tokens=6))
    assert (status, answer["error"]["param"]) == (400, "min_tokens")
    status, answer = await send(http, gw, B_KEY, review("x", min_tokens="many"))
    assert (status, answer["error"]["code"]) == (400, "invalid_type")


async def test_a_forced_length_over_the_whole_window_is_refused_for_good(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    """A forced length is the request's own number, as `max_tokens` is: one over the tenant's
    whole window is `request_over_limit`, not cut to the window to run and overspend it."""
    gw = await gateway_factory(two_tenants(tokenizer_dir, stub.url, tpm=2000))
    status, answer = await send(http, gw, B_KEY, review("the same listing", min_tokens=3000))
    assert (status, answer["error"]["code"]) == (429, "request_over_limit")
    # Without `max_tokens`, `ignore_eos` runs to the bound the gateway gives, within the window.
    status, _ = await send(http, gw, B_KEY, review("the same listing", ignore_eos=True))
    assert status == 200
    assert stub.stats.bodies[-1]["max_completion_tokens"] == 512
    status, _ = await send(http, gw, B_KEY, review("the same listing", min_tokens=100))
    assert status == 200
