"""`POST /v1/embeddings`: pooling work, counted as vLLM 0.32 tokenizes it, with no output.

vLLM takes five shapes (entrypoints/pooling/embed/protocol.py `EmbeddingRequest`):

- `input` as a string, an array of strings, token ids or an array of id arrays (OpenAI's): each
  text is encoded on its own, with the tokenizer's special tokens unless `add_special_tokens`
  is false; ids count themselves. One prompt per element.
- `messages`, one conversation or an array of them, or `input` holding either (vLLM moves it to
  `messages`): each conversation is rendered by the model's chat template, as a chat is, but
  with vLLM's embedding defaults, `add_generation_prompt` false and `add_special_tokens` false
  (true adds the tokenizer's special tokens of an empty text to each), and without the chat
  fields an embedding request does not have (`tools`, `documents`, `reasoning_effort`).

`truncate_prompt_tokens` (k >= 1) cuts each prompt to k tokens, so each count is capped there;
-1 cuts to the model's context, approximated by the largest candidate's (what `refuse_at` is for
a request without output). A pooling request produces no output tokens: the output bound is 0,
so it is expected at 0 and classifies as prefill-heavy; the answer's `usage` has
`prompt_tokens` (the sum over the prompts) and `total_tokens`, and no meaningful
`completion_tokens`. Embeddings do not stream: `stream` true is refused. A replica serving
long texts in chunks (`--pooler-config` `enable_chunked_processing`, `max_embed_len` over
`max_model_len`) is not modelled: the policy's `max_model_len` is what a prompt must fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.api.chat import check_chat
from gateway.api.completions import _prompt_floor, _prompt_shape
from gateway.api.fields import check_prompt_chars
from gateway.api.openai import OpenAIApi, is_tokens
from gateway.context.endpoint import FINGERPRINT_CHARS, FINGERPRINT_IDS, SAMPLE_TEXT
from gateway.errors import BadRequest
from gateway.tokenizer.chat_template import lax_bool, message_text
from gateway.tokenizer.counters import HFCounter

if TYPE_CHECKING:
    from gateway.config.schema import ServerSpec
    from gateway.context.ctx import Ctx
    from gateway.tokenizer.counters import TokenCounter

# The fields of vLLM's embedding chat request a template reads (ChatRequestOptionsMixin).
_CHAT_FIELDS = ("chat_template", "chat_template_kwargs", "continue_final_message")


def _is_conversation(value: Any) -> bool:
    """vLLM's `_is_chat_messages`: a non-empty array of objects with a string role."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )


def conversations(body: dict[str, Any]) -> list[list[Any]] | None:
    """The request's conversations when it is a chat-style embedding request, else None."""
    messages: Any = body["messages"] if "messages" in body else body.get("input")
    if _is_conversation(messages):
        return [messages]
    if isinstance(messages, list) and messages and all(map(_is_conversation, messages)):
        return messages
    if "messages" in body:
        raise BadRequest(
            "'messages' must be a non-empty array of messages, or of such arrays",
            param="messages",
        )
    return None


def chat_view(body: dict[str, Any], messages: list[Any]) -> dict[str, Any]:
    """What the chat template renders for one conversation of an embedding request."""
    view = {key: body[key] for key in _CHAT_FIELDS if key in body}
    view["messages"] = messages
    view["add_generation_prompt"] = body.get("add_generation_prompt", False)
    return view


def _truncation(body: dict[str, Any]) -> int | None:
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    if type(value) is not int or value < -1:
        raise BadRequest(
            "'truncate_prompt_tokens' must be an integer >= -1",
            param="truncate_prompt_tokens",
            code="invalid_value",
        )
    return value or None  # 0: vLLM's params treat it as no truncation


class PoolingApi(OpenAIApi):
    """What vLLM's pooling endpoints share: no output, no stream, usage always in the answer."""

    __slots__ = ()

    @staticmethod
    def check_no_stream(body: dict[str, Any]) -> None:
        if lax_bool(body.get("stream"), "stream", False, nullable=True):
            raise BadRequest("pooling requests do not stream", param="stream", code="invalid_value")

    def upstream_fields(self, ctx: Ctx, changes: dict[str, Any]) -> None:
        """Nothing: the answer always carries its usage."""

    def read_usage(self, ctx: Ctx, usage: Any) -> None:
        """`prompt_tokens`, the prompts' sum; the output is 0 whatever the answer says (vLLM's
        `UsageInfo` writes `completion_tokens: 0`, OpenAI's none)."""
        if not isinstance(usage, dict):
            return
        ctx.output_tokens = 0
        prompt = usage.get("prompt_tokens")
        if is_tokens(prompt):
            ctx.prompt_tokens = prompt
        elif prompt is not None:
            ctx.untrusted_usage = "prompt_tokens"


class EmbeddingsApi(PoolingApi):
    """OpenAI's embeddings, as vLLM serves them (with its chat-style extension)."""

    __slots__ = ()
    name = "embeddings"
    path = "/v1/embeddings"
    sample = {"input": SAMPLE_TEXT}
    prompt_param = "input"

    def parse(self, ctx: Ctx, body: dict[str, Any], limits: ServerSpec) -> tuple[int, int | None]:
        """Prompts: one per text, id array or conversation; the output bound is 0."""
        self.check_no_stream(body)
        _truncation(body)
        convs = conversations(body)
        if convs is not None:
            # Checked as one chat: every message of every conversation, within the limits
            # (`max_messages` bounds the conversations too).
            flat = [message for conv in convs for message in conv]
            ctx.images = check_chat(chat_view(body, flat), limits)
            lax_bool(body.get("add_special_tokens", False), "add_special_tokens", False)
            return len(convs), 0
        if "input" not in body:
            raise BadRequest("'input' is required", param="input")
        try:
            prompts, chars = _prompt_shape(body["input"])
        except BadRequest:
            raise BadRequest(
                "'input' must be a string, an array of strings, token ids, an array of token id"
                " arrays, or chat messages",
                param="input",
            ) from None
        check_prompt_chars(chars, limits, "input")
        lax_bool(body.get("add_special_tokens", True), "add_special_tokens", True)
        return prompts, 0

    async def count(
        self, body: dict[str, Any], counter: TokenCounter, refuse_at: int, images: int
    ) -> tuple[int, int]:
        """Each prompt on its own, capped at `truncate_prompt_tokens`; `refuse_at` checks the
        longest (and is not asked of a request vLLM truncates)."""
        truncate = _truncation(body)
        cap = refuse_at if truncate == -1 else truncate
        refuse = None if cap is not None else refuse_at
        convs = conversations(body)
        if convs is None:
            special = body.get("add_special_tokens", True) is not False
            counts = await counter.count_prompts(body["input"], refuse, special)
        else:
            extra = counter.specials if body.get("add_special_tokens") else 0
            counts = [
                extra + await counter.count_chat(chat_view(body, conv), refuse) for conv in convs
            ]
            counts[0] += images  # the images' cost, on the request as a whole
        if cap is not None:
            counts = [min(count, cap) for count in counts]
        return sum(counts), max(counts)

    async def prompt_ids(
        self, body: dict[str, Any], counter: TokenCounter, special: bool | None = None
    ) -> list[int] | None:
        """The first input's ids, as `count` encodes it: a text, its own ids, or the first
        conversation rendered."""
        if special is None:
            special = body.get("add_special_tokens", conversations(body) is None) is not False
        convs = conversations(body)
        if convs is not None:
            return await counter.chat_ids(chat_view(body, convs[0]), special)
        prompt = body.get("input")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if not isinstance(prompt, str | list):
            return None
        return await counter.prompt_ids(prompt, special)

    def fingerprint(self, body: dict[str, Any]) -> int:
        """The start of the first input, or of the first conversation's first message."""
        convs = conversations(body)
        if convs is not None:
            return hash(message_text(convs[0][0].get("content"))[:FINGERPRINT_CHARS])
        prompt = body["input"]
        if isinstance(prompt, str):
            return hash(prompt[:FINGERPRINT_CHARS])
        if isinstance(prompt[0], int):
            return hash(tuple(prompt[:FINGERPRINT_IDS]))
        if isinstance(prompt[0], str):
            return hash(prompt[0][:FINGERPRINT_CHARS])
        return hash(tuple(prompt[0][:FINGERPRINT_IDS]))

    def input_floor(self, ctx: Ctx, counter: TokenCounter) -> int:
        """Token ids and the texts' floors, as completions'; a chat's images only. 0 when vLLM
        truncates (its counts may fall below any floor)."""
        if ctx.body.get("truncate_prompt_tokens") not in (None, 0):
            return 0
        if conversations(ctx.body) is not None:
            return ctx.images * counter.image_cost
        floor = counter.floor if isinstance(counter, HFCounter) else None
        return _prompt_floor(ctx.body.get("input"), floor)


EMBEDDINGS = EmbeddingsApi()
