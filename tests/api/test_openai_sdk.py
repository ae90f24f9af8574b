"""The official `openai` SDK, sync and async, pointed at the gateway like any user would."""

from __future__ import annotations

import asyncio
import hashlib

import openai
import pytest

from tests.conftest import basic_policy


@pytest.fixture
async def gw(stub, gateway_factory, tokenizer_dir):
    return await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))


async def test_async_chat(gw, stub) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "review this product"}], max_tokens=5
    )
    assert reply.choices[0].message.content == " tok" * 5
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    await client.close()


async def test_async_chat_stream_without_usage(gw, stub) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=7, stream=True
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " tok" * 7
    # The gateway asked upstream for usage, and the client who did not ask never sees it; with
    # no tenant's window to settle, not for a running count on every chunk.
    assert stub.stats.bodies[-1]["stream_options"] == {"include_usage": True}
    assert all(c.usage is None and c.choices for c in chunks)
    await client.close()


async def test_async_chat_stream_with_usage(gw) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    await client.close()


async def test_async_completions_stream(gw) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(
        model="tiny", prompt="once upon a time", max_tokens=4, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == " tok" * 4
    await client.close()


async def test_sync_client_chat_and_completions(gw) -> None:
    def use_sync_sdk() -> tuple[str, str, str]:
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as client:
            chat = client.chat.completions.create(
                model="tiny-alias", messages=[{"role": "user", "content": "hello"}], max_tokens=2
            )
            completion = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
            streamed = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=2,
                    stream=True,
                )
                if c.choices
            )
            return chat.choices[0].message.content or "", completion.choices[0].text, streamed

    chat, completion, streamed = await asyncio.to_thread(use_sync_sdk)
    assert (chat, completion, streamed) == (" tok" * 2, " tok" * 3, " tok" * 2)


async def test_alias_is_rewritten_and_unknown_fields_pass_through(gw, stub) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    await client.chat.completions.create(
        model="tiny-alias",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        stop=["\n"],
        n=1,
        logprobs=True,
        response_format={"type": "json_object"},
        extra_body={"ignore_eos": True},
    )
    sent = stub.stats.bodies[-1]
    assert sent["model"] == "tiny"
    assert sent["ignore_eos"] is True and sent["stop"] == ["\n"] and sent["logprobs"] is True
    assert sent["response_format"] == {"type": "json_object"}
    await client.close()


async def test_models_lists_models_and_aliases(gw) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    models = [m.id async for m in client.models.list()]
    assert models == ["tiny", "tiny-alias"]
    await client.close()


async def test_tenant_keys_and_quotas_through_the_sdk(stub, gateway_factory, tokenizer_dir) -> None:
    """The SDK's own api_key is the tenant's key; its errors map 401 and 429 as OpenAI's do."""
    policy = basic_policy(tokenizer_dir, [stub.url])
    digest = hashlib.sha256(b"sk-tenant").hexdigest()
    policy["tenants"] = {"acme": {"keys": [f"sha256:{digest}"], "rpm": 1}}
    gw = await gateway_factory(policy)
    messages = [{"role": "user", "content": "hi"}]
    stranger = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-other", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as denied:
        await stranger.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert denied.value.code == "invalid_api_key"
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-tenant", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=2
    )
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"
    assert raw.parse().choices[0].message.content == " tok" * 2
    with pytest.raises(openai.RateLimitError) as limited:
        await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert limited.value.code == "rate_limit_exceeded"
    assert int(limited.value.response.headers["Retry-After"]) >= 1
    await stranger.close()
    await client.close()


async def test_a_refusal_no_retry_can_lift_is_not_retried(stub, gateway_factory, tokenizer_dir):
    """Issue 27: a request larger than its tenant's whole window (429 `request_over_limit`) was
    retried twice by the SDK, which retries every 429, unless `x-should-retry: false` says not."""
    from tests.request.test_tenants import hashed

    key = "sk-small-tenant-0123456789"
    policy = basic_policy(tokenizer_dir, [stub.url])
    big = "sk-big-tenant-0123456789"
    policy["tenants"] = {
        "small": {"keys": [hashed(key)], "tpm": 300},
        "big": {"keys": [hashed(big)], "tpm": 10_000_000},
    }
    gw = await gateway_factory(policy)
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=2)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1000
        )
    assert refused.value.code == "request_over_limit"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert gw.access_log.getvalue().count(b"\n") == 1  # asked once
    await client.close()
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=big, max_retries=2)
    with pytest.raises(openai.BadRequestError) as too_long:  # so is one no context can hold
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=100_000
        )
    await client.close()
    assert too_long.value.code == "context_length_exceeded"
    assert too_long.value.response.headers["x-should-retry"] == "false"
