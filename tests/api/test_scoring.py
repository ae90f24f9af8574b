"""vLLM's other pooling endpoints through the gateway to the simulator: rerank and score (at each
of vLLM's paths), classify and pooling; a scoring pair counted conservatively, never under
what vLLM's ways of encoding it make on the real tokenizers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.api import RERANK, SCORE
from loadtest.sim import ReplicaOptions, load_profile, start_replica
from tests.conftest import accounted, basic_policy, real_counter

QUERY = "how do tokenizers count emoji? 🚀"
DOCUMENTS = ["Byte-level BPE splits an emoji into several tokens.", "naïve café — 東京", "x"]


@pytest.fixture
async def gw(tokenizer_dir, gateway_factory):
    options = ReplicaOptions(time_scale=50, tokenizer=tokenizer_dir, served_model_names=("tiny",))
    replica = await start_replica(load_profile("gemma-3-12b-tpu-v6e-2x2"), options)
    yield await gateway_factory(basic_policy(tokenizer_dir, [replica.url]))
    await replica.close()


async def test_each_pooling_endpoint_is_admitted_and_settled_on_the_answers_usage(gw, http) -> None:
    calls = [
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}, "rerank"),
        ("/rerank", {"query": QUERY, "documents": DOCUMENTS[0]}, "rerank"),
        ("/v2/rerank", {"query": QUERY, "documents": DOCUMENTS}, "rerank"),
        ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}, "score"),
        ("/v1/score", {"queries": [QUERY, QUERY], "documents": DOCUMENTS[:2]}, "score"),
        ("/classify", {"input": DOCUMENTS}, "classify"),
        ("/pooling", {"input": DOCUMENTS[0]}, "pooling"),
    ]
    answers = []
    for path, body, _ in calls:
        async with http.post(f"{gw.url}{path}", json={"model": "tiny", **body}) as resp:
            answer = await resp.json()
            assert resp.status == 200, (path, answer)
            answers.append(answer)
    assert len(answers[0]["results"]) == 2 and "completion_tokens" not in answers[0]["usage"]
    assert [d["object"] for d in answers[3]["data"]] == ["score"] * 3
    await accounted(gw, len(calls) - 1)
    records = [json.loads(line) for line in gw.access_log.getvalue().splitlines()]
    assert [r["endpoint"] for r in records] == [name for _, _, name in calls]
    for record, answer in zip(records, answers, strict=True):
        assert record["expected_output_tokens"] == 0 and record["output_tokens"] == 0
        # scoring counts are an upper bound; the simulator joins each pair's texts
        assert record["input_tokens"] >= answer["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/rerank", {"query": QUERY}),
        ("/v1/rerank", {"query": 3, "documents": ["a"]}),
        ("/v1/rerank", {"query": QUERY, "documents": []}),
        ("/v1/rerank", {"query": QUERY, "documents": [{"content": []}]}),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
        ("/score", {"text_1": "a"}),
        ("/classify", {"input": 5}),
        ("/pooling", {"input": "x", "stream": True}),
    ],
)
async def test_bad_input_is_a_400_in_openais_shape(gw, http, path, body) -> None:
    async with http.post(f"{gw.url}{path}", json={"model": "tiny", **body}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize("model", ["gemma3", "llama3", "qwen3"])
async def test_a_pair_is_never_counted_under_any_way_vllm_encodes_it(model: str) -> None:
    reference, counter = real_counter(model)

    def n(text: str, pair: str | None = None) -> int:
        return len(reference(text=text, text_pair=pair)["input_ids"])

    ways = {  # vLLM's: the tokenizer's pair, the LLM reranker's join, the bi-encoder's singles
        "pair": sum(n(QUERY, d) for d in DOCUMENTS),
        "joined": sum(n(QUERY + d) for d in DOCUMENTS),
        "bi-encoder": n(QUERY) + sum(map(n, DOCUMENTS)),
    }
    body: dict[str, Any] = {"query": QUERY, "documents": DOCUMENTS}
    total, longest = await RERANK.count(body, counter, 10**6, 0)
    assert total >= max(ways.values()), ways
    assert total == len(DOCUMENTS) * n(QUERY) + sum(map(n, DOCUMENTS))  # singles per pair
    assert longest == max(n(QUERY), *map(n, DOCUMENTS))
    score = {"text_1": [QUERY] * 3, "text_2": DOCUMENTS}
    assert (await SCORE.count(score, counter, 10**6, 0))[0] == total
