"""Prompt token ids, as vLLM's OpenAI server would compute them.

The engine needs the ids, not only their count: its prefix cache hashes them block by block.
With a tokenizer directory, chat requests are rendered with the tokenizer's chat template
(`add_generation_prompt` defaults to true, as in vLLM) and encoded without adding special
tokens; completion prompts are encoded with them (vLLM's `add_special_tokens` defaults: false
for chat, true for completions); token-id prompts are taken as given. Without one, four
characters make a token (plus four per chat message for the template's markers, the same rule
as the gateway's `estimate` counter, so both sides agree), and each pseudo-token stands for
its four characters, so identical text prefixes give identical ids and identical block hashes.

Generated text: each simulated output token is one fixed string that re-encodes to exactly one
token, also repeated (see `output_token_text`), so clients that re-count the text (aiperf,
inference-perf, genai-perf) count as many output tokens as `usage` says.

Encoding must not stall the event loop that paces the engine: results are cached by content
(load generators reuse prompts), and long texts are rendered and encoded on a worker thread
through the batch entry point, which releases the GIL. Ids are kept as 8-byte arrays, and the
cache is bounded in tokens as well as in entries, because load generators send long prompts.
"""

from __future__ import annotations

import asyncio
import logging
import os
from array import array
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import orjson

from gateway.errors import BadRequest
from gateway.tokenizer.chat_template import ChatTemplate

log = logging.getLogger("loadtest.sim")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

CHARS_PER_TOKEN = 4
PER_MESSAGE = 4
INLINE_MAX_CHARS = 2000  # shorter texts are cheaper to count than to hand to a thread
CACHE_ENTRIES = 8192
CACHE_TOKENS = 8_000_000  # 64 MB of ids: a few thousand long prompts

DEFAULT_TOKEN_TEXT = " the"
"""One generated token's text without a tokenizer. A space then a very common word is one
token in byte-level BPE vocabularies (GPT-2 style, Llama 3, Gemma, Qwen), and the space starts
a new pre-token, so N copies re-encode to N tokens. (" tok" was split in two by them.)"""

CANDIDATE_WORDS = ("the", "and", "of", "to", "in", "is", "for", "that", "on", "with", "it", "a")
VOCAB_SCAN = 5000  # vocabulary entries tried when no common word qualifies

PromptIds = array
"""A prompt's token ids (typecode "q"); its length is the prompt's token count."""


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


def token_ids(ids: list[int]) -> PromptIds:
    """A token-id prompt as given; ids that do not fit 64 bits are no token ids."""
    try:
        return array("q", ids)
    except OverflowError:
        raise PromptError("token ids must be 64-bit integers") from None


class PromptEncoder(Protocol):
    token_text: str  # one generated token's text, re-encoding to one token

    async def encode_chat(self, body: dict[str, Any]) -> PromptIds: ...
    async def encode_completion(self, body: dict[str, Any]) -> PromptIds: ...


def _pseudo_tokens(text: str, out: PromptIds) -> None:
    """One pseudo-token per four characters (the last may be shorter), exact: the four as
    UTF-16, 8 bytes, read as one int64 at C speed (a hash per chunk cost 3 ms per 16,000
    characters, which starved a replica's loop at a time scale of 10). Text outside the Basic
    Multilingual Plane, whose characters take two UTF-16 units, is hashed chunk by chunk."""
    padded = text + "\0" * (-len(text) % CHARS_PER_TOKEN)
    data = padded.encode("utf-16-le", "surrogatepass")
    if len(data) == 2 * len(padded):
        out.frombytes(data)
    else:
        out.extend(
            hash(text[i : i + CHARS_PER_TOKEN]) for i in range(0, len(text), CHARS_PER_TOKEN)
        )


def _one_token_each(tokenizer: Any, text: str) -> bool:
    """`text` encodes to one token, and two and three copies of it to two and three."""
    for n in (1, 2, 3):
        ids = tokenizer.encode(text * n, add_special_tokens=False)
        if len(ids) != n or tokenizer.decode(ids) != text * n:
            return False
    return True


def output_token_text(tokenizer: Any) -> str:
    """The text of one generated token for this tokenizer: a common word with a leading space
    (the space or word-boundary marker makes the pre-tokenizer split copies apart, so BPE merges
    cannot join them), else the first such entry of its vocabulary, else the default. Only ASCII
    letters after the space, so the text needs no JSON escaping."""
    words = [" " + word for word in CANDIDATE_WORDS]
    vocab = sorted(tokenizer.get_vocab().values())[:VOCAB_SCAN]
    decoded = (tokenizer.decode([i]) for i in vocab)
    for text in [*words, *decoded]:
        tail = text[1:]
        if (
            text[:1] == " "
            and tail.isascii()
            and tail.isalpha()
            and _one_token_each(tokenizer, text)
        ):
            return text
    log.warning("no vocabulary entry re-encodes to one token; generated text may re-count")
    return DEFAULT_TOKEN_TEXT


class CharEncoder:
    """Four characters a token: for runs without a tokenizer directory.

    A chat message is its role's four marker pseudo-tokens, then its text's: the count is the
    gateway's `estimate` rule, and a shared leading run of messages gives shared ids.
    """

    token_text = DEFAULT_TOKEN_TEXT

    async def encode_chat(self, body: dict[str, Any]) -> PromptIds:
        ids = array("q")
        for message in _messages(body):
            ids.extend(hash((message["role"], marker)) for marker in range(PER_MESSAGE))
            _pseudo_tokens(message["content"], ids)
        return ids

    async def encode_completion(self, body: dict[str, Any]) -> PromptIds:
        prompt = single_prompt(body)
        if isinstance(prompt, list):
            return token_ids(prompt)
        ids = array("q")
        _pseudo_tokens(prompt, ids)
        return ids


@lru_cache(maxsize=8)
def _load(directory: str) -> Any:
    """One tokenizer per directory per process: replicas in one process share it."""
    from transformers import AutoTokenizer

    if not Path(directory).is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory!r} does not exist")
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


@lru_cache(maxsize=8)
def _token_text(directory: str) -> str:
    """Chosen once per directory per process, like the tokenizer itself."""
    return output_token_text(_load(directory))


_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sim-tokenize")
"""One thread: the batch encoder is itself parallel, and the engine loop needs the other core."""


class TokenizerEncoder:
    """Exact ids with a Hugging Face tokenizer from a local directory."""

    def __init__(self, directory: str | Path) -> None:
        self.tokenizer = _load(str(directory))
        backend = self.tokenizer.backend_tokenizer
        self._encode_batch: Callable[..., Any] = getattr(
            backend, "encode_batch_fast", backend.encode_batch
        )
        self._cache: OrderedDict[tuple[int, int], PromptIds] = OrderedDict()
        self._cached_tokens = 0
        self.token_text = _token_text(str(directory))
        self.template = ChatTemplate(self.tokenizer)

    def _encode(self, text: str, special: bool) -> PromptIds:
        return array("q", self._encode_batch([text], add_special_tokens=special)[0].ids)

    def _encode_chat(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> PromptIds:
        try:  # the same rendering as the gateway's: both follow vLLM's chat request handling
            rendered = self.template.render({**body, "messages": messages})
        except BadRequest as exc:  # vLLM answers 400 too
            raise PromptError(exc.message) from None
        return self._encode(rendered, body.get("add_special_tokens", False))

    async def _cached(
        self, key_bytes: bytes, size: int, compute: Callable[[], PromptIds]
    ) -> PromptIds:
        key = (hash(key_bytes), len(key_bytes))
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        if size > INLINE_MAX_CHARS:
            ids = await asyncio.get_running_loop().run_in_executor(_EXECUTOR, compute)
        else:
            ids = compute()
        self._cache[key] = ids
        self._cached_tokens += len(ids)
        while len(self._cache) > CACHE_ENTRIES or self._cached_tokens > CACHE_TOKENS:
            self._cached_tokens -= len(self._cache.popitem(last=False)[1])
        return ids

    async def encode_chat(self, body: dict[str, Any]) -> PromptIds:
        messages = _messages(body)
        flags = (
            body.get("add_generation_prompt", True),
            body.get("continue_final_message", False),
            body.get("add_special_tokens", False),
            body.get("tools"),
            body.get("chat_template_kwargs"),
        )
        key = orjson.dumps([messages, flags])
        return await self._cached(b"c" + key, len(key), lambda: self._encode_chat(messages, body))

    async def encode_completion(self, body: dict[str, Any]) -> PromptIds:
        prompt = single_prompt(body)
        if isinstance(prompt, list):
            return token_ids(prompt)
        special = bool(body.get("add_special_tokens", True))
        key = (b"p1" if special else b"p0") + prompt.encode()
        return await self._cached(key, len(prompt), lambda: self._encode(prompt, special))


def prompt_encoder(tokenizer: str | Path | None) -> PromptEncoder:
    return CharEncoder() if tokenizer is None else TokenizerEncoder(tokenizer)
