"""Real vLLM's KV-cache events (the CPU build publishes them): the `precise_prefix` scorer finds
where vLLM publishes from its `/kv_event_sources`, follows it, and keys each block exactly as
it keys a request's own token blocks, so a prompt vLLM prefilled for someone else steers the
next request with that prefix to it; adapters and cache salts key blocks apart as vLLM does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from transformers import AutoTokenizer

from gateway.pick.kv_events import token_blocks
from gateway.pick.precise import PrecisePrefixScorer
from loadtest.vllm_server import SERVED_NAME, VLLMServer, serve_vllm
from tests.conftest import RunningGateway, Stub
from tests_vllm.conftest import EAGER, LORA_NAME, LORA_RANK, build_lora, eventually, vllm_policy

RULES = " ".join(f"rule number {i} says that item {i} is forbidden." for i in range(60))


@pytest.fixture(scope="module")
def vllm_events(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """vLLM publishing its KV-cache events on an ipc endpoint, with a LoRA loaded."""
    import os

    python, model_dir = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_MODEL_DIR")
    if not python or not model_dir:
        pytest.fail("VLLM_PYTHON and VLLM_MODEL_DIR must be set: run `make test-vllm`")
    base = tmp_path_factory.mktemp("vllm-events")
    adapter = build_lora(base / LORA_NAME, Path(model_dir).resolve())
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{base}/kv-events.ipc",
    }
    flags = [
        EAGER,
        "--kv-events-config", json.dumps(events),
        "--enable-lora", "--max-lora-rank", str(LORA_RANK),
        "--lora-modules", f"{LORA_NAME}={adapter}",
    ]  # fmt: skip
    with serve_vllm(
        python, Path(model_dir).resolve(), base / "vllm.log", extra_args=flags
    ) as server:
        yield server


def chat(rules: str, product: str, model: str = SERVED_NAME) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 2,
        "messages": [{"role": "system", "content": rules}, {"role": "user", "content": product}],
    }


def chat_ids(model_dir: Path, body: dict[str, Any]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = tokenizer.apply_chat_template(
        body["messages"], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def completion_ids(model_dir: Path, prompt: str) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return list(tokenizer(prompt).input_ids)


async def post(http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> None:
    async with http.post(f"{url}{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def following_gateway(
    gateway_factory: Any, stub: Stub, server: VLLMServer, http: aiohttp.ClientSession
) -> tuple[RunningGateway, PrecisePrefixScorer]:
    """A gateway whose pool is a stub first, then vLLM: without a match, ties go to the stub.
    It follows vLLM's events once it has picked once; vLLM is then sent distinct prompts
    directly until a store is heard (a ZMQ subscriber only hears what is sent after it joins)."""
    # vLLM publishes on an ipc:// endpoint, followed only where the policy allows it.
    allowed = ["ipc:///*"]
    precise = {"weight": 1, "retry_s": 0.2, "ipc_endpoints": allowed}
    policy = vllm_policy(server, pick={"scorers": {"precise_prefix": precise}})
    policy["pools"]["main"]["replicas"] = [stub.url, server.url]
    gw: RunningGateway = await gateway_factory(policy)
    scorer = gw.gateway.slots["main"].picker.precise  # type: ignore[attr-defined]
    assert isinstance(scorer, PrecisePrefixScorer)
    await post(http, gw.url, "/v1/chat/completions", chat("warm up", "nothing"))
    for n in range(60):
        await post(http, server.url, "/v1/chat/completions", chat(f"probe {n} " + RULES, "x"))
        if len(scorer.blocks.get(server.url) or ()) > 0:
            break
    else:
        raise AssertionError(f"no KV-cache event read from vLLM: {dict(scorer.events)}")
    return gw, scorer


async def test_a_prefix_vllm_cached_for_someone_else_draws_the_next_request_to_it(
    vllm_events: VLLMServer, stub: Stub, gateway_factory: Any, http: aiohttp.ClientSession
) -> None:
    gw, scorer = await following_gateway(gateway_factory, stub, vllm_events, http)
    assert scorer.block_size == 128  # vLLM's CPU default, learned from its events
    first = chat(RULES, "Product: a red lamp.")
    await post(http, vllm_events.url, "/v1/chat/completions", first)  # not through the gateway
    ids = chat_ids(vllm_events.model_dir, first)
    keys = token_blocks(ids, 128, None, None, 1024)
    engine = scorer.blocks[vllm_events.url]
    await eventually(lambda: engine.matched(keys) == len(keys), within_s=10)
    # The gateway's own token ids for the next request give the same keys: it goes to vLLM.
    before = len(stub.stats.bodies)
    second = chat(RULES, "Product: a blue chair.")
    await post(http, gw.url, "/v1/chat/completions", second)
    assert len(stub.stats.bodies) == before
    shared = token_blocks(chat_ids(vllm_events.model_dir, second), 128, None, None, 1024)
    assert scorer.blocks_matched >= engine.matched(shared) > 0
    # Another prompt of the same length, cached nowhere: the tie goes to the stub.
    await post(http, gw.url, "/v1/chat/completions", chat(RULES.replace("rule", "norm"), "x"))
    assert len(stub.stats.bodies) == before + 1


async def test_completions_adapters_and_cache_salts_are_keyed_as_vllm_keys_them(
    vllm_events: VLLMServer, stub: Stub, gateway_factory: Any, http: aiohttp.ClientSession
) -> None:
    _gw, scorer = await following_gateway(gateway_factory, stub, vllm_events, http)
    engine = scorer.blocks[vllm_events.url]
    cases = [
        ({"model": SERVED_NAME}, None, None),
        ({"model": LORA_NAME}, LORA_NAME, None),
        ({"model": SERVED_NAME, "cache_salt": "tenant-a"}, None, "tenant-a"),
        ({"model": LORA_NAME, "cache_salt": "tenant-b"}, LORA_NAME, "tenant-b"),
    ]
    for n, (fields, lora, salt) in enumerate(cases):
        prompt = f"case {n}: " + RULES
        await post(
            http, vllm_events.url, "/v1/completions", {**fields, "prompt": prompt, "max_tokens": 2}
        )
        ids = completion_ids(vllm_events.model_dir, prompt)
        keys = token_blocks(ids, 128, lora, salt, 1024)
        await eventually(lambda k=keys: engine.matched(k) == len(k), within_s=10)  # type: ignore[misc]
        if lora or salt:  # the same tokens without the adapter or salt are other blocks
            assert engine.matched(token_blocks(ids, 128, None, None, 1024)) == 0
