"""The rules a pool applies to every request it may serve, each written once.

A request meets them wherever placement (gateway/request/place.py) considers a pool for it: its
route's pool, where a refusal is the client's; a fallback, which a refusal passes over; the pool
holding the stored response it continues. Each rule is one `PoolCheck`, listed in `pool_checks`
in the order a request meets them: a new per-pool rule is a class here and its line there, the
pool or model field it reads (gateway/config/schema.py) and its refusal (gateway/errors.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from gateway.errors import BadRequest, ContextLengthExceeded, MaxOutputTokensExceeded, ModelNotFound

if TYPE_CHECKING:
    from gateway.context.compiled import Model, Pool
    from gateway.context.ctx import Ctx
    from gateway.errors import GatewayError
    from gateway.fleet.adapters import Adapters


class PoolCheck(ABC):
    """One rule of a pool's: the refusal of `ctx` by `pool`, or None when the pool may serve it.
    Called once per pool considered, on the event loop: it reads the `Ctx` and the compiled
    pool, nothing that waits."""

    __slots__ = ()
    # What the pool lacks, as `llm-gateway explain` says of a fallback the rule passes over.
    label: ClassVar[str]

    @abstractmethod
    def check(self, ctx: Ctx, pool: Pool) -> GatewayError | None: ...

    def applies(self, pool: Pool) -> bool:
        """Whether the rule can refuse anything on `pool`: one its configuration leaves unset
        is not run there (placement asks once per policy)."""
        return True


class ServesAdapter(PoolCheck):
    """A request for a LoRA adapter goes only to a pool whose replicas serve it."""

    __slots__ = ("adapters",)
    label = "LoRA adapter"

    def __init__(self, adapters: Adapters) -> None:
        self.adapters = adapters

    def check(self, ctx: Ctx, pool: Pool) -> GatewayError | None:
        if not ctx.adapter or pool.name in self.adapters.pools(ctx.adapter):
            return None
        return ModelNotFound(f"The model `{ctx.requested_model}` does not exist.", param="model")


class Images(PoolCheck):
    """The pool's model takes the request's images, as many as it has."""

    __slots__ = ()
    label = "images"

    def check(self, ctx: Ctx, pool: Pool) -> GatewayError | None:
        return image_refusal(ctx, pool.model) if ctx.images else None


class ContextLength(PoolCheck):
    """The prompt and the output asked for fit the pool's model (vLLM would refuse them)."""

    __slots__ = ()
    label = "context length"

    def check(self, ctx: Ctx, pool: Pool) -> GatewayError | None:
        limit = pool.model.spec.max_model_len
        return None if ctx.fits_context(limit) else too_long(ctx, limit, ctx.longest_prompt)


class OutputBound(PoolCheck):
    """The output the client asks for, over all its completions, is within the pool's
    `max_output_tokens`. A bound the gateway wrote itself (`quota.bound_output`) is not the
    client's, and a request that states none is bounded by the context alone."""

    __slots__ = ()
    label = "max_output_tokens"

    def applies(self, pool: Pool) -> bool:
        return pool.spec.max_output_tokens is not None

    def check(self, ctx: Ctx, pool: Pool) -> GatewayError | None:
        limit = pool.spec.max_output_tokens
        if limit is None or ctx.max_output is None or ctx.bounded_by_gateway:
            return None
        asked = ctx.max_output * ctx.sequences
        if asked <= limit:
            return None
        each = f" ({ctx.max_output} for each of {ctx.sequences})" if ctx.sequences > 1 else ""
        return MaxOutputTokensExceeded(
            f"This request asks for up to {asked} output tokens{each}; pool `{pool.name}`"
            f" serves at most {limit} a request.",
            param=ctx.api.bound_field,
        )


def pool_checks(adapters: Adapters) -> tuple[PoolCheck, ...]:
    """Every pool's rules, in the order a request meets them."""
    return (ServesAdapter(adapters), Images(), ContextLength(), OutputBound())


def image_refusal(ctx: Ctx, model: Model) -> BadRequest | None:
    """Why `model` cannot take `ctx`'s images, or None."""
    spec = model.spec
    if spec.image_tokens is None:
        return BadRequest(
            f"model {model.name!r} does not take images",
            param=ctx.api.prompt_param,
            code="images_not_supported",
        )
    if ctx.images > spec.max_images:
        return BadRequest(
            f"{ctx.images} images, over the {spec.max_images} limit of model {model.name!r}",
            param=ctx.api.prompt_param,
            code="too_many_images",
        )
    return None


def too_long(ctx: Ctx, limit: int, prompt: int, qualifier: str = "") -> ContextLengthExceeded:
    """vLLM's own words for a request over a context of `limit` tokens."""
    output = ctx.max_output or 0
    return ContextLengthExceeded(
        f"This model's maximum context length is {limit} tokens. However, you requested"
        f" {qualifier}{prompt + output} tokens ({qualifier}{prompt} in the messages,"
        f" {output} in the completion).",
        param=ctx.api.prompt_param,
    )
