"""Real vLLM's KV-cache events (the CPU build publishes them): the `precise_prefix` scorer finds
where vLLM publishes from its `/kv_event_sources`, follows it, and keys each block exactly as
it keys a request's own token blocks, so a prompt vLLM prefilled for someone else steers the
next request with that prefix to it; adapters and cache salts key blocks apart as vLLM does.
The vLLM is the session's LoRA server (`vllm_lora`), which publishes its events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from transformers import AutoTokenizer

from gateway.pick.kv_events import token_blocks
from gateway.pick.precise import PrecisePrefixScorer
from loadtest.vllm_server import SERVED_NAME, VLLMServer
from tests.conftest import RunningGateway, Stub
from tests_vllm.conftest import LORA_NAME, eventually, vllm_policy

RULES = " ".join(f"rule number {i} says that item {i} is forbidden." for i in range(60))


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
    vllm_lora: VLLMServer, stub: Stub, gateway_factory: Any, http: aiohttp.ClientSession
) -> None:
    gw, scorer = await following_gateway(gateway_factory, stub, vllm_lora, http)
    assert scorer.block_size == 128  # vLLM's CPU default, learned from its events
    first = chat(RULES, "Product: a red lamp.")
    await post(http, vllm_lora.url, "/v1/chat/completions", first)  # not through the gateway
    ids = chat_ids(vllm_lora.model_dir, first)
    keys = token_blocks(ids, 128, None, None, 1024)
    engine = scorer.blocks[vllm_lora.url]
    await eventually(lambda: engine.matched(keys) == len(keys), within_s=10)
    # The gateway's own token ids for the next request give the same keys: it goes to vLLM.
    before = len(stub.stats.bodies)
    second = chat(RULES, "Product: a blue chair.")
    await post(http, gw.url, "/v1/chat/completions", second)
    assert len(stub.stats.bodies) == before
    shared = token_blocks(chat_ids(vllm_lora.model_dir, second), 128, None, None, 1024)
    assert scorer.blocks_matched >= engine.matched(shared) > 0
    # Another prompt of the same length, cached nowhere: the tie goes to the stub.
    await post(http, gw.url, "/v1/chat/completions", chat(RULES.replace("rule", "norm"), "x"))
    assert len(stub.stats.bodies) == before + 1


async def test_completions_adapters_and_cache_salts_are_keyed_as_vllm_keys_them(
    vllm_lora: VLLMServer, stub: Stub, gateway_factory: Any, http: aiohttp.ClientSession
) -> None:
    _gw, scorer = await following_gateway(gateway_factory, stub, vllm_lora, http)
    engine = scorer.blocks[vllm_lora.url]
    cases = [
        ({"model": SERVED_NAME}, None, None),
        ({"model": LORA_NAME}, LORA_NAME, None),
        ({"model": SERVED_NAME, "cache_salt": "tenant-a"}, None, "tenant-a"),
        ({"model": LORA_NAME, "cache_salt": "tenant-b"}, LORA_NAME, "tenant-b"),
    ]
    for n, (fields, lora, salt) in enumerate(cases):
        prompt = f"case {n}: " + RULES
        await post(
            http, vllm_lora.url, "/v1/completions", {**fields, "prompt": prompt, "max_tokens": 2}
        )
        ids = completion_ids(vllm_lora.model_dir, prompt)
        keys = token_blocks(ids, 128, lora, salt, 1024)
        await eventually(lambda k=keys: engine.matched(k) == len(k), within_s=10)  # type: ignore[misc]
        if lora or salt:  # the same tokens without the adapter or salt are other blocks
            assert engine.matched(token_blocks(ids, 128, None, None, 1024)) == 0
