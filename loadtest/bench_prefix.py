"""What the prefix scorer costs per request: hashing the prompt's characters into chained
blocks against tokenizing it, and the index lookups, on prompts of the seed's shapes.

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

from gateway.pick.affinity import chain, prompt_text
from gateway.pick.prefix_index import PrefixIndex
from loadtest.tiny_tokenizer import WORDS, build

BLOCK_CHARS = 256
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
        "| prompt | chars | tokens | hash blocks (µs) | encode the rendered prompt (µs) | lookups, 16 replicas (µs) |"
    )
    print("|---|---|---|---|---|---|")
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
        tokens = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        blocks = chain(None, prompt, BLOCK_CHARS, 1024)
        index = PrefixIndex(65_536)
        for i in range(REPLICAS):  # every replica holds the rules, one holds it all
            index.record(f"r{i}", blocks if i == 0 else blocks[: rules // BLOCK_CHARS])
        hashing = per_call_us(partial(hash_prompt, body), args.repeat)
        # Only the encoding: the template is rendered already when the gateway counts exactly.
        encode = per_call_us(
            partial(tokenizer, rendered, add_special_tokens=False), max(10, args.repeat // 10)
        )
        lookups = per_call_us(partial(look_up, index, blocks), args.repeat)
        print(
            f"| {label} | {len(prompt):,} | {tokens:,} | {hashing:.1f} | {encode:.0f} |"
            f" {lookups:.1f} |"
        )


if __name__ == "__main__":
    main()
