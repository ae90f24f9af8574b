"""Tenant quotas: TPM and RPM reserved at admission over an exact sliding window, then corrected
to real usage; 429 with the window's Retry-After; x-ratelimit headers on every response.

The gateway's in-memory state takes an injectable clock, so a test moves time forward instead
of sleeping through a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.load import PolicyError
from gateway.policy.compile import load_policy
from gateway.request.quota import duration
from gateway.state import WINDOW_S, Limit, MemoryState, Reservation, WindowFull
from tests.conftest import RunningGateway, accounted, basic_policy, eventually, write_policy
from tests.request.test_tenants import ACME_KEY, hashed

AUTH = {"Authorization": f"Bearer {ACME_KEY}"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def quota_policy(tokenizer_dir: Any, replicas: list[str], **tenant: Any) -> dict[str, Any]:
    policy = basic_policy(tokenizer_dir, replicas)
    policy["tenants"] = {"acme": {"keys": [hashed(ACME_KEY)], **tenant}}
    return policy


async def with_clock(gw: RunningGateway) -> Clock:
    clock = Clock()
    gw.gateway.state.clock = clock  # type: ignore[attr-defined]
    return clock


async def chat(
    http: aiohttp.ClientSession, gw: RunningGateway, body: dict[str, Any]
) -> tuple[int, dict[str, Any], dict[str, str]]:
    logged = gw.access_log.getvalue().count(b"\n")
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=AUTH) as resp:
        answer = await resp.json() if resp.content_type == "application/json" else {}
        result = resp.status, answer, dict(resp.headers)
    await accounted(gw, logged)  # its charge is corrected
    return result


async def sized(gw: RunningGateway, tokens: int) -> dict[str, Any]:
    """A chat body whose input + max_tokens is exactly `tokens`; the stub generates max_tokens."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count me " * 50}]}
    counted = await gw.gateway.policy.models["tiny"].counter.count_chat(body)
    return {**body, "max_tokens": tokens - counted}


async def test_a_tenant_at_10000_tpm_gets_its_third_4000_token_request_refused_until_the_window_moves(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(quota_policy(tokenizer_dir, [stub.url], tpm=10_000))
    clock = await with_clock(gw)
    body = await sized(gw, 4000)

    status, _, headers = await chat(http, gw, body)
    assert status == 200
    assert headers["x-ratelimit-limit-tokens"] == "10000"
    assert headers["x-ratelimit-remaining-tokens"] == "6000"
    assert headers["x-ratelimit-reset-tokens"] == "1m0s"

    clock.now += 10
    status, _, headers = await chat(http, gw, body)
    assert (status, headers["x-ratelimit-remaining-tokens"]) == (200, "2000")

    clock.now += 5  # 15 s after the first: it leaves the window 45 s from now
    status, error, headers = await chat(http, gw, body)
    assert status == 429
    assert error["error"]["code"] == "rate_limit_exceeded"
    assert headers["Retry-After"] == "45"
    assert headers["x-ratelimit-remaining-tokens"] == "2000"
    assert len(stub.stats.bodies) == 2  # the refused one never reached the replica

    clock.now += 44.5  # not yet
    assert (await chat(http, gw, body))[0] == 429
    clock.now += 0.5  # the first request's charge has left the window
    status, _, headers = await chat(http, gw, body)
    assert (status, headers["x-ratelimit-remaining-tokens"]) == (200, "2000")
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    assert 'llm_quota_rejections_total{kind="tokens",tenant="acme"} 2.0' in text
    assert 'llm_tenant_tokens_total{direction="input",tenant="acme"}' in text


async def test_a_client_that_leaves_mid_stream_is_charged_what_it_was_sent(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    """Its final usage never came: it is charged the running usage (`continuous_usage_stats`,
    asked on its behalf) of the last chunk relayed, not the 500 reserved (multi-token chunks:
    tests/promises/test_quota_promise.py)."""
    stub = await stub_factory(chunk_delay_s=0.05)
    gw = await gateway_factory(quota_policy(tokenizer_dir, [stub.url], tpm=100_000))
    await with_clock(gw)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
    counted = await gw.gateway.policy.models["tiny"].counter.count_chat(body)
    async with aiohttp.ClientSession() as leaver:
        async with leaver.post(
            f"{gw.url}/v1/chat/completions", json={**body, "stream": True}, headers=AUTH
        ) as resp:
            assert resp.headers["x-ratelimit-remaining-tokens"] == str(100_000 - counted - 500)
            await resp.content.readuntil(b"\n\n")
            await resp.content.readuntil(b"\n\n")
    await eventually(lambda: b"client_disconnect" in gw.access_log.getvalue())
    await eventually(lambda: gw.gateway.quotas.pending == 0)
    sent = orjson.loads(gw.access_log.getvalue().splitlines()[-1])["output_tokens"]
    assert 2 <= sent < 500
    status, _, headers = await chat(http, gw, {**body, "max_tokens": 1})
    assert status == 200
    remaining = 100_000 - (counted + sent) - (counted + 1)
    assert headers["x-ratelimit-remaining-tokens"] == str(remaining)


async def test_rpm_refuses_the_request_over_the_limit_and_every_answer_carries_the_headers(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    failing = await stub_factory(status=500)
    gw = await gateway_factory(quota_policy(tokenizer_dir, [failing.url], rpm=2, tpm=50_000))
    clock = await with_clock(gw)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    status, _, headers = await chat(http, gw, body)
    assert status == 500  # the replica's own error, with the tenant's windows
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-limit-tokens"] == "50000"
    clock.now += 30
    status, _, headers = await chat(http, gw, body)
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "1m0s"
    status, error, headers = await chat(http, gw, body)
    assert status == 429 and error["error"]["code"] == "rate_limit_exceeded"
    assert headers["Retry-After"] == "30"
    assert "requests per minute" in error["error"]["message"]
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        assert 'llm_quota_rejections_total{kind="requests",tenant="acme"} 1.0' in await resp.text()


async def test_a_bad_request_of_a_known_tenant_gets_the_headers_and_costs_nothing(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(quota_policy(tokenizer_dir, [stub.url], tpm=10_000, rpm=5))
    await with_clock(gw)
    body = await sized(gw, 1000)
    assert (await chat(http, gw, body))[0] == 200
    for bad in ({**body, "max_tokens": 0}, {**body, "model": "unknown"}):
        status, _, headers = await chat(http, gw, bad)
        assert status in (400, 404)
        assert headers["x-ratelimit-remaining-tokens"] == "9000"
        assert headers["x-ratelimit-remaining-requests"] == "4"


async def test_a_request_that_never_reached_a_replica_gets_its_tokens_back(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=0.5)
    policy = quota_policy(tokenizer_dir, [slow.url], tpm=10_000)
    policy["pools"]["main"].update(max_concurrency=1, queue={"max_depth": 0})
    gw = await gateway_factory(policy)
    await with_clock(gw)
    body = await sized(gw, 1000)
    running = asyncio.create_task(chat(http, gw, body))
    await eventually(lambda: gw.inflight() == 1)
    status, error, headers = await chat(http, gw, body)
    assert (status, error["error"]["code"]) == (429, "queue_full")
    assert headers["x-ratelimit-remaining-tokens"] == "8000"  # as charged at admission
    assert (await running)[0] == 200
    status, _, headers = await chat(http, gw, body)
    assert (status, headers["x-ratelimit-remaining-tokens"]) == (200, "8000")  # refunded


async def test_a_request_larger_than_the_whole_limit_is_refused_without_retry_after(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(quota_policy(tokenizer_dir, [stub.url], tpm=1000))
    status, error, headers = await chat(http, gw, await sized(gw, 1001))
    assert (status, error["error"]["code"]) == (429, "request_over_limit")
    assert "Retry-After" not in headers


async def test_without_limits_a_tenant_gets_no_ratelimit_headers(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(quota_policy(tokenizer_dir, [stub.url]))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    status, _, headers = await chat(http, gw, body)
    assert status == 200 and not any(h.startswith("x-ratelimit") for h in headers)


arrivals = st.lists(
    st.tuples(st.floats(min_value=0, max_value=200, allow_nan=False), st.integers(1, 400)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(arrivals=arrivals, limit=st.integers(1, 1000))
async def test_no_window_of_a_minute_ever_holds_more_than_the_limit(
    arrivals: list[tuple[float, int]], limit: int
) -> None:
    clock = Clock()
    state = MemoryState(clock)
    granted: list[tuple[float, int]] = []
    for at, amount in sorted(arrivals):
        clock.now = at
        result = await state.reserve([Limit("k", amount, limit)])
        if isinstance(result, Reservation):
            granted.append((at, amount))
            assert result.windows[0].remaining == limit - sum(
                a for t, a in granted if t > at - WINDOW_S
            )
        else:
            assert isinstance(result, WindowFull)
            in_window = sum(a for t, a in granted if t > at - WINDOW_S)
            assert in_window + amount > limit  # refused only when it did not fit
            if amount <= limit:  # Retry-After is exactly when enough has left
                assert result.retry_after_s is not None
                later = at + result.retry_after_s
                after, before = later + 1e-6, later - 1e-6
                assert sum(a for t, a in granted if t > after - WINDOW_S) + amount <= limit
                assert sum(a for t, a in granted if t > before - WINDOW_S) + amount > limit
            else:
                assert result.retry_after_s is None
    for start, _ in granted:  # every minute starting at a charge (the worst case)
        assert sum(a for t, a in granted if start <= t < start + WINDOW_S) <= limit


@settings(max_examples=200, deadline=None)
@given(arrivals=arrivals)
async def test_a_refusal_charges_no_window(arrivals: list[tuple[float, int]]) -> None:
    """Tokens and requests are charged together or not at all: a request refused for RPM
    spends no tokens, and one refused for TPM is not counted as a request."""
    clock = Clock()
    state = MemoryState(clock)
    granted: list[tuple[float, int]] = []
    for at, amount in sorted(arrivals):
        clock.now = at
        result = await state.reserve([Limit("tokens", amount, 1000), Limit("requests", 1, 3)])
        tokens = sum(a for t, a in granted if t > at - WINDOW_S)
        requests = sum(1 for t, _ in granted if t > at - WINDOW_S)
        if isinstance(result, Reservation):
            granted.append((at, amount))
            assert [w.remaining for w in result.windows] == [
                1000 - tokens - amount,
                3 - requests - 1,
            ]
        else:
            assert [w.remaining for w in result.windows] == [1000 - tokens, 3 - requests]


async def test_a_client_that_leaves_while_queued_is_refunded(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    slow = await stub_factory(delay_s=0.3)
    policy = quota_policy(tokenizer_dir, [slow.url], tpm=10_000)
    policy["pools"]["main"]["max_concurrency"] = 1
    gw = await gateway_factory(policy)
    await with_clock(gw)
    body = await sized(gw, 1000)
    running = asyncio.create_task(chat(http, gw, body))
    await eventually(lambda: gw.inflight() == 1)
    async with aiohttp.ClientSession() as leaver:
        queued = asyncio.create_task(
            leaver.post(f"{gw.url}/v1/chat/completions", json=body, headers=AUTH)
        )
        await eventually(lambda: gw.waiting() == 1)
        queued.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await queued
    await eventually(lambda: b"client_disconnect" in gw.access_log.getvalue())
    assert (await running)[0] == 200
    status, _, headers = await chat(http, gw, body)
    assert (status, headers["x-ratelimit-remaining-tokens"]) == (200, "8000")
    assert gw.inflight() == 0 and gw.waiting() == 0


async def test_limits_per_model_and_pool_apply_on_top_and_the_tightest_is_reported(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    policy = quota_policy(
        tokenizer_dir, [stub.url], tpm=100_000, rpm=100, pools={"main": {"tpm": 2500}}
    )
    gw = await gateway_factory(policy)
    clock = await with_clock(gw)
    body = await sized(gw, 1000)
    status, _, headers = await chat(http, gw, body)
    assert status == 200
    assert headers["x-ratelimit-limit-tokens"] == "2500"  # the pool's window binds
    assert headers["x-ratelimit-remaining-tokens"] == "1500"
    assert headers["x-ratelimit-limit-requests"] == "100"
    clock.now += 1
    assert (await chat(http, gw, body))[0] == 200
    status, error, headers = await chat(http, gw, body)
    assert status == 429 and "on pool main" in error["error"]["message"]
    assert headers["Retry-After"] == "59"
    assert headers["x-ratelimit-remaining-requests"] == "98"  # the refusal charged nothing


async def test_a_model_limit_counts_requests_to_that_model(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(quota_policy(tokenizer_dir, [stub.url], models={"tiny": {"rpm": 1}}))
    await with_clock(gw)
    body = {"model": "tiny-alias", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, _, headers = await chat(http, gw, body)
    assert (status, headers["x-ratelimit-remaining-requests"]) == (200, "0")
    status, error, _ = await chat(http, gw, body)  # the alias serves the same model
    assert status == 429 and "on model tiny" in error["error"]["message"]


def test_limits_for_an_unknown_model_or_pool_are_refused(tmp_path, tokenizer_dir) -> None:
    policy = quota_policy(
        tokenizer_dir, ["http://127.0.0.1:9"], models={"nope": {"tpm": 5}}, pools={"gone": {}}
    )
    with pytest.raises(PolicyError) as raised:
        load_policy(write_policy(tmp_path, policy))
    assert "tenants.acme.models.nope: unknown model 'nope'" in str(raised.value)
    assert "tenants.acme.pools.gone: unknown pool 'gone'" in str(raised.value)


@pytest.mark.parametrize(
    ("seconds", "header"),
    [
        (0.0, "0s"), (0.0004, "0s"), (0.02, "20ms"), (0.9996, "1s"), (1.0, "1s"), (1.5, "1.5s"),
        (59.899, "59.899s"), (59.9996, "1m0s"), (60.0, "1m0s"), (61.5, "1m1.5s"), (360.0, "6m0s"),
    ],
)  # fmt: skip
def test_a_reset_is_written_one_way_openais(seconds: float, header: str) -> None:
    """Issue 27: one window's reset read `1m0s`, `60s` or `59.899s` by the instant."""
    assert duration(seconds) == header
