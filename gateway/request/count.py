"""The tokenize stage: count the prompt as vLLM will, and refuse what provably cannot fit.

Counting itself (templates, backends, threads, the floor) is gateway/tokenizer/; this stage asks
the request's model's counter for the number (how, is the endpoint's: `ctx.api.count`) and turns
"too long" into the client's refusal, before the tokenizer spends time on a prompt that provably
cannot fit any candidate pool. Whether it fits the pool that serves it is that pool's rule
(gateway/request/checks.py `ContextLength`), which placement applies.
"""

from __future__ import annotations

from gateway.context.ctx import Ctx
from gateway.request.checks import image_refusal, too_long
from gateway.tokenizer.counters import TooManyTokens


def check_images(ctx: Ctx) -> None:
    """Refuse images the counting model cannot take: before counting, since it costs them."""
    assert ctx.model is not None
    refused = image_refusal(ctx, ctx.model)
    if refused is not None:
        raise refused


async def count_input(ctx: Ctx) -> None:
    """Count the prompt, each image at the model's `image_tokens`; one that provably cannot fit
    any candidate pool's context is refused before the tokenizer spends time on it."""
    assert ctx.model is not None
    counter = ctx.model.counter
    limit = max(c.pool.model.spec.max_model_len for c in ctx.candidates)
    # The first count `ContextLength` would refuse on the candidate with the longest context.
    refuse_at = limit - max((ctx.max_output or 0) - 1, 0)
    # A continued conversation's body carries its stored turns, which the count renders; what
    # of them the gateway kept as a token count alone is added as it is (`kept_conversation`).
    history = ctx.holder.unheard if ctx.holder is not None else 0
    refuse_at -= history
    images = 0
    if ctx.images:
        check_images(ctx)  # as `before_count` does: a caller may count without it
        images = ctx.images * counter.image_cost
        if images >= refuse_at:
            raise too_long(ctx, limit, images, "at least ")
    try:
        tokens, longest = await ctx.api.count(ctx.body, counter, refuse_at, images)
    except TooManyTokens as exc:
        raise too_long(ctx, limit, history + images + exc.tokens, "at least ") from None
    ctx.input_tokens, ctx.longest_prompt = history + tokens, history + longest
