"""`/rerank` and `/score` through the gateway to real vLLM serving the tiny model as a one-label
classifier (its head in the checkpoint): an LLM used as a cross-encoder, each pair one prompt.
The gateway's count of a pair (its two texts alone) is never under vLLM's usage."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadtest.vllm_server import VLLMServer
from tests_vllm.conftest import counted_and_reported, started_vllm, vllm_policy


@pytest.fixture(scope="module")
def vllm_reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    yield from started_vllm(tmp_path_factory, "vllm-rerank", labels=1)


async def test_pairs_are_never_undercounted(vllm_reranker, gateway_factory, http) -> None:
    gw = await gateway_factory(vllm_policy(vllm_reranker))
    calls = [
        ("/v1/rerank", {"query": "the seller", "documents": ["a listing", "é 日本語 🙂"]}),
        ("/rerank", {"query": "  é 日本語 🙂  ", "documents": "the buyer"}),
        ("/v2/rerank", {"query": "q", "documents": ["a", "b", "c"], "top_n": 1}),
        ("/score", {"text_1": ["q one", "q two"], "text_2": ["a listing", "the buyer"]}),
        ("/v1/score", {"queries": "the seller", "documents": ["a listing", "the buyer"]}),
    ]
    counted, usages = await counted_and_reported(gw, http, calls)
    assert all(c >= u for c, u in zip(counted, usages, strict=True)), (counted, usages)
