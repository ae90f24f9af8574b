"""`POST /v1/embeddings`: the `openai` SDK through the gateway to the simulator, counted as vLLM
counts each input form, refused in OpenAI's shape, logged and measured as `embeddings`."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from gateway.api import EMBEDDINGS
from gateway.cli import main as gateway
from loadtest.sim import ReplicaOptions, load_profile, start_replica
from tests.conftest import accounted, basic_policy, real_counter, write_policy
from tests.request.test_quotas import quota_policy
from tests.request.test_tenants import ACME_KEY

TEXTS = ["The quick brown fox jumps over the lazy dog.", "naïve café — 東京 🚀", ""]
CONVERSATION = [
    {"role": "system", "content": "Represent this query for retrieval."},
    {"role": "user", "content": "how do tokenizers count emoji? 🚀"},
]


@pytest.fixture
async def sim(tokenizer_dir):
    options = ReplicaOptions(time_scale=50, tokenizer=tokenizer_dir, served_model_names=("tiny",))
    replica = await start_replica(load_profile("gemma-3-12b-tpu-v6e-2x2"), options)
    yield replica
    await replica.close()


@pytest.fixture
async def gw(sim, gateway_factory, tokenizer_dir):
    return await gateway_factory(basic_policy(tokenizer_dir, [sim.url]))


def _log(gw) -> list[dict[str, Any]]:
    return [json.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def test_the_sdk_embeds_a_batch_counted_as_prefill_only_work(gw, http) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    reply = await client.embeddings.create(model="tiny", input=TEXTS[:2])
    await client.close()
    assert [d.index for d in reply.data] == [0, 1] and len(reply.data[0].embedding) == 8
    await accounted(gw, 0)
    (record,) = _log(gw)
    assert record["endpoint"] == "embeddings" and record["status"] == 200
    assert record["input_tokens"] == reply.usage.prompt_tokens  # the gateway counted as vLLM
    assert record["expected_output_tokens"] == 0 and record["output_tokens"] == 0
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    counted = [
        line
        for line in text.splitlines()
        if line.startswith("llm_requests_total{") and 'code="200"' in line
    ]
    assert counted and all('endpoint="embeddings"' in line for line in counted)


async def test_token_ids_and_chat_style_input_through_the_gateway(gw, http) -> None:
    for body in (
        {"input": [1, 2, 3, 4]},
        {"input": [[1, 2], [3, 4, 5]]},
        {"messages": CONVERSATION},
        {"input": CONVERSATION},
        {"messages": [CONVERSATION, CONVERSATION[1:]]},
    ):
        async with http.post(f"{gw.url}/v1/embeddings", json={"model": "tiny", **body}) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
    await accounted(gw, 4)
    records = _log(gw)
    assert [r["input_tokens"] for r in records[:2]] == [4, 5]
    assert all(r["output_tokens"] == 0 and r["status"] == 200 for r in records)


@pytest.mark.parametrize(
    "body",
    [
        {"input": 3},
        {"input": []},
        {"input": [1, "a"]},
        {"input": "x", "stream": True},
        {"input": "x", "truncate_prompt_tokens": -2},
        {"messages": [{"content": "no role"}]},
    ],
)
async def test_bad_input_is_a_400_in_openais_shape(gw, http, body) -> None:
    async with http.post(f"{gw.url}/v1/embeddings", json={"model": "tiny", **body}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


async def test_a_tenant_over_its_tpm_gets_429(sim, gateway_factory, tokenizer_dir, http) -> None:
    gw = await gateway_factory(quota_policy(tokenizer_dir, [sim.url], tpm=60))
    headers = {"Authorization": f"Bearer {ACME_KEY}"}
    body = {"model": "tiny", "input": list(range(1, 41))}  # 40 tokens, exactly
    statuses = []
    for _ in range(2):
        async with http.post(f"{gw.url}/v1/embeddings", json=body, headers=headers) as resp:
            statuses.append(resp.status)
            if resp.status == 429:
                assert (await resp.json())["error"]["message"]
    assert statuses == [200, 429]


# ---------------------------------------------------------- counts on the real tokenizers


@pytest.mark.parametrize("model", ["gemma3", "llama3", "qwen3"])
async def test_each_input_form_counts_as_vllm_tokenizes_it(model: str) -> None:
    """vLLM encodes each text on its own (special tokens unless `add_special_tokens` is false)
    and renders each conversation with the template, no generation prompt, no special tokens."""
    reference, counter = real_counter(model)

    def text(t: str, special: bool = True) -> int:
        return len(reference(t, add_special_tokens=special)["input_ids"])

    def chat(messages: list[dict[str, Any]], generation: bool = False) -> int:
        rendered = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
        return len(reference(rendered, add_special_tokens=False)["input_ids"])

    cases = [
        ({"input": TEXTS[0]}, [text(TEXTS[0])]),
        ({"input": TEXTS}, [text(t) for t in TEXTS]),
        ({"input": TEXTS, "add_special_tokens": False}, [text(t, False) for t in TEXTS]),
        ({"input": [5, 6, 7]}, [3]),
        ({"input": [[5, 6], [7]]}, [2, 1]),
        ({"messages": CONVERSATION}, [chat(CONVERSATION)]),
        ({"input": CONVERSATION}, [chat(CONVERSATION)]),
        (
            {"messages": CONVERSATION, "add_generation_prompt": True},
            [chat(CONVERSATION, True)],
        ),
        (
            {"messages": [CONVERSATION, CONVERSATION[1:]]},
            [chat(CONVERSATION), chat(CONVERSATION[1:])],
        ),
        ({"input": TEXTS[:2], "truncate_prompt_tokens": 3}, [3, 3]),
    ]
    for body, expected in cases:
        counted = await EMBEDDINGS.count(body, counter, 10**6, 0)
        assert counted == (sum(expected), max(expected)), body


async def test_an_embedding_classifies_as_prefill_heavy_by_its_shape(
    sim, gateway_factory, tokenizer_dir, http
) -> None:
    policy = basic_policy(tokenizer_dir, [sim.url])
    policy["classes"] = [
        {"name": "prefill-heavy", "when": {"output_input_ratio": {"lte": 0.1}}},
        {"name": "decode-heavy", "when": {}},
    ]
    gw = await gateway_factory(policy)
    async with http.post(
        f"{gw.url}/v1/embeddings", json={"model": "tiny", "input": "one short query"}
    ) as resp:
        assert resp.status == 200
    await accounted(gw, 0)
    (record,) = _log(gw)
    assert (record["class"], record["estimate_source"]) == ("prefill-heavy", "max_tokens")


def test_explain_shows_an_embedding_requests_decision(capsys, tmp_path, tokenizer_dir) -> None:
    policy = str(write_policy(tmp_path, basic_policy(tokenizer_dir, ["http://127.0.0.1:1"])))
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": "tiny", "input": [[1, 2, 3], [4, 5]]}))
    code = gateway(["explain", "--json", "--policy", policy, str(request)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["endpoint"] == "embeddings"
    assert (out["input_tokens"], out["expected_output_tokens"]) == (5, 0)
