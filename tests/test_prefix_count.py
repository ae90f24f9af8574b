"""Counts from cached prefixes equal the tokenizer's own count of the whole text, for each family
of tokenizers gateway/prefixcount.py proves exactness for, and a tokenizer it cannot is left off.

The tokenizers are trained here on generated text (nothing is downloaded), saved, and loaded back
through `AutoTokenizer` from their directories, as the gateway loads a model's tokenizer.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

from gateway.policy.compile import Policy, load_policy
from gateway.prefixcount import (
    LLAMA3_PATTERN,
    NO_MERGE,
    OFF,
    PRE_TOKENIZER_SPLIT,
    QWEN2_PATTERN,
    PrefixCounts,
)
from gateway.tokenizer_threads import CountingThreads
from gateway.tokens import HFCounter, load_tokenizer
from loadtest.tiny_tokenizer import WORDS, save
from loadtest.tiny_tokenizer import corpus as tiny_corpus
from tests.conftest import basic_policy, write_policy

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# What the texts are made of: words, whitespace of every kind around newlines, contractions,
# digits, punctuation, non-ASCII (combining marks, emoji, CJK, NBSP, line separator, a literal
# `▁`) and the added tokens themselves.
ATOMS = [
    *WORDS[:30], " ", "  ", "\n", "\n\n", " \n", "\n ", "\t", "\r\n", ".", ":", "!\n", "'s", "'t",
    "42", "1234567", "é", "e\u0301", "ü", "中文", "🙂", "\u00a0", "\u2028", "▁", "-", "--",
    "<start_of_turn>", "<end_of_turn>", "<bos>",
]  # fmt: skip


def corpus() -> list[str]:
    """The tiny corpus with lines joined by newlines, whitespace runs and the odd atom, so the
    vocabulary learns tokens around newlines (which the proofs must rule in or out)."""
    lines = tiny_corpus(1500)
    return [
        "\n".join(lines[n : n + 5]) + ATOMS[n % len(ATOMS)] + "\n\n  " + lines[n]
        for n in range(0, len(lines), 5)
    ]


def byte_level(directory: Path, split: str | None, nfc: bool = False) -> Path:
    """Byte-level BPE whose pieces come from GPT-2's split regex (ByteLevel's own), or from
    `split`'s (Llama 3's, Qwen 2's: a Split pre-tokenizer before a ByteLevel one without its
    regex); `nfc`: after an NFC normalizer, as Qwen 2's."""
    tokenizer = Tokenizer(models.BPE())
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False)
        if split is None
        else pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    return save(tokenizer, directory)


def sentencepiece_style(directory: Path, shape: str, *, isolate_newlines: bool = True) -> Path:
    """BPE over `▁`-for-space text, as converted SentencePiece models are, in five `shape`s:
    "legacy" (Llama 2: Prepend + Replace normalizer, no pre-tokenizer; "bytes": the newline is
    Llama 2's byte-fallback `<0x0A>`, no token of its own), "metaspace" (newer
    conversions: Metaspace without split), "split" (Metaspace with split and a `▁` before every
    added-token split), "gemma" (Replace normalizer, a Split at a string). Trained with newline
    runs isolated, as SentencePiece keeps them, the vocabulary has no token joining a newline to
    what follows; trained without, it has."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    metaspace = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    newlines = pre_tokenizers.Split(Regex("\n+"), "isolated")
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([newlines, metaspace]) if isolate_newlines else metaspace
    )
    trainer = trainers.BpeTrainer(vocab_size=3000, special_tokens=SPECIALS)
    tokenizer.train_from_iterator(corpus(), trainer)
    replace = normalizers.Replace(" ", "▁")
    if shape in ("legacy", "bytes"):
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace])
        tokenizer.pre_tokenizer = None
        if shape == "bytes":
            tokenizer = newline_as_byte(tokenizer)
    elif shape == "gemma":
        tokenizer.normalizer = replace
        tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_previous")
    else:
        split = shape == "split"
        scheme = "always" if split else "first"
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme, split=split)
    return save(tokenizer, directory)


def newline_as_byte(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` without a token holding a newline, and with byte fallback: a newline is then
    `<0x0A>`, as in Llama 2's vocabulary."""
    config = json.loads(tokenizer.to_str())
    model = config["model"]
    vocab = {t: i for t, i in model["vocab"].items() if "\n" not in t}
    top = max(model["vocab"].values()) + 1
    vocab.update({f"<0x{b:02X}>": top + b for b in range(256)})
    model["vocab"] = vocab
    model["merges"] = [m for m in model["merges"] if "\n" not in "".join(m)]
    model["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(config))


SENTENCEPIECE = ("metaspace", "legacy", "bytes", "split", "gemma")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Any]:
    """Each family by name, loaded through `AutoTokenizer`; `tiny` is the gateway's own test one
    (GPT-2's regex too, but a corpus without whitespace before newlines)."""
    base = tmp_path_factory.mktemp("prefix-tokenizers")
    dirs = {
        "tiny": tokenizer_dir,
        "gpt2": byte_level(base / "gpt2", None),
        "llama3": byte_level(base / "llama3", LLAMA3_PATTERN),
        "qwen2": byte_level(base / "qwen2", QWEN2_PATTERN, nfc=True),
        **{shape: sentencepiece_style(base / shape, shape) for shape in SENTENCEPIECE},
        "merging": sentencepiece_style(base / "merging", "metaspace", isolate_newlines=False),
    }
    return {
        name: AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        for name, d in dirs.items()
    }


MODES = {
    "tiny": PRE_TOKENIZER_SPLIT,
    "gpt2": PRE_TOKENIZER_SPLIT,
    "llama3": PRE_TOKENIZER_SPLIT,
    "qwen2": PRE_TOKENIZER_SPLIT,
    "metaspace": NO_MERGE,
    "legacy": NO_MERGE,
    "bytes": NO_MERGE,
    "split": NO_MERGE,
    "gemma": NO_MERGE,
    "merging": OFF,
}
EXACT = [name for name, mode in MODES.items() if mode != OFF]

texts = st.lists(st.sampled_from(ATOMS), min_size=0, max_size=120).map("".join)
PROPERTY = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def whole(tokenizer: Any, text: str, special: bool = False) -> int:
    return len(tokenizer.backend_tokenizer.encode(text, add_special_tokens=special).ids)


def test_each_family_reports_its_mode(tokenizers) -> None:
    for name, tokenizer in tokenizers.items():
        assert PrefixCounts(tokenizer.backend_tokenizer, entries=8).mode == MODES[name], name


@pytest.mark.parametrize("name", EXACT)
@PROPERTY
@given(text=texts, block=st.integers(1, 40), special=st.booleans())
def test_cut_counts_equal_a_whole_encode(tokenizers, name, text, block, special) -> None:
    """Random texts cut every `block` characters (so most contain many cuts), cold cache."""
    tokenizer = tokenizers[name]
    counts = PrefixCounts(tokenizer.backend_tokenizer, entries=1024, block_chars=block)
    assert counts.lengths([text], special) == [whole(tokenizer, text, special)]


@pytest.mark.parametrize("name", EXACT)
@PROPERTY
@given(shared=texts, rests=st.lists(texts, min_size=1, max_size=4), block=st.integers(1, 24))
def test_a_shared_prefix_then_different_rests(tokenizers, name, shared, rests, block) -> None:
    """Repeated prefixes with different suffixes: later texts start from cached prefixes, whatever
    (whitespace, a newline, an added token) sits where the shared part ends."""
    tokenizer = tokenizers[name]
    counts = PrefixCounts(tokenizer.backend_tokenizer, entries=64, block_chars=block)
    prompts = [shared + rest for rest in [*rests, *rests]]
    for prompt in prompts:
        assert counts.lengths([prompt], False) == [whole(tokenizer, prompt)], prompt
    assert counts.lengths(prompts, True) == [whole(tokenizer, p, True) for p in prompts]


def rules_block() -> str:
    lines = [" ".join(WORDS[n : n + 12]) + (".", ":", "", " 42")[n % 4] for n in range(60)]
    return "Rules:\n" + "\n".join(lines) + "\n\nProduct:\n"


@pytest.mark.parametrize("name", EXACT)
def test_the_second_prompt_encodes_only_what_follows_the_shared_block(tokenizers, name) -> None:
    tokenizer = tokenizers[name]
    counts = PrefixCounts(tokenizer.backend_tokenizer, entries=64, block_chars=256)
    encoded: list[int] = []
    encode = counts._encode

    def spy(batch: list[str], **kwargs: Any) -> Any:
        encoded.append(sum(map(len, batch)))
        return encode(batch, **kwargs)

    counts._encode = spy
    rules = rules_block()
    for product in ("a toy\nwith a lithium battery", "refund policy\n\nno brand", "medical cure"):
        prompt = rules + product
        assert counts.lengths([prompt], False) == [whole(tokenizer, prompt)]
    assert encoded[0] >= len(rules)
    assert all(size < 256 + 64 for size in encoded[1:]), encoded


def test_the_cache_keeps_at_most_its_entries(tokenizers) -> None:
    tokenizer = tokenizers["llama3"]
    counts = PrefixCounts(tokenizer.backend_tokenizer, entries=3, block_chars=64)
    rules = rules_block()
    for n in range(20):
        prompt = f"{n}\n{rules}" if n % 2 else rules + str(n)
        assert counts.lengths([prompt], False) == [whole(tokenizer, prompt)]
        assert len(counts._cache) <= 3


def test_lookups_are_counted_hit_or_miss_and_entries_held(tokenizers) -> None:
    """A text with cuts is one lookup: a miss, then a hit for a text sharing its prefix. A text
    too short to cut is none."""
    tokenizer = tokenizers["llama3"]
    counts = PrefixCounts(tokenizer.backend_tokenizer, entries=64, block_chars=256)
    rules = rules_block()
    counts.lengths(["short"], False)
    assert (counts.hits, counts.misses, counts.held) == (0, 0, 0)
    counts.lengths([rules + "a toy"], False)
    assert (counts.hits, counts.misses) == (0, 1)
    held = counts.held
    assert held >= len(rules) // 256 - 1  # a prefix at each cut, about one per block
    assert counts.lengths([rules + "medical cure", "short"], False) == [
        whole(tokenizer, rules + "medical cure"),
        whole(tokenizer, "short"),
    ]
    assert (counts.hits, counts.misses) == (1, 1)


def test_no_entries_caches_nothing_and_every_lookup_misses(tokenizers) -> None:
    tokenizer = tokenizers["llama3"]
    counts = PrefixCounts(tokenizer.backend_tokenizer, entries=0, block_chars=256)
    prompt = rules_block() + "a toy"
    for _ in range(2):
        assert counts.lengths([prompt], False) == [whole(tokenizer, prompt)]
    assert (counts.hits, counts.misses, counts.held) == (0, 2, 0)


def test_an_unprovable_tokenizer_is_off_and_counts_the_same(tokenizers) -> None:
    """Trained without newlines kept apart, the vocabulary joins a newline to what follows, so a
    cut there could be crossed by a merge: the mode is off and texts are encoded whole."""
    tokenizer = tokenizers["merging"]
    vocab = tokenizer.backend_tokenizer.get_vocab()
    assert any("\n" in t.rstrip("\n") for t in vocab)  # why the proof fails
    counts = PrefixCounts(tokenizer.backend_tokenizer, entries=64, block_chars=4)
    text = rules_block() + "a toy"
    for _ in range(2):
        assert counts.lengths([text, "short"], True) == [
            whole(tokenizer, text, True),
            whole(tokenizer, "short", True),
        ]
    assert not counts._cache


@pytest.mark.parametrize("name", [*EXACT, "merging"])
async def test_hf_counter_counts_long_chats_and_prompts_exactly(tokenizers, name, tmp_path) -> None:
    """Through HFCounter, on its threads: a rules block and a unique part in one message, rendered
    whole (exact mode) or memoized per message (which sums its contents' own counts), and
    completions prompts (BOS once, at the start)."""
    tokenizers[name].save_pretrained(str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    for memoized in (False, True):
        counter = HFCounter(
            loaded,
            memoized=memoized,
            threads=CountingThreads(2, "tokenize"),
            inline_max_chars=512,
            cache_entries=64,
        )
        assert counter.prefix_mode == MODES[name]
        for product in ("a toy", "a battery\n\n", "<end_of_turn>\nchildren toy"):
            content = rules_block() + product
            messages = [{"role": "user", "content": content}]
            if memoized:
                overhead = counter._template_overhead(messages, {})
                assert overhead is not None
                expected = overhead + whole(loaded, content.strip())
            else:
                rendered = loaded.apply_chat_template(messages, add_generation_prompt=True)
                expected = len(rendered["input_ids"])
            assert await counter.count_chat({"messages": messages}) == expected, product
            assert await counter.count_prompts(content) == [whole(loaded, content, True)]


@pytest.fixture
def policy_counter(tmp_path, tokenizer_dir) -> Iterator[Callable[..., HFCounter]]:
    """The tiny model's counter as the gateway compiles it from a policy with `server` fields."""
    policies: list[Policy] = []

    def load(**server: Any) -> HFCounter:
        policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:1"])
        policies.append(load_policy(write_policy(tmp_path, {**policy, "server": server})))
        counter = policies[-1].models["tiny"].counter
        assert isinstance(counter, HFCounter)
        return counter

    yield load
    for policy in policies:
        policy.close()


async def test_the_policys_block_size_sets_where_long_texts_are_cut(policy_counter) -> None:
    """A cut just after the first newline past each multiple of the block: a prefix cached at each
    (the rules' lines are shorter than either block, so each block has its own)."""
    text = rules_block() + "a toy"
    assert len(text) == 4130
    for block, cuts in ((256, 16), (1024, 4)):
        counter = policy_counter(prefix_cache_block_chars=block)
        assert counter.prefix_mode == PRE_TOKENIZER_SPLIT
        assert await counter.count_prompts(text) == [whole(counter.tokenizer, text, True)]
        assert counter.prefixes is not None and counter.prefixes.held == cuts, block


async def test_the_policys_entries_bound_the_cache_and_0_turns_it_off(policy_counter) -> None:
    text = rules_block() + "a toy"
    small = policy_counter(prefix_cache_entries=3, prefix_cache_block_chars=256)
    assert await small.count_prompts(text) == [whole(small.tokenizer, text, True)]
    assert small.prefixes is not None and small.prefixes.held == 3
    off = policy_counter(prefix_cache_entries=0)
    assert (off.prefix_mode, off.prefixes) == (OFF, None)
    for rest in ("a toy", "a toy", "medical cure"):
        assert await off.count_prompts(rules_block() + rest) == [
            whole(off.tokenizer, rules_block() + rest, True)
        ]


def test_nfc_starts_no_non_whitespace_character_with_whitespace() -> None:
    """The NFC step of the Llama 3 argument: a text after a cut starts with a non-whitespace
    character, and still does after NFC. Its first character is then that character's normal
    form, or a composite of its decomposition's first character with marks; neither is
    whitespace, as no whitespace character decomposes to anything but whitespace first."""
    for code in range(sys.maxunicode + 1):
        if 0xD800 <= code <= 0xDFFF:
            continue
        char = chr(code)
        first = unicodedata.normalize("NFD", char)[0]
        if char != "\n":  # the no-merge rule's: what follows a cut's newline is none after NFC
            assert unicodedata.normalize("NFC", char)[0] != "\n", hex(code)
        if char.isspace():
            assert first.isspace(), hex(code)
        else:
            assert not first.isspace(), hex(code)
            assert not unicodedata.normalize("NFC", char)[0].isspace(), hex(code)
