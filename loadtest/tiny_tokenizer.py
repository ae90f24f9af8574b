"""Build a small byte-level BPE tokenizer with a Gemma-style chat template, saved for `AutoTokenizer`.

Nothing here downloads anything: the vocabulary is trained with `tokenizers` on generated text, so
tests and demos get a real Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json,
chat template) that `transformers.AutoTokenizer.from_pretrained(dir)` loads like a model's own.

    python -m loadtest.tiny_tokenizer DIR
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

WORDS = (
    "product rules prohibit weapons drugs counterfeit allow review listing seller brand price "
    "description image text ocr compliance policy shipping battery lithium medical claim cure "
    "children toy safety certificate warranty refund the a of and to in is for on with that this "
    "be are as it by from or at not must any all may only if no yes each item category label "
    "generate analysis report summary long detailed answer question explain because therefore"
).split()


def corpus(lines: int = 3000, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 40))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        out.append(" ".join(words) + rng.choice([".", "!", "?", ":", ",", "\n"]))
    return out


def ensure(directory: str | Path) -> str:
    """`directory`, with the tiny tokenizer built in it first if it holds none."""
    if not (Path(directory) / "tokenizer.json").exists():
        print(f"building the demo tokenizer in {os.path.relpath(directory)} ...", flush=True)
        build(directory)
    return str(directory)


SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def build(directory: str | Path, vocab_size: int = 2000) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    return save(tokenizer, directory)


def save(tokenizer: Any, directory: str | Path) -> Path:
    """A trained `tokenizers.Tokenizer` (with `SPECIALS`) as a model directory: BOS added to
    every encoding, the Gemma-style chat template, loadable by `AutoTokenizer`."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bos = tokenizer.token_to_id("<bos>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    path = Path(directory)
    fast.save_pretrained(str(path))
    return path


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else "tiny-tokenizer"))
