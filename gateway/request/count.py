"""The tokenize stage: count the prompt as vLLM will, and refuse what cannot fit the context.

Counting itself (templates, backends, threads, the floor) is gateway/tokenizer/; this stage asks
the request's model's counter for the number (how, is the endpoint's: `ctx.api.count`) and turns
"too long" into the client's refusal, before the tokenizer spends time on a prompt that provably
cannot fit.
"""

from __future__ import annotations

from gateway.context.ctx import Ctx
from gateway.errors import BadRequest, ContextLengthExceeded
from gateway.tokenizer.counters import TooManyTokens


def check_images(ctx: Ctx) -> None:
    assert ctx.model is not None
    spec = ctx.model.spec
    if spec.image_tokens is None:
        raise BadRequest(
            f"model {ctx.model.name!r} does not take images",
            param=ctx.api.prompt_param,
            code="images_not_supported",
        )
    if ctx.images > spec.max_images:
        raise BadRequest(
            f"{ctx.images} images, over the {spec.max_images} limit of model {ctx.model.name!r}",
            param=ctx.api.prompt_param,
            code="too_many_images",
        )


async def count_input(ctx: Ctx) -> None:
    """Count the prompt, each image at the model's `image_tokens`; one that provably cannot fit
    any candidate pool's context is refused before the tokenizer spends time on it."""
    assert ctx.model is not None
    counter = ctx.model.counter
    limit = max(c.pool.model.spec.max_model_len for c in ctx.candidates)
    refuse_at = limit - max(
        (ctx.max_output or 0) - 1, 0
    )  # the first count check_context_length refuses
    # A continued conversation's body carries its stored turns, which the count renders; what
    # of them the gateway kept as a token count alone is added as it is (`kept_conversation`).
    history = ctx.holder.unheard if ctx.holder is not None else 0
    refuse_at -= history
    images = 0
    if ctx.images:
        check_images(ctx)  # as `before_count` does: a caller may count without it
        images = ctx.images * counter.image_cost
        if images >= refuse_at:
            raise _too_long(ctx, limit, images, "at least ")
    try:
        tokens, longest = await ctx.api.count(ctx.body, counter, refuse_at, images)
    except TooManyTokens as exc:
        raise _too_long(ctx, limit, history + images + exc.tokens, "at least ") from None
    ctx.input_tokens, ctx.longest_prompt = history + tokens, history + longest


def _too_long(ctx: Ctx, limit: int, prompt: int, qualifier: str = "") -> ContextLengthExceeded:
    output = ctx.max_output or 0
    return ContextLengthExceeded(
        f"This model's maximum context length is {limit} tokens. However, you requested"
        f" {qualifier}{prompt + output} tokens ({qualifier}{prompt} in the messages,"
        f" {output} in the completion).",
        param=ctx.api.prompt_param,
    )


def check_context_length(ctx: Ctx) -> None:
    """Refuse early what vLLM would refuse anyway, before it takes a slot."""
    assert ctx.pool is not None
    limit = ctx.pool.model.spec.max_model_len
    if not ctx.fits_context(limit):
        raise _too_long(ctx, limit, ctx.longest_prompt)
