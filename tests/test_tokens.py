"""Input tokens are counted as vLLM counts them, with the model's own tokenizer and chat template."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from transformers import AutoTokenizer

from gateway.tokenizer_threads import CountingThreads
from gateway.tokens import HFCounter, load_tokenizer
from loadtest.tiny_tokenizer import WORDS


def varied_conversations(count: int, seed: int = 1) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
        pad = rng.choice(["", " ", "\n", "  "])  # the template trims: boundaries must still hold
        return pad + " ".join(words) + rng.choice(["", ".", "!\n", " 42"]) + pad

    rules = text(300, 400)
    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": rules}] if rng.random() < 0.5 else []
        for turn in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": text(1, 80)})
            if turn < 2 and rng.random() < 0.5:
                messages.append({"role": "assistant", "content": text(1, 30)})
        if messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": text(1, 20)})
        out.append(messages)
    return out


def reference(tokenizer, messages) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def counter(tokenizer_dir, *, memoized: bool, inline_max_chars: int = 2048) -> HFCounter:
    return HFCounter(
        load_tokenizer(str(tokenizer_dir)),
        memoized=memoized,
        threads=CountingThreads(2, "tokenize"),
        inline_max_chars=inline_max_chars,
        cache_entries=1024,
    )


async def test_exact_chat_counts_equal_apply_chat_template(tokenizer_dir, hf) -> None:
    exact = counter(tokenizer_dir, memoized=False, inline_max_chars=500)
    for messages in varied_conversations(300):
        assert await exact.count_chat({"messages": messages}) == reference(hf, messages)


async def test_memoized_chat_counts_stay_within_one_token_per_message(tokenizer_dir, hf) -> None:
    memo = counter(tokenizer_dir, memoized=True)
    errors = []
    for messages in varied_conversations(300):
        got = await memo.count_chat({"messages": messages})
        error = got - reference(hf, messages)
        assert abs(error) <= len(messages), (messages, error)
        errors.append(error)
    # Clean content (no edge whitespace for the template to trim) is exact.
    clean = [[{"role": "user", "content": "product rules prohibit weapons."}]]
    assert await memo.count_chat({"messages": clean[0]}) == reference(hf, clean[0])


async def test_repeated_rules_block_is_counted_once(tokenizer_dir, hf) -> None:
    memo = counter(tokenizer_dir, memoized=True)
    rules = " ".join(WORDS * 40)
    for product in ("a toy", "a battery", "a lithium battery toy"):
        messages = [{"role": "system", "content": rules}, {"role": "user", "content": product}]
        assert await memo.count_chat({"messages": messages}) == reference(hf, messages)
    assert len(memo._content_counts) == 4  # the rules block once, three products


async def test_content_parts_are_joined_like_vllm(tokenizer_dir, hf) -> None:
    exact = counter(tokenizer_dir, memoized=False)
    parts = [{"type": "text", "text": "product rules"}, {"type": "text", "text": "allow review"}]
    joined = [{"role": "user", "content": "product rules\nallow review"}]
    assert await exact.count_chat({"messages": [{"role": "user", "content": parts}]}) == reference(
        hf, joined
    )


async def test_completions_count_with_special_tokens(tokenizer_dir, hf) -> None:
    exact = counter(tokenizer_dir, memoized=False, inline_max_chars=10)
    prompt = "product rules prohibit weapons and drugs"
    assert await exact.count_prompts(prompt) == [len(hf(prompt)["input_ids"])]
    assert await exact.count_prompts([prompt, "a"]) == [
        len(hf(prompt)["input_ids"]),
        len(hf("a")["input_ids"]),
    ]
    assert await exact.count_prompts([1, 2, 3]) == [3]
    assert await exact.count_prompts([[1, 2], [3]]) == [2, 1]


async def test_truncation_or_padding_in_tokenizer_json_does_not_change_a_count(
    tokenizer_dir, hf, tmp_path
) -> None:
    """Some models' tokenizer.json keeps a truncation or padding setting from training; vLLM
    counts through transformers, which turns both off for its calls, so the count does too,
    from the first request on (not only after some transformers call happened to reset them)."""
    shutil.copytree(tokenizer_dir, tmp_path / "tok")
    config_file = tmp_path / "tok" / "tokenizer.json"
    config = json.loads(config_file.read_text())
    config["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                            "stride": 0}  # fmt: skip
    config["padding"] = {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": None,
                         "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}  # fmt: skip
    config_file.write_text(json.dumps(config))
    long, short = " ".join(WORDS[:60]), "a"
    messages = [{"role": "user", "content": long}]
    for memoized, threads in ((False, None), (True, CountingThreads(2, "tokenize"))):
        counted = HFCounter(
            load_tokenizer(str(tmp_path / "tok")),
            memoized=memoized,
            threads=threads,
            inline_max_chars=64,
            cache_entries=64,
        )
        assert await counted.count_prompts([long, short]) == [
            len(hf(long)["input_ids"]),
            len(hf(short)["input_ids"]),
        ]
        assert await counted.count_chat({"messages": messages}) == reference(hf, messages)


def test_missing_tokenizer_directory_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))
