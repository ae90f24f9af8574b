"""Stage 5b, quota: reserve the tenant's TPM and RPM before admission, correct the charge after.

At this point the input tokens are counted and the output estimated, so the request's
`reserved_tokens` (input + expected output) is charged to the tenant's TPM window and 1 to its
RPM window, all or nothing; a request that does not fit is refused with the `Retry-After` its
window computes, before it takes a place in any queue. A request larger than a whole window is
refused for good (`request_over_limit`) only on its own numbers; see `_charged`. When the response
ends, however it ended, the token charge is corrected to what was really used: input + output
tokens if a replica served it (both from the usage chunk, or the chunks counted when the stream
broke or the client left), 0 if it never reached one. The request itself stays counted against RPM.

Every response for a limited tenant carries OpenAI's `x-ratelimit-{limit,remaining,reset}-
{tokens,requests}` headers, as the window stood after the reservation (or the refusal).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from gateway.context import Ctx
from gateway.errors import OverQuota, QuotaExceeded
from gateway.metrics import Metrics
from gateway.state.base import Limit, Refusal, State, Window
from gateway.tenants import Tenant

log = logging.getLogger("gateway.quota")


@dataclass(frozen=True, slots=True)
class Charge:
    """A reservation to correct when the request ends."""

    id: str
    tokens: tuple[
        tuple[str, int], ...
    ]  # each TPM window charged (overall, model, pool), and how much


@dataclass(frozen=True, slots=True)
class _Scoped:
    """One window of a tenant: `kind` is `tokens` or `requests`; `scope` says where it applies."""

    kind: str
    scope: str
    limit: Limit

    @property
    def where(self) -> str:
        """` on model M` or ` on pool P`; "" for the tenant's overall window."""
        return f" on {self.scope.rstrip(':').replace(':', ' ', 1)}" if self.scope else ""


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `6s`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"


def _headers(scoped: list[_Scoped], windows: tuple[Window, ...]) -> dict[str, str]:
    """Per kind, the window with the least room left: the one that binds the next request."""
    binding: dict[str, Window] = {}
    for item, window in zip(scoped, windows, strict=True):
        held = binding.get(item.kind)
        if held is None or window.remaining < held.remaining:
            binding[item.kind] = window
    out = {}
    for kind, window in binding.items():
        out[f"x-ratelimit-limit-{kind}"] = str(window.limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(window.remaining)
        out[f"x-ratelimit-reset-{kind}"] = duration(window.reset_s)
    return out


def _stated(ctx: Ctx) -> int:
    """The tokens the request itself says it may use: its input, and its output when the client's
    own bound is what was reserved (a learned or default output is the gateway's guess)."""
    if ctx.estimate_source == "max_tokens":
        return ctx.reserved_tokens
    return ctx.input_tokens


def _charged(reserved: int, stated: int, tpm: int) -> int:
    """What to charge a window of `tpm` for a request of `reserved` tokens (`stated` certain).

    A refusal that no wait can lift must rest on the client's own numbers: a reservation larger
    than the whole window only because its output was estimated is cut to the window, so the
    request runs once the window is empty, and its charge is settled to real use afterwards.
    """
    if reserved <= tpm:
        return reserved
    return max(stated, tpm)


def tenant_windows(tenant: Tenant, ctx: Ctx, tokens: int) -> list[_Scoped]:
    """The tenant's overall windows, then those of the model and the pool this request uses.

    One hash tag per tenant: all its windows share a Redis Cluster slot, so one script can
    charge them together.
    """
    stated = _stated(ctx) if tokens else 0
    prefix = f"quota:{{{tenant.name}}}:"
    scopes = [("", tenant.spec.tpm, tenant.spec.rpm)]
    if ctx.pool is not None:
        model, pool = tenant.spec.models.get(ctx.served_model), tenant.spec.pools.get(ctx.pool.name)
        if model is not None:
            scopes.append((f"model:{ctx.served_model}:", model.tpm, model.rpm))
        if pool is not None:
            scopes.append((f"pool:{ctx.pool.name}:", pool.tpm, pool.rpm))
    out = []
    for scope, tpm, rpm in scopes:
        if tpm is not None:
            amount = _charged(tokens, stated, tpm)
            out.append(_Scoped("tokens", scope, Limit(prefix + scope + "tokens", amount, tpm)))
        if rpm is not None:
            out.append(_Scoped("requests", scope, Limit(prefix + scope + "requests", 1, rpm)))
    return out


class Quotas:
    """Tenants' windows in a `State`. Corrections run as tasks kept here and awaited at close,
    so the pipeline's `finally` never awaits (a cancelled handler still corrects its charge)."""

    def __init__(self, state: State, metrics: Metrics) -> None:
        self.state = state
        self.metrics = metrics
        self._pending: set[asyncio.Task[None]] = set()

    async def reserve(self, ctx: Ctx) -> Charge | None:
        """Charge the tenant's windows or raise 429; None when there is nothing to correct."""
        if ctx.tenant is None:
            return None
        tenant = ctx.tenant
        scoped = tenant_windows(tenant, ctx, ctx.reserved_tokens)
        if not scoped:
            return None
        result = await self.state.reserve([item.limit for item in scoped])
        ctx.ratelimit_headers = _headers(scoped, result.windows)
        if isinstance(result, Refusal):
            item = scoped[result.index]
            self.metrics.quota_rejections.labels(tenant.name, item.kind).inc()
            per_minute = f"{item.limit.limit} {item.kind} per minute{item.where}"
            if result.retry_after_s is None:
                raise OverQuota(
                    f"this request needs {item.limit.amount} {item.kind}, more than tenant"
                    f" {tenant.name!r}'s whole limit of {per_minute}"
                )
            raise QuotaExceeded(
                f"tenant {tenant.name!r} is at its limit of {per_minute}; this request needs"
                f" {item.limit.amount}; try again in {result.retry_after_s:.1f}s",
                retry_after_s=result.retry_after_s,
            )
        tokens = tuple(
            (item.limit.key, item.limit.amount) for item in scoped if item.kind == "tokens"
        )
        return Charge(result.id, tokens)

    async def describe(self, ctx: Ctx) -> None:
        """Give a response refused before the quota stage (a 400 of a known tenant) the headers
        too, so every answer to a limited tenant says where its windows stand; never raises:
        the headers inform, they must not turn a refusal into a failure."""
        if ctx.tenant is None or ctx.ratelimit_headers:
            return
        scoped = tenant_windows(ctx.tenant, ctx, 0)
        if not scoped:
            return
        try:
            windows = await self.state.peek([item.limit for item in scoped])
        except Exception:
            log.exception("reading tenant %s's windows failed", ctx.tenant.name)
            return
        ctx.ratelimit_headers = _headers(scoped, windows)

    def settle(self, ctx: Ctx, charge: Charge) -> None:
        """Correct the token charges to real usage. Call after `account`, which fills in output
        tokens from the chunks counted when a stream broke; never raises, never awaits.

        The replica's `prompt_tokens` wins over the gateway's count when it reports one: what
        it really prefilled (images expanded by its processor, say) is what the tenant used."""
        prompt = ctx.input_tokens if ctx.prompt_tokens is None else ctx.prompt_tokens
        actual = prompt + (ctx.output_tokens or 0) if ctx.replica else 0
        for key, reserved in charge.tokens:
            task = asyncio.create_task(self.state.adjust(key, charge.id, reserved, actual))
            self._pending.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("quota correction failed", exc_info=task.exception())

    @property
    def pending(self) -> int:
        """Corrections scheduled and not yet applied."""
        return len(self._pending)

    async def close(self) -> None:
        """Let the corrections in progress finish."""
        await asyncio.gather(*self._pending, return_exceptions=True)
