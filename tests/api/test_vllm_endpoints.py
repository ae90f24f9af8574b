"""vLLM's own endpoints, answered by the gateway: `/tokenize` and `/detokenize` with the model's
tokenizer, `/v1/models` cards with vLLM's fields, and `/version`.

tests_vllm/test_tokenize.py compares these answers with real vLLM's; here they are compared with
the tokenizer itself, and the refusals (limits, keys, unknown models) are checked."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from transformers import AutoTokenizer

from gateway.api.anthropic import chat_for
from tests.conftest import basic_policy, eventually
from tests.request.test_tenants import ACME_KEY, tenant_policy

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
]


@pytest.fixture(scope="module")
def hf(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


async def call(
    http: aiohttp.ClientSession, url: str, path: str, body: Any, **headers: str
) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{url}{path}", json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_tokenize_a_prompt_as_vllm_does(gateway_factory, stub, tokenizer_dir, hf, http):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    status, body = await call(http, gw.url, "/tokenize", {"model": "tiny", "prompt": "hello there"})
    assert status == 200
    ids = hf("hello there")["input_ids"]  # with special tokens: the BOS comes first
    assert body == {"count": len(ids), "max_model_len": 8192, "tokens": ids, "token_strs": None}
    assert stub.stats.headers == []  # no replica was asked


async def test_tokenize_options_special_tokens_and_token_strings(
    gateway_factory, stub, tokenizer_dir, hf, http
):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    request = {"prompt": "hello there", "add_special_tokens": False, "return_token_strs": True}
    status, body = await call(http, gw.url, "/tokenize", request)  # one model: `model` optional
    plain = {"prompt": "hello there", "return_token_strs": None}  # null: vLLM's default, false
    assert (await call(http, gw.url, "/tokenize", plain))[1]["token_strs"] is None
    ids = hf("hello there", add_special_tokens=False)["input_ids"]
    assert status == 200
    assert body["tokens"] == ids
    assert body["token_strs"] == hf.convert_ids_to_tokens(ids)


async def test_tokenize_a_chat_with_the_template_through_an_alias(
    gateway_factory, stub, tokenizer_dir, hf, http
):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    status, body = await call(
        http, gw.url, "/tokenize", {"model": "tiny-alias", "messages": MESSAGES}
    )
    text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert status == 200
    assert body["tokens"] == hf(text, add_special_tokens=False)["input_ids"]
    assert body["count"] == len(body["tokens"])


async def test_a_long_prompt_is_tokenized_off_the_event_loop_to_the_same_ids(
    gateway_factory, stub, tokenizer_dir, hf, http
):
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["server"] = {"inline_tokenize_max_chars": 16}
    gw = await gateway_factory(policy)
    prompt = "hello there " * 500
    status, body = await call(http, gw.url, "/tokenize", {"model": "tiny", "prompt": prompt})
    assert status == 200
    assert body["tokens"] == hf(prompt)["input_ids"]


async def test_detokenize_gives_back_the_text(gateway_factory, stub, tokenizer_dir, hf, http):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    ids = hf("hello there")["input_ids"]
    status, body = await call(http, gw.url, "/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200
    assert body == {"prompt": hf.decode(ids)}  # special tokens kept, as vLLM decodes


@pytest.mark.parametrize(
    ("path", "request_body", "status", "code"),
    [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model_not_found"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model_not_found"),
        ("/tokenize", {"model": "tiny"}, 400, "invalid_request"),
        ("/tokenize", {"model": "tiny", "prompt": 7}, 400, "invalid_request"),
        ("/tokenize", {"model": 7, "prompt": "x"}, 400, "invalid_request"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "maybe"}, 400, "invalid_type"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": None}, 400, "invalid_type"),
        ("/tokenize", {"messages": []}, 400, "invalid_request"),
        (
            "/tokenize",
            {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
            400,
            "invalid_request",
        ),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, 400, "invalid_request"),
        ("/detokenize", {"tokens": [-1]}, 400, "invalid_request"),
        ("/detokenize", {"tokens": "1 2"}, 400, "invalid_request"),
        ("/detokenize", {"tokens": [10**9]}, 400, "invalid_request"),  # outside the vocabulary
        ("/tokenize", ["not", "an", "object"], 400, "invalid_json"),
    ],
)
async def test_refusals_in_the_openai_shape(
    gateway_factory, stub, tokenizer_dir, http, path, request_body, status, code
):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    got, body = await call(http, gw.url, path, request_body)
    assert got == status
    assert body["error"]["code"] == code
    assert {"message", "type", "code"} <= set(body["error"])


async def test_the_request_limits_apply(gateway_factory, stub, tokenizer_dir, http):
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["server"] = {"max_prompt_chars": 100, "max_body_bytes": 4096}
    gw = await gateway_factory(policy)
    status, body = await call(http, gw.url, "/tokenize", {"prompt": "x" * 101})
    assert (status, body["error"]["code"]) == (400, "prompt_too_long")
    chat = {"messages": [{"role": "user", "content": "x" * 101}]}
    status, body = await call(http, gw.url, "/tokenize", chat)
    assert (status, body["error"]["code"]) == (400, "prompt_too_long")
    status, body = await call(http, gw.url, "/detokenize", {"tokens": [5] * 3000})
    assert (status, body["error"]["code"]) == (413, "request_too_large")


async def test_a_model_counted_by_estimate_has_no_token_ids(gateway_factory, stub, http):
    policy = basic_policy("estimate", [stub.url])
    gw = await gateway_factory(policy)
    status, body = await call(http, gw.url, "/tokenize", {"model": "tiny", "prompt": "hi"})
    assert (status, body["error"]["code"]) == (400, "no_tokenizer")


async def test_with_tenants_the_endpoints_take_a_key(gateway_factory, stub, tokenizer_dir, http):
    gw = await gateway_factory(tenant_policy(tokenizer_dir, [stub.url]))
    for path, request in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        status, _ = await call(http, gw.url, path, request)
        assert status == 401
        status, _ = await call(http, gw.url, path, request, Authorization=f"Bearer {ACME_KEY}")
        assert status == 200
    async with http.get(f"{gw.url}/version") as resp:  # issue 36 item 13: open, as vLLM's
        assert resp.status == 200
        assert await resp.json() == {"version": version("llm-admission-gateway")}


async def test_models_carry_vllms_fields_for_every_name(gateway_factory, stub, tokenizer_dir, http):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    async with http.get(f"{gw.url}/v1/models") as resp:
        cards = {c["id"]: c for c in (await resp.json())["data"]}
    assert set(cards) == {"tiny", "tiny-alias"}
    for card in cards.values():
        assert card["max_model_len"] == 8192
        assert card["root"] == "tiny"
        assert card["parent"] is None
        [permission] = card["permission"]
        assert permission["object"] == "model_permission"
        assert permission["id"].startswith("modelperm-")
        assert permission["allow_sampling"] is True


async def test_version_is_the_gateways(gateway_factory, stub, tokenizer_dir, http):
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    async with http.get(f"{gw.url}/version") as resp:
        assert resp.status == 200
        assert await resp.json() == {"version": version("llm-admission-gateway")}


async def test_counting_is_paid_from_the_tenants_tpm_window(
    gateway_factory, stub, tokenizer_dir, http
):
    """Issue 35 item 12: a 5,000 TPM tenant, refused any large chat, had the gateway count 552
    prompts of 474k tokens in 6 s through `count_tokens`, charged a request each and no token.
    Now each count is charged its tokens: once the window is spent, counting is refused too."""
    policy = tenant_policy(tokenizer_dir, [stub.url])
    policy["tenants"]["acme"]["tpm"] = 5000
    gw = await gateway_factory(policy)
    key = {"Authorization": f"Bearer {ACME_KEY}"}
    body = {"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "user", "content": "count every word of this " * 100}]}  # fmt: skip
    counted, statuses = 0, []
    for _ in range(12):
        status, answer = await call(http, gw.url, "/v1/messages/count_tokens", body, **key)
        statuses.append(status)
        if status == 200:
            counted += answer["input_tokens"]
        else:
            assert (status, answer["error"]["type"]) == (429, "rate_limit_error")
        await eventually(lambda: gw.gateway.quotas.pending == 0)
    each = counted // statuses.count(200)
    assert 429 in statuses
    assert counted <= 5000 + each  # the window, and the one count its last token let through
    tokenize = {"model": "tiny", "prompt": "hello"}
    status, answer = await call(http, gw.url, "/tokenize", tokenize, **key)
    assert status == 429  # the same window pays for /tokenize


async def test_count_tokens_counts_a_model_counted_by_estimate(gateway_factory, stub, http):
    """`/v1/messages` admits an estimate-counted model's requests on their estimate, and
    `count_tokens` answers the same count (it was a 400 `no_tokenizer`)."""
    gw = await gateway_factory(basic_policy("estimate", [stub.url]))
    body = {"model": "tiny", "max_tokens": 5, "messages": MESSAGES[1:]}
    status, answer = await call(http, gw.url, "/v1/messages/count_tokens", body)
    counter = gw.gateway.policy.models["tiny"].counter
    assert status == 200, answer
    assert answer["input_tokens"] == await counter.count_chat(chat_for(body, counter)) > 0
