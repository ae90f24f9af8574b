"""`/classify` through the gateway to real vLLM serving the tiny model as a two-label classifier
(its head in the checkpoint): each input form's count equals vLLM's usage. (vLLM serves `/rerank`
and `/score` only for a one-label classifier, which this one is not: a 404.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadtest.vllm_server import VLLMServer
from tests_vllm.conftest import counted_and_reported, started_vllm, vllm_policy


@pytest.fixture(scope="module")
def vllm_classify(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A second vLLM, for this module: the tiny model as a classifier."""
    yield from started_vllm(tmp_path_factory, "vllm-classify", labels=2)


async def test_each_classify_input_is_counted_as_vllm_counts_it(
    vllm_classify, gateway_factory, http
) -> None:
    gw = await gateway_factory(vllm_policy(vllm_classify))
    calls = [
        ("/classify", {"input": ["the seller wrote the listing", "é 日本語 🙂"]}),
        ("/classify", {"messages": [{"role": "user", "content": "a review"}]}),
        ("/classify", {"input": [[1, 2, 3], [4, 5]]}),
    ]
    counted, usages = await counted_and_reported(gw, http, calls)
    assert counted == usages
