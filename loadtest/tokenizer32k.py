"""A 32k-vocabulary byte-level BPE tokenizer with Llama 3's split regex, built here in seconds.

What the CPU benchmarks count with: the tiny demo tokenizer (2,000 tokens) makes counting look
cheaper than a model's own vocabulary does. Nothing is downloaded: the vocabulary is trained
with `tokenizers` on pseudo-words drawn Zipf-like from ~43,000 (so BPE reaches 32,000 merges in
about two seconds), with loadtest.tiny_tokenizer's Gemma-style chat template, saved for
`transformers.AutoTokenizer` as a model's directory is.

    python -m loadtest.tokenizer32k DIR
"""

from __future__ import annotations

import random
import sys
from functools import cache
from pathlib import Path

from loadtest.tiny_tokenizer import SPECIALS, save

VOCAB_SIZE = 32_000
# Llama 3's pre-tokenizer split regex, exactly as its tokenizer.json writes it.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SYLLABLES = (
    "ka lo mi ne su ta ri po an el is or un ex de re pro con tion ment ing er ly bra qui sto"
    " fen gal mor vit zan hul pex"
).split()


@cache
def lexicon() -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The pseudo-words and their Zipf-like weights (fixed: the vocabulary is trained on them)."""
    rng = random.Random(3)
    words = sorted({"".join(rng.choices(SYLLABLES, k=rng.randint(2, 5))) for _ in range(60_000)})
    rng.shuffle(words)
    return tuple(words), tuple(1 / (rank + 1) ** 0.7 for rank in range(len(words)))


def text(rng: random.Random, words: int) -> str:
    """`words` pseudo-words in lines of 12: about 1.3 tokens a word with this vocabulary."""
    lexicon_words, weights = lexicon()
    drawn = rng.choices(lexicon_words, weights, k=words)
    return "\n".join(" ".join(drawn[i : i + 12]) + "." for i in range(0, words, 12))


def build(directory: str | Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(4)
    tokenizer.train_from_iterator((text(rng, 600) for _ in range(500)), trainer)
    return save(tokenizer, directory)


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else "tokenizer-32k"))
