"""Input tokens are counted as vLLM counts them, with the model's own tokenizer and chat template."""

from __future__ import annotations

import json
import random
import shutil
import threading

import pytest
from transformers import AutoTokenizer

from gateway.tokenizer.backends import BackendError, TokenizersEncoder, disagreement
from gateway.tokenizer.counters import HFCounter
from gateway.tokenizer.loaded import load_tokenizer
from gateway.tokenizer.threads import CountingThreads
from loadtest.tiny_tokenizer import SPECIALS, WORDS, save
from tests.conftest import basic_policy


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


BACKENDS = ["fastokens", "tokenizers"]


def counter(tokenizer_dir, backend: str = "auto", *, inline_max_chars: int = 2048) -> HFCounter:
    loaded = HFCounter.load(
        str(tokenizer_dir),
        backend=backend,
        threads=CountingThreads(2, "tokenize"),
        inline_max_chars=inline_max_chars,
    )
    loaded.warm_inline()  # as the gateway does on its loop's thread
    return loaded


@pytest.mark.parametrize("backend", BACKENDS)
async def test_chat_counts_equal_apply_chat_template(tokenizer_dir, hf, backend) -> None:
    exact = counter(tokenizer_dir, backend, inline_max_chars=500)
    assert exact.backend == backend
    for messages in varied_conversations(300):
        assert await exact.count_chat({"messages": messages}) == reference(hf, messages)


async def test_auto_counts_with_fastokens_when_it_agrees_with_the_tokenizers_library(
    tokenizer_dir,
) -> None:
    assert counter(tokenizer_dir).backend == "fastokens"


def whitespace_word_level(directory) -> str:
    """A word-level tokenizer split on whitespace: a component fastokens does not load."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: index for index, word in enumerate([*SPECIALS, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return str(save(tokenizer, directory))


def test_a_tokenizer_fastokens_cannot_load_is_counted_by_the_tokenizers_library(tmp_path) -> None:
    directory = whitespace_word_level(tmp_path / "words")
    assert counter(directory).backend == "tokenizers"
    with pytest.raises(BackendError, match="fastokens cannot load it"):
        counter(directory, "fastokens")


class Misreads:
    """An encoder that reads one added token as plain text, as a faulty native counter might."""

    name = "faulty"

    def __init__(self, reference: TokenizersEncoder, token: str) -> None:
        self.reference, self.token = reference, token

    def batch_ids(self, texts: list[str], special: bool) -> list[list[int]]:
        return self.reference.batch_ids([t.replace(self.token, "x") for t in texts], special)

    def counts(self, texts: list[str], special: bool) -> list[int]:
        return list(map(len, self.batch_ids(texts, special)))


def test_the_self_check_finds_an_encoder_that_misreads_one_added_token(hf) -> None:
    reference = TokenizersEncoder(hf.backend_tokenizer)
    added = [token.content for token in hf.backend_tokenizer.get_added_tokens_decoder().values()]
    assert disagreement(reference, reference, added) is None
    found = disagreement(Misreads(reference, "<end_of_turn>"), reference, added)
    assert found is not None and "<end_of_turn>" in found


async def test_content_parts_are_joined_like_vllm(tokenizer_dir, hf) -> None:
    exact = counter(tokenizer_dir)
    parts = [{"type": "text", "text": "product rules"}, {"type": "text", "text": "allow review"}]
    joined = [{"role": "user", "content": "product rules\nallow review"}]
    assert await exact.count_chat({"messages": [{"role": "user", "content": parts}]}) == reference(
        hf, joined
    )


@pytest.mark.parametrize("backend", BACKENDS)
async def test_completions_count_with_special_tokens(tokenizer_dir, hf, backend) -> None:
    exact = counter(tokenizer_dir, backend, inline_max_chars=10)
    prompt = "product rules prohibit weapons and drugs"
    assert await exact.count_prompts(prompt) == [len(hf(prompt)["input_ids"])]
    assert await exact.count_prompts([prompt, "a"]) == [
        len(hf(prompt)["input_ids"]),
        len(hf("a")["input_ids"]),
    ]
    assert await exact.count_prompts([1, 2, 3]) == [3]
    assert await exact.count_prompts([[1, 2], [3]]) == [2, 1]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_truncation_or_padding_in_tokenizer_json_does_not_change_a_count(
    tokenizer_dir, hf, tmp_path, backend
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
    for inline_max_chars in (1_000_000, 64):  # on the event loop, and on the threads
        counted = counter(tmp_path / "tok", backend, inline_max_chars=inline_max_chars)
        assert await counted.count_prompts([long, short]) == [
            len(hf(long)["input_ids"]),
            len(hf(short)["input_ids"]),
        ]
        assert await counted.count_chat({"messages": messages}) == reference(hf, messages)


def test_missing_tokenizer_directory_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))


class _Noting:
    """An encoder that notes the thread of each encode."""

    def __init__(self, encoder) -> None:
        self._encoder, self.threads = encoder, []
        self.inline_share = encoder.inline_share

    def counts(self, texts: list[str], special: bool) -> list[int]:
        self.threads.append(threading.get_ident())
        return self._encoder.counts(texts, special)


async def test_a_short_text_is_counted_on_the_loop_only_once_the_loop_thread_is_warm(
    tokenizer_dir,
) -> None:
    """A thread's first encode builds the encoder's per-thread state, tens of milliseconds with
    a real tokenizer: on the event loop, that would be one request holding it."""
    fresh = HFCounter.load(
        str(tokenizer_dir), threads=CountingThreads(2, "tokenize"), inline_max_chars=2048
    )
    noting = fresh.encoder = _Noting(fresh.encoder)
    loop_thread = threading.get_ident()
    assert await fresh.count_prompts("hello world") == await counter(tokenizer_dir).count_prompts(
        "hello world"
    )
    assert noting.threads[-1] != loop_thread  # cold here: the threads count it
    fresh.warm_inline()
    assert noting.threads[-1] == loop_thread
    await fresh.count_prompts("hello world")
    assert noting.threads[-1] == loop_thread


async def test_a_gateway_warms_its_counters_on_its_loop_before_it_serves(
    stub, gateway_factory, tokenizer_dir
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    counters = [model.counter for model in gw.gateway.policy.models.values()]
    assert counters and all(c.inline_max_chars == c.inline_limit > 0 for c in counters)
