"""Build a tiny random Llama that vLLM serves: 2 layers, hidden 128, and the tiny BPE tokenizer.

The real-vLLM suite (`make test-vllm`) needs a model directory vLLM loads like any Hugging Face
checkpoint, made here without a download: the tokenizer comes from `loadtest.tiny_tokenizer`
(Gemma-style chat template), the weights are random with a fixed seed and saved with
`save_pretrained`. It needs torch, which only vLLM's environment has, so run it with that python:

    $VLLM_PYTHON -m loadtest.tiny_llama DIR [LABELS]

With LABELS, the same body with a sequence-classification head of that many labels, its weights
in the checkpoint (seeded like the rest): what vLLM's `/classify` serves (and, with one label,
`/rerank` and `/score`). A causal LM converted by vLLM's `--convert classify` has no such weights
to load: its head's values are whatever memory held, and a NaN among them fails the answer's
JSON encoding at random.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

from loadtest.tiny_tokenizer import build as build_tokenizer
from loadtest.vllm_server import MAX_MODEL_LEN

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head size 64, which vLLM's CPU attention supports
    "num_key_value_heads": 2,
    "max_position_embeddings": MAX_MODEL_LEN,  # what vLLM serves it with
}
SEED = 0


def build(directory: str | Path, labels: int | None = None) -> Path:
    """Write tokenizer, config and random weights to `directory` (a classifier of `labels`
    labels, with them); return it."""
    path = build_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        **SHAPE,
    )
    torch.manual_seed(SEED)
    if labels is None:
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    else:
        config.num_labels = labels
        model = LlamaForSequenceClassification(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    return path


if __name__ == "__main__":
    print(
        build(
            sys.argv[1] if len(sys.argv) > 1 else "tiny-llama",
            int(sys.argv[2]) if len(sys.argv) > 2 else None,
        )
    )
