"""`/classify` through the gateway to real vLLM serving the tiny model as a classifier
(`--convert classify`): each input form's count equals vLLM's usage. (vLLM serves `/rerank`
and `/score` only for a one-label classifier, which the converted tiny model is not: a 404.)"""

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
def vllm_classify(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A second vLLM, for this module: the tiny model converted to a classifier."""
    python, model_dir = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_MODEL_DIR")
    if not python or not model_dir:
        pytest.fail("VLLM_PYTHON and VLLM_MODEL_DIR must be set: run `make test-vllm`")
    log = tmp_path_factory.mktemp("vllm-classify") / "vllm.log"
    with serve_vllm(
        python, Path(model_dir).resolve(), log, extra_args=["--convert", "classify"]
    ) as server:
        yield server


async def test_each_classify_input_is_counted_as_vllm_counts_it(
    vllm_classify, gateway_factory, http
) -> None:
    gw = await gateway_factory(vllm_policy(vllm_classify))
    calls = [
        ("/classify", {"input": ["the seller wrote the listing", "é 日本語 🙂"]}),
        ("/classify", {"messages": [{"role": "user", "content": "a review"}]}),
        ("/classify", {"input": [[1, 2, 3], [4, 5]]}),
    ]
    usages = []
    for path, body in calls:
        async with http.post(f"{gw.url}{path}", json={"model": SERVED_NAME, **body}) as resp:
            answer = await resp.json()
            assert resp.status == 200, (path, answer)
            usages.append(answer["usage"]["prompt_tokens"])
    await accounted(gw, len(calls) - 1)
    counted = [json.loads(line)["input_tokens"] for line in gw.access_log.getvalue().splitlines()]
    assert counted == usages
