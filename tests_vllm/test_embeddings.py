"""`/v1/embeddings` through the gateway to real vLLM serving the tiny model as an embedding model
(`--convert embed`): the `openai` SDK's answer relayed, and the gateway's count of each input
form equal to the `usage.prompt_tokens` vLLM reports for it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from loadtest.vllm_server import SERVED_NAME, VLLMServer
from tests_vllm.conftest import counted_and_reported, started_vllm, vllm_policy

USER = {"role": "user", "content": "  the listing review, summarised: é 日本語 🙂  "}
SYSTEM = {"role": "system", "content": "represent this for retrieval"}
INPUTS = [
    {"input": "the seller wrote the listing"},
    {"input": ["the seller", "  é 日本語 🙂\n\n{json} 1,234.5  "]},
    {"input": "the seller", "add_special_tokens": False},
    {"input": [1, 2, 3, 4]},
    {"input": [[5, 6], [7, 8, 9]]},
    {"messages": [SYSTEM, USER]},
    {"messages": [USER], "add_generation_prompt": True},
    {"input": "the seller wrote the listing", "truncate_prompt_tokens": 3},
]


@pytest.fixture(scope="module")
def vllm_embed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A second vLLM, for this module: the tiny model converted to an embedding model."""
    yield from started_vllm(tmp_path_factory, "vllm-embed", ["--convert", "embed"])


async def test_the_sdk_embeds_through_the_gateway(vllm_embed, gateway_factory) -> None:
    gw = await gateway_factory(vllm_policy(vllm_embed))
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    reply = await client.embeddings.create(model=SERVED_NAME, input=["one", "two words"])
    await client.close()
    assert [d.index for d in reply.data] == [0, 1] and reply.data[0].embedding


async def test_each_input_form_is_counted_as_vllm_counts_it(
    vllm_embed, gateway_factory, http
) -> None:
    gw = await gateway_factory(vllm_policy(vllm_embed))
    counted, usages = await counted_and_reported(
        gw, http, [("/v1/embeddings", body) for body in INPUTS]
    )
    assert counted == usages
    logged = [json.loads(line) for line in gw.access_log.getvalue().splitlines()]
    assert all(r["output_tokens"] == 0 for r in logged)


async def test_other_pooling_endpoints_are_never_undercounted(
    vllm_embed, gateway_factory, http
) -> None:
    """An embedding model scores as a bi-encoder: each text once. The gateway's count of a pair
    is its two texts alone, so at least vLLM's usage; `/pooling` is counted exactly."""
    gw = await gateway_factory(vllm_policy(vllm_embed))
    calls = [
        ("/v1/rerank", {"query": "the seller", "documents": ["a listing", "é 日本語 🙂"]}),
        ("/score", {"text_1": "the seller", "text_2": ["a listing", "the buyer"]}),
        ("/pooling", {"input": "the seller wrote the listing", "task": "embed"}),
    ]
    counted, usages = await counted_and_reported(gw, http, calls)
    assert all(c >= u for c, u in zip(counted, usages, strict=True)), (counted, usages)
    assert counted[2] == usages[2]
