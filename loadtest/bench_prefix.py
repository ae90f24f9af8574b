"""What the prefix scorers cost per request, on prompts of the seed's shapes: `prefix` hashes
the prompt's characters into chained blocks and looks them up in its index; `precise_prefix`
encodes the rendered prompt, keys its token blocks and looks them up in what each engine holds.

    python -m loadtest.bench_prefix [--repeat 200]

Prints a Markdown table (docs/benchmarks.md, "Prefix hashing"). The tokenizer is the tiny
byte-level BPE the tests build (loadtest/tiny_tokenizer.py), so its figures are a floor for a
model's 262k-vocabulary tokenizer, which costs more per token (../shared/PERF_NOTES.md).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from gateway.pick.kv_events import EngineBlocks, token_blocks
from gateway.pick.prefix_index import PrefixIndex
from gateway.pick.prompt import chain, prompt_text
from loadtest.tiny_tokenizer import WORDS, build

BLOCK_CHARS = 256
BLOCK_TOKENS = 16  # vLLM's default on GPUs: the most blocks per prompt (CPU 128, TPU 64-512)
REPLICAS = 16


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:chars]


def hash_prompt(body: dict[str, Any]) -> tuple[int, ...]:
    prompt = prompt_text(body)
    assert prompt is not None
    return chain(None, prompt, BLOCK_CHARS, 1024)


def look_up(index: PrefixIndex, blocks: tuple[int, ...]) -> list[int]:
    return [index.matched(f"r{i}", blocks) for i in range(REPLICAS)]


def engine_look_up(engines: list[EngineBlocks], keys: tuple[int, ...]) -> list[int]:
    return [engine.matched(keys) for engine in engines]


def engines_holding(ids: list[int], shared: int) -> list[EngineBlocks]:
    """Every replica's engine holds the first `shared` token blocks; the first holds them all."""
    engines = []
    for i in range(REPLICAS):
        engine = EngineBlocks(1 << 20)
        held = len(ids) // BLOCK_TOKENS if i == 0 else shared
        engine.apply(
            {
                "type": "BlockStored",
                "block_hashes": list(range(held)),
                "parent_block_hash": None,
                "token_ids": ids[: held * BLOCK_TOKENS],
                "block_size": BLOCK_TOKENS,
            }
        )
        engines.append(engine)
    return engines


def per_call_us(work: Callable[[], object], repeat: int) -> float:
    work()  # warm
    start = time.perf_counter()
    for _ in range(repeat):
        work()
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(str(build(f"{tmp}/tok")))
    rng = random.Random(12)
    print(
        "| prompt | chars | tokens | `prefix`: hash blocks (µs) | lookups, 16 replicas (µs) |"
        " `precise_prefix`: encode the rendered prompt (µs) | key 16-token blocks (µs) |"
        " lookups, 16 replicas (µs) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, rules, product in (
        ("generation, 500 in", 0, 2_000),
        ("classification, 4,000 in", 12_000, 4_000),
        ("long context, 16,000 in", 48_000, 16_000),
    ):
        messages = [{"role": "user", "content": text(rng, product)}]
        if rules:
            messages.insert(0, {"role": "system", "content": text(rng, rules)})
        body: dict[str, Any] = {"messages": messages}
        prompt = prompt_text(body)
        assert isinstance(prompt, str)
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        tokens = len(ids)
        blocks = chain(None, prompt, BLOCK_CHARS, 1024)
        index = PrefixIndex(65_536)
        for i in range(REPLICAS):  # every replica holds the rules, one holds it all
            index.record(f"r{i}", blocks if i == 0 else blocks[: rules // BLOCK_CHARS])
        hashing = per_call_us(partial(hash_prompt, body), args.repeat)
        # Only the encoding, by the entry point the gateway uses (HFCounter): the template is
        # rendered already when the gateway counts exactly.
        backend = tokenizer.backend_tokenizer
        encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        encode = per_call_us(
            partial(encode_batch, [rendered], add_special_tokens=False),
            max(10, args.repeat // 10),
        )
        lookups = per_call_us(partial(look_up, index, blocks), args.repeat)
        keys = token_blocks(ids, BLOCK_TOKENS, None, None, 1024)
        keying = per_call_us(
            partial(token_blocks, ids, BLOCK_TOKENS, None, None, 1024), args.repeat
        )
        shared = len(tokenizer(rendered[: rules + 40], add_special_tokens=False)["input_ids"])
        engines = engines_holding(ids, shared // BLOCK_TOKENS if rules else 0)
        engine_lookups = per_call_us(partial(engine_look_up, engines, keys), args.repeat)
        print(
            f"| {label} | {len(prompt):,} | {tokens:,} | {hashing:.1f} | {lookups:.1f} |"
            f" {encode:.0f} | {keying:.1f} | {engine_lookups:.1f} |"
        )


if __name__ == "__main__":
    main()
