"""Token shape decides the pool: a 4,000-in / 10-out review and a 500-in / 1,000-out analysis part ways."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from loadtest.tiny_tokenizer import WORDS
from tests.conftest import write_policy


def fleet(tokenizer_dir, classify_url: str, generate_url: str) -> dict:
    return {
        "models": {
            "gemma-3-27b-it": {"tokenizer": str(tokenizer_dir), "max_model_len": 128000},
            "gemma-3-12b-it": {"tokenizer": str(tokenizer_dir), "max_model_len": 128000},
        },
        "pools": {
            "classify-27b": {
                "model": "gemma-3-27b-it",
                "replicas": [classify_url],
                "max_concurrency": 128,
            },
            "generate-12b": {
                "model": "gemma-3-12b-it",
                "replicas": [generate_url],
                "max_concurrency": 64,
            },
        },
        "classes": [
            {
                "name": "prefill_heavy",
                "when": {"input_tokens": {"gte": 1024}, "output_tokens": {"lte": 64}},
            },
            {"name": "decode_heavy", "when": {}},
        ],
        "routes": [
            {"match": {"model": "gemma-3", "class": "prefill_heavy"}, "pool": "classify-27b"},
            {"match": {"model": "gemma-3"}, "pool": "generate-12b"},
        ],
        "plugins": {
            "output_estimator": {"type": "rolling-quantile", "parameters": {"min_samples": 3}}
        },
    }


def text_of(tokenizer, tokens: int) -> str:
    words = WORDS * (tokens // len(WORDS) + 2)
    lo, hi = 1, len(words)
    while lo < hi:  # the longest prefix of words under `tokens`
        mid = (lo + hi + 1) // 2
        if len(tokenizer(" ".join(words[:mid]), add_special_tokens=False)["input_ids"]) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


@pytest.fixture(scope="module")
def requests(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    review = {
        "model": "gemma-3",
        "messages": [
            {"role": "system", "content": text_of(tokenizer, 3000)},
            {"role": "user", "content": text_of(tokenizer, 980)},
        ],
        "max_tokens": 10,
    }
    analysis = {
        "model": "gemma-3",
        "messages": [{"role": "user", "content": text_of(tokenizer, 490)}],
        "max_tokens": 1000,
    }
    return review, analysis


async def test_classification_and_generation_go_to_different_pools(
    stub_factory, gateway_factory, tokenizer_dir, http, requests
) -> None:
    classify, generate = await stub_factory(), await stub_factory()
    gw = await gateway_factory(fleet(tokenizer_dir, classify.url, generate.url))
    review, analysis = requests
    for body in (review, analysis):
        async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
    assert [b["model"] for b in classify.stats.bodies] == ["gemma-3-27b-it"]
    assert [b["model"] for b in generate.stats.bodies] == ["gemma-3-12b-it"]
    lines = [json.loads(line) for line in gw.access_log.getvalue().splitlines()]
    assert [(x["class"], x["pool"]) for x in lines] == [
        ("prefill_heavy", "classify-27b"),
        ("decode_heavy", "generate-12b"),
    ]
    assert 3990 <= lines[0]["input_tokens"] <= 4010 and lines[0]["expected_output_tokens"] == 10
    assert lines[1]["estimate_source"] == "max_tokens"


async def test_learned_output_length_reclassifies_a_generous_max_tokens(
    stub_factory, gateway_factory, tokenizer_dir, http, requests
) -> None:
    """Clients send max_tokens 4096 for a 10-token answer; once learned, it is classification."""
    classify, generate = await stub_factory(), await stub_factory()
    gw = await gateway_factory(fleet(tokenizer_dir, classify.url, generate.url))
    review = {**requests[0], "max_tokens": 10}
    for _ in range(3):  # three answers of 10 tokens teach the estimator (min_samples: 3)
        async with http.post(f"{gw.url}/v1/chat/completions", json=review) as resp:
            assert resp.status == 200
    generous = {**review, "max_tokens": 4096}
    async with http.post(f"{gw.url}/v1/chat/completions", json=generous) as resp:
        assert resp.status == 200
    last = json.loads(gw.access_log.getvalue().splitlines()[-1])
    assert (last["estimate_source"], last["expected_output_tokens"], last["pool"]) == (
        "learned",
        10,
        "classify-27b",
    )


@pytest.mark.parametrize("which", [0, 1])
def test_explain_shows_the_same_decision(tmp_path, tokenizer_dir, requests, which) -> None:
    policy = write_policy(
        tmp_path, fleet(tokenizer_dir, "http://127.0.0.1:1", "http://127.0.0.1:2")
    )
    request = tmp_path / "request.json"
    request.write_text(json.dumps(requests[which]))
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "explain", "--json", "--policy", str(policy), str(request)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    decision = json.loads(out.stdout)
    expected = [
        ("prefill_heavy", "classify-27b", "gemma-3-27b-it"),
        ("decode_heavy", "generate-12b", "gemma-3-12b-it"),
    ]
    assert (decision["class"], decision["pool"], decision["rewritten_model"]) == expected[which]
    assert decision["estimate_source"] == "max_tokens"
    human = subprocess.run(
        [sys.executable, "-m", "gateway", "explain", "--policy", str(policy), str(request)],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert f"input_tokens            {decision['input_tokens']}" in human
