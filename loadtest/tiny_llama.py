"""Build a tiny random Llama that vLLM serves: 2 layers, hidden 128, and the tiny BPE tokenizer.

The real-vLLM suite (`make test-vllm`) needs a model directory vLLM loads like any Hugging Face
checkpoint, made here without a download: the tokenizer comes from `loadtest.tiny_tokenizer`
(Gemma-style chat template), the weights are random with a fixed seed and saved with
`save_pretrained`. It needs torch, which only vLLM's environment has, so run it with that python:

    $VLLM_PYTHON -m loadtest.tiny_llama DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

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


def build(directory: str | Path) -> Path:
    """Write tokenizer, config and random weights to `directory`; return it."""
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
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    return path


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
