"""Cheap refusals first: a request its tenant's windows cannot admit is refused before its
prompt is counted, and `/tokenize` / `/detokenize` are charged to the tenant's request rate.

"Counted" is observed on the model's own counter: its class is swapped for a subclass that
records every call of its counting entry points (and can hold one until the test lets it go),
so a refusal that spent tokenizer time shows up as a call, whatever the counter does inside.
The gateway is real, on loopback, with a stub replica; the burst runs on a real redis-server.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp

from gateway.state import Limit, TenantWindow
from tests.conftest import RedisServer, RunningGateway, accounted, eventually
from tests.request.test_quotas import AUTH, chat, quota_policy, sized, with_clock

TOKENS, REQUESTS = TenantWindow("acme", "tokens"), TenantWindow("acme", "requests")


class Spy:
    """The calls the gateway made to a model's counter; `gate`, when set, holds each count
    until it is set (a prompt that takes the tokenizer a while)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None

    async def enter(self, name: str) -> None:
        self.calls.append(name)
        if self.gate is not None:
            await self.gate.wait()


def spy_on(gw: RunningGateway, spy: Spy | None = None) -> Spy:
    """Swap the `tiny` model's counter's class for a subclass recording into `spy`."""
    spy = spy or Spy()
    counter = gw.gateway.policy.models["tiny"].counter
    base = type(counter)

    class Recording(base):  # type: ignore[valid-type, misc]
        async def count_chat(self, body: dict[str, Any], refuse_at: int | None = None) -> int:
            await spy.enter("count_chat")
            return await super().count_chat(body, refuse_at)  # type: ignore[no-any-return]

        async def count_prompts(
            self, prompt: Any, refuse_at: int | None = None, special: bool = True
        ) -> list[int]:
            await spy.enter("count_prompts")
            return await super().count_prompts(prompt, refuse_at, special)  # type: ignore[no-any-return]

        async def prompt_ids(self, *args: Any, **kwargs: Any) -> list[int] | None:
            await spy.enter("prompt_ids")
            return await super().prompt_ids(*args, **kwargs)  # type: ignore[no-any-return]

        async def decode(self, ids: list[int]) -> str:
            await spy.enter("decode")
            return await super().decode(ids)  # type: ignore[no-any-return]

    counter.__class__ = Recording
    return spy


def prose(words: int) -> str:
    return "the quick brown fox jumps over a lazy dog " * (words // 9)


async def post(
    http: aiohttp.ClientSession, gw: RunningGateway, path: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """A call to `path` as the tenant, once its accounting (if any) is done."""
    logged = gw.access_log.getvalue().count(b"\n")
    async with http.post(f"{gw.url}{path}", json=body, headers=AUTH) as resp:
        answer = await resp.json()
        result = resp.status, answer, dict(resp.headers)
    if path.startswith("/v1/"):
        await accounted(gw, logged)
    return result


def roomy(policy: dict[str, Any]) -> dict[str, Any]:
    """`policy` with a context long enough for a 9,000-token request."""
    policy["models"]["tiny"]["max_model_len"] = 32_768
    return policy


async def rejections(http: aiohttp.ClientSession, gw: RunningGateway, kind: str) -> str:
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    prefix = f'llm_quota_rejections_total{{kind="{kind}",tenant="acme"}} '
    return next((line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)), "")


async def test_a_tenant_out_of_requests_is_refused_before_its_prompt_is_counted(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(quota_policy(tokenizer_dir, [stub.url], rpm=1, tpm=1_000_000))
    await with_clock(gw)
    spy = spy_on(gw)
    small = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    status, _, headers = await chat(http, gw, small)
    assert status == 200 and spy.calls == ["count_chat"]  # an admitted request is counted
    assert headers["x-ratelimit-remaining-requests"] == "0"

    long = {**small, "messages": [{"role": "user", "content": prose(2_000)}]}  # ~6,200 tokens
    completion = {"model": "tiny", "prompt": prose(2_000), "max_tokens": 5}
    for path, body in (("/v1/chat/completions", long), ("/v1/completions", completion)):
        status, error, headers = await post(http, gw, path, body)
        assert spy.calls == ["count_chat"]  # the refused prompt never reached the counter
        assert (status, error["error"]["code"]) == (429, "rate_limit_exceeded")
        assert headers["Retry-After"] == "60"
        assert headers["x-ratelimit-remaining-requests"] == "0"
    assert len(stub.stats.bodies) == 1
    assert await rejections(http, gw, "requests") == "2.0"
    refused = gw.access_log.getvalue().splitlines()[-2:]
    assert all(
        b'"status":429' in line and b'"reason":"rate_limit_exceeded"' in line for line in refused
    )
    assert all(b'"input_tokens":0' in line for line in refused)  # never counted


async def test_a_tenant_whose_tokens_cannot_fit_the_smallest_request_is_refused_before_counting(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(roomy(quota_policy(tokenizer_dir, [stub.url], tpm=10_000)))
    clock = await with_clock(gw)
    first = await sized(gw, 9_000)
    spy = spy_on(gw)
    status, _, headers = await chat(http, gw, first)
    assert status == 200 and spy.calls == ["count_chat"]
    assert headers["x-ratelimit-remaining-tokens"] == "1000"  # its tokens charged once
    clock.now += 15

    # A chat asking for more output than the window has left; a completion whose text alone
    # provably has more tokens than that (its floor: 15 bytes a token at most, here).
    wants = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1001}
    long = {"model": "tiny", "prompt": prose(4_000), "max_tokens": 1}
    for path, body in (("/v1/chat/completions", wants), ("/v1/completions", long)):
        status, error, headers = await post(http, gw, path, body)
        assert spy.calls == ["count_chat"]
        assert (status, error["error"]["code"]) == (429, "rate_limit_exceeded")
        assert headers["Retry-After"] == "45"
        assert headers["x-ratelimit-remaining-tokens"] == "1000"
    # A prompt whose floor alone is over the whole window: refused for good, uncounted.
    status, error, headers = await post(
        http, gw, "/v1/completions", {**long, "prompt": prose(40_000)}
    )
    assert spy.calls == ["count_chat"]
    assert (status, error["error"]["code"]) == (429, "request_over_limit")
    assert "Retry-After" not in headers
    assert await rejections(http, gw, "tokens") == "3.0"

    small = {"model": "tiny", "prompt": "hello there", "max_tokens": 5}
    status, _, headers = await post(http, gw, "/v1/completions", small)
    assert status == 200 and spy.calls == ["count_chat", "count_prompts"]
    await eventually(lambda: gw.gateway.quotas.pending == 0)
    [counted] = await gw.gateway.policy.models["tiny"].counter.count_prompts("hello there")
    windows = await gw.gateway.state.peek([Limit(TOKENS, 0, 10_000)])
    assert windows[0].remaining == 1000 - (counted + 5)  # settled to real use, exactly once


async def test_a_request_refused_after_counting_gives_its_early_tokens_back_and_counts_as_one(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    """Its output fits what is left, its prompt does not: counted, then refused. The tokens held
    before counting come back; the request stays counted, as every request that reached the
    tokenizer does."""
    gw = await gateway_factory(roomy(quota_policy(tokenizer_dir, [stub.url], tpm=10_000, rpm=10)))
    await with_clock(gw)
    first = await sized(gw, 9_000)
    spy = spy_on(gw)
    assert (await chat(http, gw, first))[0] == 200
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prose(1_000)}],  # ~3,100 tokens
        "max_tokens": 500,
    }
    status, error, headers = await chat(http, gw, body)
    assert (status, error["error"]["code"]) == (429, "rate_limit_exceeded")
    assert spy.calls == ["count_chat", "count_chat"]
    assert headers["x-ratelimit-remaining-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-requests"] == "8"
    assert gw.gateway.quotas.pending == 0


async def test_a_client_that_leaves_while_its_prompt_is_counted_leaves_no_tokens_held(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(quota_policy(tokenizer_dir, [stub.url], tpm=10_000, rpm=10))
    await with_clock(gw)
    spy = spy_on(gw)
    spy.gate = asyncio.Event()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 700}
    probe = [Limit(TOKENS, 0, 10_000), Limit(REQUESTS, 0, 10)]
    async with aiohttp.ClientSession() as leaver:
        leaving = asyncio.create_task(
            leaver.post(f"{gw.url}/v1/chat/completions", json=body, headers=AUTH)
        )
        await eventually(lambda: spy.calls == ["count_chat"])
        held = await gw.gateway.state.peek(probe)  # reserved before it is counted
        assert [w.remaining for w in held] == [10_000 - 700, 9]
        leaving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
    await eventually(lambda: b"client_disconnect" in gw.access_log.getvalue())
    await eventually(lambda: gw.gateway.quotas.pending == 0)
    after = await gw.gateway.state.peek(probe)
    assert [w.remaining for w in after] == [10_000, 9]
    assert len(stub.stats.bodies) == 0


async def test_tokenize_and_detokenize_are_charged_a_request_and_the_tokens_they_handle(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    """Counting is every tenant's tokenizer time: a request and a token are charged before the
    body is read, the token corrected to the tokens counted or decoded (issue 35 item 12)."""
    gw = await gateway_factory(quota_policy(tokenizer_dir, [stub.url], rpm=2, tpm=1000))
    await with_clock(gw)
    spy = spy_on(gw)
    status, answer, headers = await post(
        http, gw, "/tokenize", {"model": "tiny", "prompt": "hello there"}
    )
    assert status == 200 and answer["count"] > 0
    assert headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-remaining-tokens"] == "999"  # the token charged before the read
    status, _, headers = await post(
        http, gw, "/detokenize", {"model": "tiny", "tokens": answer["tokens"]}
    )
    assert (status, headers["x-ratelimit-remaining-requests"]) == (200, "0")
    assert spy.calls == ["prompt_ids", "decode"]

    for path, body in (
        ("/tokenize", {"model": "tiny", "prompt": prose(20_000)}),
        ("/detokenize", {"model": "tiny", "tokens": answer["tokens"]}),
    ):
        status, error, headers = await post(http, gw, path, body)
        assert (status, error["error"]["code"]) == (429, "rate_limit_exceeded")
        assert (headers["Retry-After"], headers["x-ratelimit-remaining-requests"]) == ("60", "0")
    small = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    status, _, headers = await chat(http, gw, small)  # one window for every endpoint
    assert status == 429  # the RPM; the TPM paid the ids counted, then those decoded
    assert headers["x-ratelimit-remaining-tokens"] == str(1000 - 2 * answer["count"])
    assert spy.calls == ["prompt_ids", "decode"]
    assert await rejections(http, gw, "requests") == "3.0"
    async with http.post(f"{gw.url}/tokenize", json={"model": "tiny", "prompt": "x"}) as resp:
        assert resp.status == 401  # the tenant's key is needed


async def test_a_burst_across_two_gateways_on_redis_counts_only_what_the_window_admits(
    fresh_redis: RedisServer, stub, gateway_factory, tokenizer_dir, http
) -> None:
    """The early charge is one atomic script: of 24 concurrent requests against 3 requests
    left, 3 pass and are counted; none slips between a check and its charge."""

    def policy() -> dict[str, Any]:
        shared = quota_policy(tokenizer_dir, [stub.url], rpm=3, tpm=100_000)
        shared["state"] = {"backend": "redis", "url": fresh_redis.url, "gateways": 2}
        return shared

    gateways = [await gateway_factory(policy()), await gateway_factory(policy())]
    spy = Spy()
    for gw in gateways:
        spy_on(gw, spy)
    body = {"model": "tiny", "prompt": prose(300), "max_tokens": 5}
    answers = await asyncio.gather(
        *(post(http, gateways[i % 2], "/v1/completions", body) for i in range(24))
    )
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [200] * 3 + [429] * 21
    assert spy.calls == ["count_prompts"] * 3
    for gw in gateways:
        await eventually(lambda gw=gw: gw.gateway.quotas.pending == 0)
    [counted] = await gateways[0].gateway.policy.models["tiny"].counter.count_prompts(prose(300))
    expected = [100_000 - 3 * (counted + 5), 0]
    limits = [Limit(TOKENS, 0, 100_000), Limit(REQUESTS, 0, 3)]
    remaining: list[int] = []
    with contextlib.suppress(TimeoutError):  # each gateway's quota slice goes back within 0.5 s
        async with asyncio.timeout(5):
            while remaining != expected:
                remaining = [w.remaining for w in await gateways[0].gateway.state.peek(limits)]
                await asyncio.sleep(0.05)
    assert remaining == expected
