"""Counting input tokens the way vLLM will.

A chat is rendered as vLLM renders it (the model's own chat template, `add_generation_prompt`,
the request's tools and template variables) and the whole text is encoded once, without special
tokens; a completion's prompts are encoded with them. Nothing is summed from parts: real
templates merge tokens across a content's edges (Gemma 3) and rewrite contents (Qwen 3's
reasoning blocks), so only the rendered prompt's own encoding is exact. Tokenizers load from a
local directory only: the hub is never contacted. gateway/tokenizer/backends.py chooses the library that
encodes (fastokens where proven to agree with the tokenizers library, else the latter).

Tokenizer time is shared, so three rules keep one client's huge prompts from costing everyone
else's small ones. Before any encoding, a provable floor on the count (gateway/tokenizer/floor.py)
refuses what cannot fit in the context (`TooManyTokens`), so a 4 MB prompt costs no tokenizer
time. Text longer than `inline_tokenize_max_chars` is encoded on the tokenizer threads (both
encoders let the loop run meanwhile), so the event loop is never held for long. And text of
`large_tokenize_chars` or more runs on threads of its own: small texts never queue behind it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from gateway.config.schema import ServerSpec
from gateway.tokenizer.backends import AUTO, WARM_TEXT, Backend, ids
from gateway.tokenizer.chat_template import message_text, render_weight
from gateway.tokenizer.loaded import LoadedTokenizer, shared
from gateway.tokenizer.threads import CountingThreads

T = TypeVar("T")
# Converting a request to the chat vLLM renders, and rendering it, cost per JSON value (a
# message, a part, a tool, a property of a tool's schema) and per character of tool calls'
# arguments, which rendering parses as JSON (`render_weight`, docs/benchmarks.md): a request that
# weighs more is converted and rendered on the tokenizer threads, where the GIL's switch interval
# lets the loop run. 384 is 128 one-line messages, ~2.6 ms with Qwen 3's template.
INLINE_RENDER_WEIGHT = 384
# An endpoint's conversion of its request to the chat vLLM renders for it.
ToChat = Callable[[dict[str, Any]], dict[str, Any]]


class TooManyTokens(Exception):
    """Raised, before tokenizing, when a prompt has at least `tokens`, the caller's `refuse_at`."""

    def __init__(self, tokens: int) -> None:
        super().__init__(tokens)
        self.tokens = tokens


class TokenCounter(Protocol):
    """Counts input tokens for one model.

    With `refuse_at`, a counter may raise `TooManyTokens` instead of counting a prompt it can prove
    has at least that many tokens (the whole chat, or the longest prompt of a completion).
    `image_cost` is what each image adds to `count_chat`'s count; the caller adds it, from the
    images parse counted. `exact`: a text-only count is the one vLLM makes (same tokenizer, same
    rendered prompt), so a replica's `prompt_tokens` far from it is not believed.
    """

    image_cost: int
    exact: bool
    # The tokens the tokenizer adds to a text encoded with its special tokens (a BOS, say): what
    # a rendered chat encoded with `add_special_tokens` has beyond its own. Found at load.
    specials: int

    async def count_chat(
        self, body: dict[str, Any], refuse_at: int | None = None, to_chat: ToChat | None = None
    ) -> int:
        """Tokens of a chat request's rendered prompt; `to_chat` converts another endpoint's
        request to the chat vLLM renders for it (where rendering runs: it costs as much)."""
        ...

    async def count_prompts(
        self, prompt: Any, refuse_at: int | None = None, special: bool = True
    ) -> list[int]:
        """Tokens of each prompt of a completions (or embeddings) request; `special`: with the
        tokenizer's special tokens (vLLM's `add_special_tokens`, true by default)."""
        ...

    async def chat_ids(
        self, body: dict[str, Any], special: bool = False, to_chat: ToChat | None = None
    ) -> list[int] | None:
        """The token ids vLLM will see for a chat: its rendered prompt encoded whole (without
        special tokens unless `special`); None without a tokenizer."""
        ...

    async def prompt_ids(self, prompt: str | list[int], special: bool = True) -> list[int] | None:
        """The token ids vLLM will see for one text prompt (with special tokens unless told
        otherwise), or the prompt's own ids; None without a tokenizer."""
        ...


class CharCounter:
    """`tokenizer: estimate`: characters / `chars_per_token`, for models without a local tokenizer."""

    PER_MESSAGE = 4  # role markers and separators a chat template adds around each message
    exact = False
    specials = 0  # characters carry no special tokens

    def __init__(self, chars_per_token: float, image_tokens: int | None = None) -> None:
        self.chars_per_token = chars_per_token
        self.image_cost = image_tokens or 0  # the estimate writes no placeholder

    def _count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)

    async def count_chat(
        self, body: dict[str, Any], refuse_at: int | None = None, to_chat: ToChat | None = None
    ) -> int:
        """`refuse_at` is not needed: the estimate costs a length per message."""
        messages = (body if to_chat is None else to_chat(body))["messages"]
        return sum(self._count(message_text(m.get("content"))) for m in messages) + (
            self.PER_MESSAGE * len(messages)
        )

    async def count_prompts(
        self, prompt: Any, refuse_at: int | None = None, special: bool = True
    ) -> list[int]:
        if isinstance(prompt, str):
            return [self._count(prompt)]
        if isinstance(prompt[0], int):
            return [len(prompt)]
        return [len(p) if isinstance(p, list) else self._count(p) for p in prompt]

    async def chat_ids(
        self, body: dict[str, Any], special: bool = False, to_chat: ToChat | None = None
    ) -> list[int] | None:
        return None

    async def prompt_ids(self, prompt: str | list[int], special: bool = True) -> list[int] | None:
        return None


class HFCounter:
    """Counts one model's tokens with a shared `LoadedTokenizer` (its chat template and chosen
    `Encoder`), with this model's threads and image cost."""

    exact = True

    def __init__(
        self,
        loaded: LoadedTokenizer,
        *,
        threads: CountingThreads | None,
        inline_max_chars: int,
        large_threads: CountingThreads | None = None,
        large_min_chars: int = 0,
        image_tokens: int | None = None,
    ) -> None:
        self.loaded = loaded
        self.encoder = loaded.encoder
        self.template = loaded.template
        self.floor = loaded.floor
        self.specials = loaded.specials
        self.threads = threads
        # Counted on the calling thread up to this size once it is warm (`warm_inline`); until
        # then, with threads, every text goes to them.
        self.inline_limit = inline_max_chars // self.encoder.inline_share
        self.inline_max_chars = self.inline_limit if threads is None else -1
        self.large_threads = large_threads  # None: the large texts share `threads`
        self.large_min_chars = large_min_chars
        # The placeholder an "openai"-format template writes per image is already in the count;
        # a string-format template writes none (vLLM adds it, inside the image's cost).
        placeholder = self._image_placeholder()
        self.image_cost = max(0, (image_tokens or 0) - placeholder)

    @classmethod
    def load(
        cls,
        directory: str,
        *,
        backend: Backend = AUTO,
        model: str = "",
        threads: CountingThreads | None = None,
        inline_max_chars: int = ServerSpec.model_fields["inline_tokenize_max_chars"].default,
        large_threads: CountingThreads | None = None,
        large_min_chars: int = 0,
        image_tokens: int | None = None,
    ) -> HFCounter:
        """The counter of the tokenizer in `directory`, encoding with `backend`
        (gateway/tokenizer/backends.py; `BackendError` when a forced fastokens cannot count it
        exactly), loaded once for every model naming the same files (gateway/tokenizer/loaded.py)."""
        return cls(
            shared(directory, backend, model),
            threads=threads,
            inline_max_chars=inline_max_chars,
            large_threads=large_threads,
            large_min_chars=large_min_chars,
            image_tokens=image_tokens,
        )

    def warm(self) -> None:
        """Encode once on every tokenizer thread, waited for: a thread's first encode with a
        tokenizer is its dearest (fastokens builds its per-thread matching state then: ~120-140
        ms of CPU with Qwen 3 or Llama 3, against 0.1 ms after), and must not be a request's.
        Called as the policy is compiled: before the gateway reports ready, and before a
        reloaded policy with new counters takes traffic. The template's probes are answered
        then too, for the same reason."""
        self.template.probe()
        pools = {id(p): p for p in (self.threads, self.large_threads) if p is not None}
        for pool in pools.values():
            pool.each(self.encoder.counts, [WARM_TEXT], False)

    def warm_inline(self) -> None:
        """Encode once on the calling thread, the event loop's, and count short texts there from
        now on. Its first encode costs what a tokenizer thread's does (`warm`), tens of
        milliseconds that a request's inline count would otherwise hold the loop for. Called as
        the gateway is built, before it serves. A counter a reload loads is not warmed there,
        since that would hold a serving loop as long: all its texts go to the threads."""
        self.encoder.counts([WARM_TEXT], False)
        self.inline_max_chars = self.inline_limit

    @property
    def backend(self) -> str:
        """The library that encodes this model's texts: `fastokens` or `tokenizers`."""
        return self.encoder.name

    def _image_placeholder(self) -> int:
        """Tokens the template writes for one image (Gemma 3's `<start_of_image>`: 1)."""
        text = self.template.image_placeholder
        return self.encoder.counts([text], False)[0] if text else 0

    async def _count_texts(
        self, texts: list[str], special: bool, refuse_at: int | None = None, summed: bool = True
    ) -> list[int]:
        """Token counts of `texts`; with `refuse_at`, first refuse on the floor of their sum (a
        chat's parts) or of the longest (a completion's prompts)."""
        if refuse_at is not None and self.floor is not None:
            floors = map(self.floor.tokens, texts)
            floor = sum(floors) if summed else max(floors, default=0)
            if floor >= refuse_at:
                raise TooManyTokens(floor)
        return await self._run(sum(map(len, texts)), self.encoder.counts, texts, special)

    async def _run(self, size: int, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)`, on the tokenizer's threads when `size` (characters, or token ids) is
        long."""
        if self.threads is not None and size > self.inline_max_chars:
            threads = self.threads
            if self.large_min_chars and size >= self.large_min_chars:
                threads = self.large_threads or threads
            return await threads.run(work, *args)
        return work(*args)

    def _render(self, body: dict[str, Any], to_chat: ToChat | None) -> str:
        return self.template.render(body if to_chat is None else to_chat(body))

    async def _rendered(self, body: dict[str, Any], to_chat: ToChat | None) -> str:
        """The chat's prompt text; converted and rendered on the tokenizer threads when the
        request weighs more than `INLINE_RENDER_WEIGHT`."""
        if self.threads is not None and (
            render_weight(body, INLINE_RENDER_WEIGHT) > INLINE_RENDER_WEIGHT
        ):
            return await self.threads.run(self._render, body, to_chat)
        return self._render(body, to_chat)

    async def count_chat(
        self, body: dict[str, Any], refuse_at: int | None = None, to_chat: ToChat | None = None
    ) -> int:
        text = await self._rendered(body, to_chat)
        return (await self._count_texts([text], False, refuse_at))[0]

    async def count_prompts(
        self, prompt: Any, refuse_at: int | None = None, special: bool = True
    ) -> list[int]:
        if isinstance(prompt, str):
            return await self._count_texts([prompt], special, refuse_at)
        if isinstance(prompt[0], int):
            return [len(prompt)]
        if isinstance(prompt[0], list):
            return [len(p) for p in prompt]
        return await self._count_texts(list(prompt), special, refuse_at, summed=False)

    async def chat_ids(
        self, body: dict[str, Any], special: bool = False, to_chat: ToChat | None = None
    ) -> list[int] | None:
        """Rendered by the template and encoded whole, as vLLM encodes a chat (`special`, as
        `/tokenize`'s `add_special_tokens`, off by default). On the tokenizer's threads when
        long, as counting is."""
        text = await self._rendered(body, to_chat)
        return await self._run(len(text), ids, self.encoder, text, special)

    async def prompt_ids(self, prompt: str | list[int], special: bool = True) -> list[int] | None:
        """A text encoded as vLLM encodes a completion's prompt (with special tokens unless
        told otherwise), or the prompt's own ids when it is ids."""
        if isinstance(prompt, list):
            return prompt if all(type(t) is int for t in prompt) else None
        return await self._run(len(prompt), ids, self.encoder, prompt, special)

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows, added tokens included: 0 to `vocab_size - 1`."""
        return self.loaded.vocab_size

    async def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens kept, as vLLM's `/detokenize` decodes them."""
        return await self._run(len(ids), self.loaded.decoder.decode, ids)

    async def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token string (`convert_ids_to_tokens`), for `return_token_strs`."""
        return await self._run(len(ids), self.loaded.decoder.token_strs, ids)
