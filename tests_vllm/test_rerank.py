"""`/rerank` and `/score` through the gateway to real vLLM serving the tiny model as a one-label
classifier (`--convert classify`, `num_labels` 1): an LLM used as a cross-encoder, each pair one
prompt. The gateway's count of a pair (its two texts alone) is never under vLLM's usage."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.vllm_server import SERVED_NAME, VLLMServer, serve_vllm
from tests.conftest import accounted
from tests_vllm.conftest import vllm_policy


@pytest.fixture(scope="module")
def vllm_reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    python, model_dir = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_MODEL_DIR")
    if not python or not model_dir:
        pytest.fail("VLLM_PYTHON and VLLM_MODEL_DIR must be set: run `make test-vllm`")
    log = tmp_path_factory.mktemp("vllm-rerank") / "vllm.log"
    flags = ["--convert", "classify", "--hf-overrides", '{"num_labels": 1}']
    with serve_vllm(python, Path(model_dir).resolve(), log, extra_args=flags) as server:
        yield server


async def test_pairs_are_never_undercounted(vllm_reranker, gateway_factory, http) -> None:
    gw = await gateway_factory(vllm_policy(vllm_reranker))
    calls = [
        ("/v1/rerank", {"query": "the seller", "documents": ["a listing", "é 日本語 🙂"]}),
        ("/rerank", {"query": "  é 日本語 🙂  ", "documents": "the buyer"}),
        ("/v2/rerank", {"query": "q", "documents": ["a", "b", "c"], "top_n": 1}),
        ("/score", {"text_1": ["q one", "q two"], "text_2": ["a listing", "the buyer"]}),
        ("/v1/score", {"queries": "the seller", "documents": ["a listing", "the buyer"]}),
    ]
    usages = []
    for path, body in calls:
        async with http.post(f"{gw.url}{path}", json={"model": SERVED_NAME, **body}) as resp:
            answer = await resp.json()
            assert resp.status == 200, (path, answer)
            usages.append(answer["usage"]["prompt_tokens"])
    await accounted(gw, len(calls) - 1)
    counted = [json.loads(line)["input_tokens"] for line in gw.access_log.getvalue().splitlines()]
    assert all(c >= u for c, u in zip(counted, usages, strict=True)), (counted, usages)
