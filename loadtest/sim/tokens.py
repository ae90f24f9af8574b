"""Prompt token counts, as vLLM's OpenAI server would compute them.

With a tokenizer directory, chat requests are rendered with the tokenizer's chat template
(`add_generation_prompt` defaults to true, as in vLLM) and encoded without adding special
tokens; completion prompts are encoded with them (vLLM's `add_special_tokens` defaults: false
for chat, true for completions); token-id prompts count as their length. Without one, four
characters make a token (plus four per chat message for the template's markers, the same rule
as the gateway's `estimate` counter, so both sides agree).

Counting must not stall the event loop that paces the engine: results are cached by content
(load generators reuse prompts), and long texts are rendered and encoded on a worker thread
through the batch entry point, which releases the GIL.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import orjson

from gateway.tokens import TemplateError, render_chat

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

CHARS_PER_TOKEN = 4
PER_MESSAGE = 4
INLINE_MAX_CHARS = 2000  # shorter texts are cheaper to count than to hand to a thread
CACHE_ENTRIES = 8192


class PromptError(ValueError):
    """The request's prompt or messages cannot be counted (answered with a 400)."""


def message_text(content: Any) -> str:
    """A message's text; content parts are joined with newlines, as vLLM does for text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "\n".join(str(p) for p in parts if p)
    raise PromptError("message content must be a string or a list of parts")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise PromptError("each message needs a 'role'")
        out.append({**message, "content": message_text(message.get("content"))})
    return out


def single_prompt(body: dict[str, Any]) -> str | list[int]:
    """The one prompt of a completions request: text or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:  # C speed
        return prompt
    raise PromptError(
        "'prompt' must be one non-empty string or list of token ids (the simulator does not"
        " batch prompts)"
    )


class PromptCounter(Protocol):
    async def count_chat(self, body: dict[str, Any]) -> int: ...
    async def count_completion(self, body: dict[str, Any]) -> int: ...


class CharCounter:
    """Four characters a token: for runs without a tokenizer directory."""

    async def count_chat(self, body: dict[str, Any]) -> int:
        messages = _messages(body)
        text = sum(math.ceil(len(m["content"]) / CHARS_PER_TOKEN) for m in messages)
        return text + PER_MESSAGE * len(messages)

    async def count_completion(self, body: dict[str, Any]) -> int:
        prompt = single_prompt(body)
        return len(prompt) if isinstance(prompt, list) else math.ceil(len(prompt) / CHARS_PER_TOKEN)


@lru_cache(maxsize=8)
def _load(directory: str) -> Any:
    """One tokenizer per directory per process: replicas in one process share it."""
    from transformers import AutoTokenizer

    if not Path(directory).is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory!r} does not exist")
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sim-tokenize")
"""One thread: the batch encoder is itself parallel, and the engine loop needs the other core."""


class TokenizerCounter:
    """Exact counts with a Hugging Face tokenizer from a local directory."""

    def __init__(self, directory: str | Path) -> None:
        self.tokenizer = _load(str(directory))
        backend = self.tokenizer.backend_tokenizer
        self._encode_batch: Callable[..., Any] = getattr(
            backend, "encode_batch_fast", backend.encode_batch
        )
        self._cache: OrderedDict[tuple[int, int], int] = OrderedDict()

    def _length(self, text: str, special: bool) -> int:
        return len(self._encode_batch([text], add_special_tokens=special)[0].ids)

    def _chat_length(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> int:
        try:  # the same rendering as the gateway's: both follow vLLM's chat request handling
            rendered = render_chat(self.tokenizer, messages, body)
        except TemplateError as exc:  # vLLM answers 400 too
            raise PromptError(str(exc)) from None
        return self._length(rendered, body.get("add_special_tokens", False))

    async def _cached(self, key_bytes: bytes, size: int, compute: Callable[[], int]) -> int:
        key = (hash(key_bytes), len(key_bytes))
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        if size > INLINE_MAX_CHARS:
            count = await asyncio.get_running_loop().run_in_executor(_EXECUTOR, compute)
        else:
            count = compute()
        self._cache[key] = count
        if len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return count

    async def count_chat(self, body: dict[str, Any]) -> int:
        messages = _messages(body)
        flags = (
            body.get("add_generation_prompt", True),
            body.get("continue_final_message", False),
            body.get("add_special_tokens", False),
            body.get("tools"),
            body.get("chat_template_kwargs"),
        )
        key = orjson.dumps([messages, flags])
        return await self._cached(b"c" + key, len(key), lambda: self._chat_length(messages, body))

    async def count_completion(self, body: dict[str, Any]) -> int:
        prompt = single_prompt(body)
        if isinstance(prompt, list):
            return len(prompt)
        special = bool(body.get("add_special_tokens", True))
        key = (b"p1" if special else b"p0") + prompt.encode()
        return await self._cached(key, len(prompt), lambda: self._length(prompt, special))


def prompt_counter(tokenizer: str | Path | None) -> PromptCounter:
    return CharCounter() if tokenizer is None else TokenizerCounter(tokenizer)
