"""`POST /v1/completions`: one prompt or several, as text or token ids.

A completions request generates `n` choices for each of its prompts, so its sequences are
`n x prompts`; each prompt is checked against the context on its own (`longest_prompt`). Text is
counted with the tokenizer's special tokens, as vLLM encodes it; token ids count themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.api.fields import check_prompt_chars, positive_int
from gateway.api.openai import OpenAIApi
from gateway.context.endpoint import FINGERPRINT_CHARS, FINGERPRINT_IDS, SAMPLE_TEXT
from gateway.errors import BadRequest
from gateway.tokenizer.counters import HFCounter

if TYPE_CHECKING:
    from gateway.config.schema import ServerSpec
    from gateway.context.ctx import Ctx
    from gateway.tokenizer.counters import TokenCounter
    from gateway.tokenizer.floor import TokenFloor


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_shape(prompt: Any) -> tuple[int, int]:
    """Number of prompts in a completions request and their characters (0 for token ids).

    Raise if `prompt` has no valid shape.
    """
    if isinstance(prompt, str):
        return 1, len(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return len(prompt), sum(map(len, prompt))
        if all(map(_is_token, prompt)):
            return 1, 0
        if all(isinstance(p, list) and p and all(map(_is_token, p)) for p in prompt):
            return len(prompt), 0
    raise BadRequest("'prompt' must be a string, an array of strings, or token ids", param="prompt")


def _prompt_floor(prompt: Any, floor: TokenFloor | None) -> int:
    """Tokens a completions `prompt` has at least, summed as `count_prompts`' counts are: token
    ids by their number, a text by its floor (0 without one)."""
    if isinstance(prompt, str):
        return floor.tokens(prompt) if floor is not None else 0
    if not isinstance(prompt, list):
        return 0
    if prompt and isinstance(prompt[0], int):
        return len(prompt)
    return sum(_prompt_floor(p, floor) if isinstance(p, str) else len(p) for p in prompt)


class CompletionsApi(OpenAIApi):
    """OpenAI's (legacy) completions, as vLLM serves them."""

    __slots__ = ()
    name = "completions"
    path = "/v1/completions"
    sample = {"prompt": SAMPLE_TEXT, "max_tokens": 16}
    prompt_param = "prompt"
    bound_field = "max_tokens"
    continuous_usage = True

    def parse(self, ctx: Ctx, body: dict[str, Any], limits: ServerSpec) -> tuple[int, int | None]:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        prompts, chars = _prompt_shape(body["prompt"])
        check_prompt_chars(chars, limits, "prompt")
        return prompts, positive_int(body, "max_tokens")

    async def count(
        self, body: dict[str, Any], counter: TokenCounter, refuse_at: int, images: int
    ) -> tuple[int, int]:
        """Each prompt on its own; `refuse_at` is checked against the longest."""
        counts = await counter.count_prompts(body["prompt"], refuse_at)
        return sum(counts), max(counts)

    async def prompt_ids(
        self, body: dict[str, Any], counter: TokenCounter, special: bool | None = None
    ) -> list[int] | None:
        """The first prompt's: a text's encoding, or its own token ids."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if not isinstance(prompt, str | list):
            return None
        return await counter.prompt_ids(prompt, special is not False)

    def fingerprint(self, body: dict[str, Any]) -> int:
        """The start of the (first) prompt, as text or token ids."""
        prompt = body["prompt"]
        if isinstance(prompt, str):
            head = prompt[:FINGERPRINT_CHARS]
        elif isinstance(prompt[0], int):  # token ids
            return hash(tuple(prompt[:FINGERPRINT_IDS]))
        elif isinstance(prompt[0], str):
            head = prompt[0][:FINGERPRINT_CHARS]
        else:
            return hash(tuple(prompt[0][:FINGERPRINT_IDS]))
        return hash(head)

    def input_floor(self, ctx: Ctx, counter: TokenCounter) -> int:
        """See `_prompt_floor`."""
        floor = counter.floor if isinstance(counter, HFCounter) else None
        return _prompt_floor(ctx.body.get("prompt"), floor)


COMPLETIONS = CompletionsApi()
