"""Images are not free: each image part is charged the model's `image_tokens` wherever tokens
count (context length, class, TPM, in-flight tokens); a model without it refuses images; a
Gemma-3-shaped template that loops over content parts is rendered with the parts; and a tenant's
window is settled on the replica's own `prompt_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from transformers import AutoTokenizer

from gateway.policy.compile import load_policy
from gateway.state import Limit, TenantWindow
from loadtest.tiny_tokenizer import build
from tests.conftest import RunningGateway, accounted, basic_policy, write_policy
from tests.request.test_tenants import ACME_KEY, hashed

AUTH = {"Authorization": f"Bearer {ACME_KEY}"}
IMAGE_TOKENS = 260  # Gemma 3: "\n\n" + <start_of_image> + 256 + <end_of_image> + "\n\n"
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 20_000}}

# Gemma 3's own chat template, reduced to its content loop (vLLM detects it as "openai" format).
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build(tmp_path_factory.mktemp("gemma") / "gemma")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    specials = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = GEMMA_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def image_policy(tokenizer: Path, replicas: list[str], **model: Any) -> dict[str, Any]:
    policy = basic_policy(tokenizer, replicas)
    policy["models"]["tiny"].update(model)
    return policy


def chat_body(images: int, text: str = "describe each image", **extra: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": text}, *[IMAGE] * images]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


async def post(
    http: aiohttp.ClientSession, gw: RunningGateway, body: dict[str, Any], **headers: str
) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json()


def last_log(gw: RunningGateway) -> dict[str, Any]:
    return dict(json.loads(gw.access_log.getvalue().splitlines()[-1]))


async def test_25_images_are_charged_25_times_image_tokens(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(
        image_policy(tokenizer_dir, [stub.url], image_tokens=IMAGE_TOKENS, max_images=32)
    )
    status, _ = await post(http, gw, chat_body(25, max_tokens=5))
    assert status == 200
    # The tiny template takes strings: the image parts flatten away, and each costs in full.
    counter = gw.gateway.policy.models["tiny"].counter
    text = await counter.count_chat(chat_body(0))
    assert last_log(gw)["input_tokens"] == text + 25 * IMAGE_TOKENS


async def test_many_images_are_refused_by_the_context_length(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(
        image_policy(tokenizer_dir, [stub.url], image_tokens=IMAGE_TOKENS, max_images=64)
    )
    status, answer = await post(http, gw, chat_body(40, max_tokens=5))  # 10,400 > 8,192
    assert (status, answer["error"]["code"]) == (400, "context_length_exceeded")
    assert stub.stats.requests == 0


async def test_an_image_heavy_request_is_prefill_heavy(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    policy = image_policy(tokenizer_dir, [stub.url], image_tokens=IMAGE_TOKENS)
    policy["classes"] = [
        {"name": "prefill_heavy", "when": {"input_tokens": {"gte": 1024}}},
        {"name": "decode_heavy", "when": {}},
    ]
    gw = await gateway_factory(policy)
    status, _ = await post(http, gw, chat_body(5, max_tokens=5))
    assert status == 200
    assert last_log(gw)["class"] == "prefill_heavy"


async def test_images_count_against_a_tenants_tpm(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    policy = image_policy(tokenizer_dir, [stub.url], image_tokens=IMAGE_TOKENS)
    policy["tenants"] = {"acme": {"keys": [hashed(ACME_KEY)], "tpm": 2000}}
    gw = await gateway_factory(policy)
    status, answer = await post(http, gw, chat_body(10, max_tokens=5), **AUTH)  # 2,600 tokens
    assert (status, answer["error"]["code"]) == (429, "request_over_limit")
    assert stub.stats.requests == 0


async def test_a_model_without_image_tokens_refuses_images(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    status, answer = await post(http, gw, chat_body(1))
    assert (status, answer["error"]["code"]) == (400, "images_not_supported")
    for part in ({"image_url": "x"}, {**IMAGE, "text": "not text: vLLM goes by the type"}):
        body = {"model": "tiny", "messages": [{"role": "user", "content": [part]}]}
        status, answer = await post(http, gw, body)  # vLLM takes a part without a type too
        assert (status, answer["error"]["code"]) == (400, "images_not_supported")
    assert stub.stats.requests == 0


async def test_more_than_max_images_is_refused(stub, gateway_factory, tokenizer_dir, http) -> None:
    gw = await gateway_factory(
        image_policy(tokenizer_dir, [stub.url], image_tokens=IMAGE_TOKENS, max_images=4)
    )
    status, answer = await post(http, gw, chat_body(5, max_tokens=5))
    assert (status, answer["error"]["code"]) == (400, "too_many_images")


@pytest.mark.parametrize("stream", [False, True])
async def test_the_tenant_is_settled_on_the_replicas_prompt_tokens(
    stream, stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    stub = await stub_factory(prompt_tokens=1234)
    policy = image_policy(tokenizer_dir, [stub.url], image_tokens=IMAGE_TOKENS)
    # The replica's count is above the reservation by more than the default burst (512).
    policy["tenants"] = {"acme": {"keys": [hashed(ACME_KEY)], "tpm": 100_000, "burst_tokens": 1000}}
    gw = await gateway_factory(policy)
    body = chat_body(2, max_tokens=5, stream=stream)
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=AUTH) as resp:
        assert resp.status == 200
        await resp.read()
    await accounted(gw, 0)
    assert last_log(gw)["input_tokens"] != 1234
    (window,) = await gw.gateway.state.peek([Limit(TenantWindow("acme", "tokens"), 0, 100_000)])
    assert window.remaining == 100_000 - (1234 + 5)


@pytest.mark.parametrize("backend", ["fastokens", "tokenizers"])
async def test_a_parts_template_is_counted_as_it_renders_the_parts(
    backend, gemma_dir, tmp_path
) -> None:
    policy = image_policy(
        gemma_dir, ["http://127.0.0.1:9"], image_tokens=IMAGE_TOKENS, tokenizer_backend=backend
    )
    counter = load_policy(write_policy(tmp_path, policy)).models["tiny"].counter
    reference = AutoTokenizer.from_pretrained(str(gemma_dir), local_files_only=True)
    parts = [{"type": "text", "text": " first part. "}, {"type": "text", "text": "second part."}]
    messages = [
        {"role": "system", "content": "you review listings"},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
        {"role": "user", "content": [*parts, IMAGE, IMAGE]},
    ]
    as_vllm = [
        {**m, "content": [p if p is not IMAGE else {"type": "image"} for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    rendered = reference.apply_chat_template(as_vllm, tokenize=False, add_generation_prompt=True)
    expected = len(reference(rendered, add_special_tokens=False)["input_ids"])
    assert await counter.count_chat({"messages": messages}) == expected
    # Each image: the template's <start_of_image> is counted there; the rest of the expansion here.
    assert counter.image_cost == IMAGE_TOKENS - 1


async def test_a_gemma_request_with_images_is_charged_its_render_plus_each_expansion(
    stub, gateway_factory, gemma_dir, http
) -> None:
    gw = await gateway_factory(image_policy(gemma_dir, [stub.url], image_tokens=IMAGE_TOKENS))
    status, _ = await post(http, gw, chat_body(3, max_tokens=5))
    assert status == 200
    reference = AutoTokenizer.from_pretrained(str(gemma_dir), local_files_only=True)
    content = [{"type": "text", "text": "describe each image"}, *[{"type": "image"}] * 3]
    rendered = reference.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    placeholders = len(reference(rendered, add_special_tokens=False)["input_ids"])
    # vLLM's processor turns each <start_of_image> into the 260-token sequence.
    assert last_log(gw)["input_tokens"] == placeholders + 3 * (IMAGE_TOKENS - 1)
