"""Stage 2, tokenize: count input tokens the way vLLM will.

Chat requests are rendered with the model's own chat template (`add_generation_prompt=True`) and
encoded without extra special tokens; completions encode the prompt with them, as vLLM does.
Tokenizers load from a local directory only: the hub is never contacted.

Counting is the gateway's dominant CPU cost (see docs/benchmarks.md), so two things keep it off the
hot path. `memoized` counting sums cached per-message counts with the template's overhead for that
sequence of roles: the 3,000-token rules block that repeats in every classification prompt costs a
dict lookup. And text longer than `inline_tokenize_max_chars` goes to a small thread pool through
the batch entry point, which releases the GIL (the single-text `encode` holds it). A long text
whose start was counted before (a rules block with a unique part after it, in one message or in
the rendered prompt) costs only its rest, exactly: gateway/prefixcount.py says when that holds.

Tokenizer time is shared, so two more rules keep one client's huge prompts from costing everyone
else's small ones. Before any encoding, a provable floor on the count (gateway/tokenfloor.py) refuses
what cannot fit in the context (`TooManyTokens`), so a 4 MB prompt costs no tokenizer time. And text
of `large_tokenize_chars` or more runs on threads of its own: small texts never queue behind it.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from gateway.errors import BadRequest
from gateway.prefixcount import OFF, PrefixCounts
from gateway.tokenfloor import TokenFloor
from gateway.tokenizer_threads import CountingThreads

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# The gateway spreads counting over its own threads (`server.tokenizer_threads`), one batch
# each; the tokenizers library's own pool splitting a batch of prefix pieces again adds its
# threads' wake-ups to every request's CPU (~18% more for a shared-prefix prompt, measured
# offline: docs/benchmarks.md). Set it to "true" to have one long prompt counted on several
# cores when the gateway is otherwise idle.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_EMPTY = ""
T = TypeVar("T")
# Role sequences whose template overhead is kept. Roles are client text (vLLM accepts custom ones),
# so only short sequences of the standard roles are cached: the cache stays small whatever is sent.
MAX_CACHED_SHAPES = 4096
MAX_CACHED_TURNS = 64
STANDARD_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


# vLLM's image parts (entrypoints/chat_utils.py `MM_PARSER_MAP`): by type, or untyped with the key.
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image_pil", "image_embeds"})
_UNTYPED_IMAGE_KEYS = ("image_url", "image_pil", "image_embeds")
_IMAGE = {"type": "image"}  # what vLLM hands an "openai"-format template for each image


def is_image(part: dict[str, Any]) -> bool:
    """Whether a content part is an image vLLM will expand into the prompt."""
    kind = part.get("type")
    if kind is None:
        return any(key in part for key in _UNTYPED_IMAGE_KEYS)
    return isinstance(kind, str) and kind in IMAGE_PART_TYPES  # a client's type may be any JSON


def message_text(content: Any) -> str:
    """The text of a message's content, joining text parts as vLLM does for string templates."""
    if content is None:
        return _EMPTY
    if isinstance(content, str):
        return content
    parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return "\n".join(str(p) for p in parts)


def template_parts(content: list[Any]) -> list[dict[str, Any]]:
    """A content array as vLLM hands it to an "openai"-format template: its text parts, and
    `{"type": "image"}` for each image part; other parts are dropped."""
    out: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "text":
            out.append({"type": "text", "text": str(part.get("text", ""))})
        elif is_image(part):
            out.append(_IMAGE)
    return out


def template_messages(
    messages: Sequence[dict[str, Any]], parts: bool = False
) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: content flattened to a string, or with `parts`
    (a template that loops over content parts) content arrays kept as `template_parts`."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            out.append(message)
        elif parts and isinstance(content, list):
            out.append({**message, "content": template_parts(content)})
        else:
            out.append({**message, "content": message_text(content)})
    return out


class TemplateError(ValueError):
    """Raised when the model's chat template refuses the messages (role order, missing fields)."""


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], body: dict[str, Any]) -> str:
    """The prompt text vLLM renders for a chat request: the template, with the request's own
    `tools`, `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`."""
    kwargs = body.get("chat_template_kwargs")
    try:
        rendered = tokenizer.apply_chat_template(
            messages,
            tools=body.get("tools"),
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            **(kwargs if isinstance(kwargs, dict) else {}),
        )
    except Exception as exc:  # templates raise whatever jinja or their own checks raise
        raise TemplateError(f"the model's chat template rejected the messages: {exc}") from None
    return str(rendered)


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
    images parse counted.
    """

    image_cost: int

    async def count_chat(self, body: dict[str, Any], refuse_at: int | None = None) -> int: ...

    async def count_prompts(self, prompt: Any, refuse_at: int | None = None) -> list[int]:
        """Tokens of each prompt of a completions request."""
        ...

    async def prompt_ids(
        self, body: dict[str, Any], endpoint: str, special: bool | None = None
    ) -> list[int] | None:
        """The token ids vLLM will see for the request's (first) prompt; None without a tokenizer.
        `special` (add special tokens) overrides the endpoint's default."""
        ...


class EstimateCounter:
    """`tokenizer: estimate`: characters / `chars_per_token`, for models without a local tokenizer."""

    PER_MESSAGE = 4  # role markers and separators a chat template adds around each message

    def __init__(self, chars_per_token: float, image_tokens: int | None = None) -> None:
        self.chars_per_token = chars_per_token
        self.image_cost = image_tokens or 0  # the estimate writes no placeholder

    def _count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)

    async def count_chat(self, body: dict[str, Any], refuse_at: int | None = None) -> int:
        """`refuse_at` is not needed: the estimate costs a length per message."""
        messages = body["messages"]
        return sum(self._count(message_text(m.get("content"))) for m in messages) + (
            self.PER_MESSAGE * len(messages)
        )

    async def count_prompts(self, prompt: Any, refuse_at: int | None = None) -> list[int]:
        if isinstance(prompt, str):
            return [self._count(prompt)]
        if isinstance(prompt[0], int):
            return [len(prompt)]
        return [len(p) if isinstance(p, list) else self._count(p) for p in prompt]

    async def prompt_ids(
        self, body: dict[str, Any], endpoint: str, special: bool | None = None
    ) -> list[int] | None:
        return None


def load_tokenizer(directory: str) -> Any:
    """Load a Hugging Face tokenizer from a local directory, never from the hub."""
    from transformers import AutoTokenizer

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"tokenizer directory {directory!r} does not exist")
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


class HFCounter:
    """Counts with a transformers tokenizer; see the module docstring for the two modes."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        memoized: bool,
        threads: CountingThreads | None,
        inline_max_chars: int,
        cache_entries: int,
        large_threads: CountingThreads | None = None,
        large_min_chars: int = 0,
        image_tokens: int | None = None,
        prefix_entries: int = 65536,
        prefix_block_chars: int = 1024,
    ) -> None:
        self.tokenizer = tokenizer
        self.memoized = memoized
        self.threads = threads
        self.inline_max_chars = inline_max_chars
        self.large_threads = large_threads  # None: the large texts share `threads`
        self.large_min_chars = large_min_chars
        self.cache_entries = cache_entries
        backend = tokenizer.backend_tokenizer
        # A tokenizer.json may keep truncation or padding from training. vLLM counts through
        # transformers, whose calls set both as they ask (off, unless a prompt is to be
        # truncated); the counts here call the backend directly, so both are turned off here.
        backend.no_truncation()
        backend.no_padding()
        self._encode_batch: Callable[..., Any] = getattr(
            backend, "encode_batch_fast", backend.encode_batch
        )
        config = json.loads(backend.to_str())  # parsed once for both of its readers
        self._prefixes = PrefixCounts(
            backend, entries=prefix_entries, block_chars=prefix_block_chars, config=config
        )
        # Off (not provable, or no entries): every text encoded whole, with no cutting or hashing.
        self._count: Callable[[list[str], bool], list[int]] = (
            self._prefixes.lengths if self.prefix_mode != OFF else self._lengths
        )
        self._content_counts: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._overheads: dict[tuple[Any, ...], int] = {}
        self._trims = self._template_trims()
        self.parts = self._template_takes_parts()
        # The placeholder an "openai"-format template writes per image is already in the count;
        # a string-format template writes none (vLLM adds it, inside the image's cost).
        placeholder = self._image_placeholder() if self.parts else 0
        self.image_cost = max(0, (image_tokens or 0) - placeholder)
        self.floor = TokenFloor.of(backend, config)

    def _template_trims(self) -> bool:
        """Whether the chat template trims message content (Gemma's does), probed once."""
        probe = "gateway-probe"
        try:
            rendered = self._render([{"role": "user", "content": f"  {probe}  "}], {})
        except BadRequest:
            return False
        return f"  {probe}" not in rendered and probe in rendered

    def _template_takes_parts(self) -> bool:
        """Whether the template loops over content parts (vLLM's "openai" content format, found
        by its jinja AST; here by a render): a string-format one prints the list whole, or fails."""
        probe = "gateway-probe"
        try:
            rendered = self._render(
                [{"role": "user", "content": [{"type": "text", "text": probe}]}], {}
            )
        except BadRequest:
            return False
        return probe in rendered and not any(q in rendered for q in ("'type'", '"type"'))

    def _image_placeholder(self) -> int:
        """Tokens the template writes for one image (Gemma 3's `<start_of_image>`: 1)."""
        try:
            rendered = [self._render([{"role": "user", "content": c}], {}) for c in ([_IMAGE], [])]
        except BadRequest:
            return 0
        with_image, without = self._lengths(rendered, False)
        return max(0, with_image - without)

    def _lengths(self, texts: list[str], special: bool) -> list[int]:
        # len(encoding) is its ids' count; `.ids` would build a list of them, holding the GIL
        return [len(e) for e in self._encode_batch(texts, add_special_tokens=special)]

    def _ids(self, text: str, special: bool) -> list[int]:
        return list(self._encode_batch([text], add_special_tokens=special)[0].ids)

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
        return await self._run(sum(map(len, texts)), self._count, texts, special)

    async def _run(self, size: int, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)`, on the tokenizer's threads when `size` (characters, or token ids) is
        long."""
        if self.threads is not None and size > self.inline_max_chars:
            threads = self.threads
            if self.large_min_chars and size >= self.large_min_chars:
                threads = self.large_threads or threads
            return await threads.run(work, *args)
        return work(*args)

    def _render(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> str:
        try:
            return render_chat(self.tokenizer, messages, body)
        except TemplateError as exc:
            raise BadRequest(str(exc), param="messages") from None

    async def count_chat(self, body: dict[str, Any], refuse_at: int | None = None) -> int:
        """Content arrays for a parts template are rendered whole: `memoized` keys its cache on
        string contents, so such a request is counted exactly."""
        parts = self.parts and any(isinstance(m.get("content"), list) for m in body["messages"])
        messages = template_messages(body["messages"], parts)
        plain = not body.get("tools") and not body.get("chat_template_kwargs") and not parts
        overhead = self._template_overhead(messages, body) if self.memoized and plain else None
        if overhead is None:
            rendered = self._render(messages, body)
            return (await self._count_texts([rendered], False, refuse_at))[0]
        room = None if refuse_at is None else refuse_at - overhead
        try:
            return overhead + await self._content_total(messages, room)
        except TooManyTokens as exc:
            raise TooManyTokens(overhead + exc.tokens) from None

    def _template_overhead(
        self, messages: list[dict[str, Any]], body: dict[str, Any]
    ) -> int | None:
        """Tokens the template adds around contents, cached per sequence of roles.

        None when the template refuses empty contents: such a request is counted exactly.
        """
        generation = body.get("add_generation_prompt", True)
        cont = body.get("continue_final_message", False)
        key = (generation, cont, *(m["role"] for m in messages))
        overhead = self._overheads.get(key)
        if overhead is None:
            skeleton = [{**m, "content": _EMPTY} for m in messages]
            try:
                overhead = self._lengths([self._render(skeleton, body)], False)[0]
            except BadRequest:
                return None
            if (
                len(self._overheads) < MAX_CACHED_SHAPES
                and len(messages) <= MAX_CACHED_TURNS
                and STANDARD_ROLES.issuperset(key[2:])
            ):
                self._overheads[key] = overhead
        return overhead

    async def _content_total(self, messages: list[dict[str, Any]], refuse_at: int | None) -> int:
        cache = self._content_counts
        total = 0
        misses: list[tuple[tuple[int, int], str]] = []
        for message in messages:
            text: str = message["content"]
            if self._trims:
                text = text.strip()
            if not text:
                continue
            key = (hash(text), len(text))
            count = cache.get(key)
            if count is None:
                misses.append((key, text))
            else:
                cache.move_to_end(key)
                total += count
        if misses:
            room = None if refuse_at is None else refuse_at - total
            try:
                counts = await self._count_texts([text for _, text in misses], False, room)
            except TooManyTokens as exc:
                raise TooManyTokens(total + exc.tokens) from None
            for (key, _), count in zip(misses, counts, strict=True):
                total += count
                if self.cache_entries:
                    cache[key] = count
            while len(cache) > self.cache_entries:
                cache.popitem(last=False)
        return total

    async def count_prompts(self, prompt: Any, refuse_at: int | None = None) -> list[int]:
        if isinstance(prompt, str):
            return await self._count_texts([prompt], True, refuse_at)
        if isinstance(prompt[0], int):
            return [len(prompt)]
        if isinstance(prompt[0], list):
            return [len(p) for p in prompt]
        return await self._count_texts(list(prompt), True, refuse_at, summed=False)

    async def prompt_ids(
        self, body: dict[str, Any], endpoint: str, special: bool | None = None
    ) -> list[int] | None:
        """Encoded whole, as vLLM encodes it: a chat rendered by the template, without special
        tokens; a completion's first prompt with them (or its own ids). `special` overrides
        that, as `/tokenize`'s `add_special_tokens` does. On the tokenizer's threads when long,
        as counting is."""
        if endpoint == "chat":
            parts = self.parts and any(isinstance(m.get("content"), list) for m in body["messages"])
            text = self._render(template_messages(body["messages"], parts), body)
            special = bool(special)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]
            if isinstance(prompt, list):
                return prompt if all(type(t) is int for t in prompt) else None
            if not isinstance(prompt, str):
                return None
            text, special = prompt, special is not False
        return await self._run(len(text), self._ids, text, special)

    @property
    def prefix_mode(self) -> str:
        """Which argument makes counting from cached prefixes exact (gateway/prefixcount.py), or
        "off" (not provable for this tokenizer, or no entries): every text encoded whole."""
        return self._prefixes.mode if self._prefixes.entries else OFF

    @property
    def prefixes(self) -> PrefixCounts | None:
        """The prefix cache while it is on, for its counters (`/metrics`); else None."""
        return self._prefixes if self.prefix_mode != OFF else None

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows, added tokens included: 0 to `vocab_size - 1`."""
        return len(self.tokenizer)

    async def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens kept, as vLLM's `/detokenize` decodes them."""
        return str(await self._run(len(ids), self.tokenizer.decode, ids))

    async def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token string (`convert_ids_to_tokens`), for `return_token_strs`."""
        return list(await self._run(len(ids), self.tokenizer.convert_ids_to_tokens, ids))
