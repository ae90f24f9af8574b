"""The gateway's input-token count against vLLM's own `usage.prompt_tokens`, over varied prompts.

Every prompt goes through two gateways, one counting `exact` and one `memoized`, and each access
log line is compared with the usage vLLM returned for that request: the memoized count is claimed
exact on these tokenizers (docs/architecture.md), so both must agree with vLLM to the token.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import orjson

from loadtest.tiny_tokenizer import WORDS
from tests_vllm.conftest import vllm_policy

PROMPTS = 200  # per endpoint; with two gateways, 800 requests
CONCURRENCY = 8
EXTRA = [
    "  ",
    "\n",
    "\n\n",
    "\t",
    " ",
    "é",
    "ß",
    "日本語",
    "🙂",
    "<b>",
    "{json}",
    "1,234.5",
    "  x  ",
]
RULES = " ".join(random.Random(1).choice(WORDS) for _ in range(300))  # a repeated rules block


def _text(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, 60))]
    for _ in range(rng.randint(0, 4)):
        words.insert(rng.randint(0, len(words)), rng.choice(EXTRA))
    if rng.random() < 0.3:
        words.append(str(rng.randint(0, 10**6)))
    sep = rng.choice([" ", " ", "\n", ", "])
    text = sep.join(words)
    if rng.random() < 0.3:
        text = rng.choice(EXTRA) + text + rng.choice(EXTRA)
    return text


def chat_bodies(rng: random.Random, n: int) -> list[dict[str, Any]]:
    bodies = []
    for _ in range(n):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.5:
            messages.append(
                {"role": "system", "content": RULES if rng.random() < 0.5 else _text(rng)}
            )
        for turn in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": _text(rng)})
            if turn and rng.random() < 0.3:  # text parts, joined by vLLM with newlines
                parts = [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(1, 3))]
                messages[-1]["content"] = parts
            messages.append({"role": "assistant", "content": _text(rng)})
        messages.pop()  # end on the user's turn
        bodies.append({"model": "tiny", "messages": messages, "max_tokens": 1})
    return bodies


def completion_bodies(rng: random.Random, n: int) -> list[dict[str, Any]]:
    bodies = []
    for _ in range(n):
        prompt: Any = _text(rng) or "x"
        shape = rng.random()
        if shape < 0.2:  # several prompts in one request: vLLM's usage sums them
            prompt = [_text(rng) or "y" for _ in range(rng.randint(2, 3))]
        elif shape < 0.3:  # token ids, counted as they are
            prompt = [rng.randrange(6, 1900) for _ in range(rng.randint(1, 200))]
        bodies.append({"model": "tiny", "prompt": prompt, "max_tokens": 1})
    return bodies


async def _send(
    http: aiohttp.ClientSession, url: str, path: str, bodies: list[dict[str, Any]], tag: str
) -> dict[str, int]:
    """vLLM's prompt_tokens by request id, sending `CONCURRENCY` at a time."""
    usage: dict[str, int] = {}
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(index: int, body: dict[str, Any]) -> None:
        request_id = f"{tag}-{index}"
        async with (
            gate,
            http.post(url + path, json=body, headers={"x-request-id": request_id}) as resp,
        ):
            assert resp.status == 200, await resp.text()
            usage[request_id] = (await resp.json())["usage"]["prompt_tokens"]

    async with asyncio.timeout(300):
        await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    return usage


def _counted(log: bytes) -> dict[str, int]:
    return {r["request_id"]: r["input_tokens"] for r in map(orjson.loads, log.splitlines())}


async def test_input_tokens_equal_vllm_prompt_tokens(vllm, gateway_factory, http) -> None:
    rng = random.Random(4)
    work = [
        ("/v1/chat/completions", chat_bodies(rng, PROMPTS)),
        ("/v1/completions", completion_bodies(rng, PROMPTS)),
    ]
    for counting in ("fastokens", "tokenizers"):
        policy = vllm_policy(vllm)
        policy["models"]["tiny"]["tokenizer_backend"] = counting
        gw = await gateway_factory(policy)
        for path, bodies in work:
            tag = f"{counting}{path.replace('/', '-')}"
            usage = await _send(http, gw.url, path, bodies, tag)
            counted = _counted(gw.access_log.getvalue())
            mismatches = {k: (counted[k], v) for k, v in usage.items() if counted[k] != v}
            assert len(usage) == len(bodies) and not mismatches, (counting, path, mismatches)
