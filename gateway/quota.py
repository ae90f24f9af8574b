"""Stage 5b, quota: reserve the tenant's TPM and RPM before admission, correct the charge after.

At this point the input tokens are counted and the output estimated, so the request's
`reserved_tokens` (input + expected output) is charged to the tenant's TPM window and 1 to its
RPM window, all or nothing; a request that does not fit is refused with the `Retry-After` its
window computes, before it takes a place in any queue. When the response ends, however it ended,
the token charge is corrected to what was really used: input + output tokens if a replica served
it (output from the usage chunk, or the chunks counted when the stream broke or the client
left), 0 if it never reached one. The request itself stays counted against RPM.

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
    tokens_key: str | None  # None: the tenant has no TPM, only its requests were counted
    reserved: int


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `6s`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"


def _headers(kinds: list[str], windows: tuple[Window, ...]) -> dict[str, str]:
    out = {}
    for kind, window in zip(kinds, windows, strict=True):
        out[f"x-ratelimit-limit-{kind}"] = str(window.limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(window.remaining)
        out[f"x-ratelimit-reset-{kind}"] = duration(window.reset_s)
    return out


class Quotas:
    """Tenants' windows in a `State`. Corrections run as tasks kept here and awaited at close,
    so the pipeline's `finally` never awaits (a cancelled handler still corrects its charge)."""

    def __init__(self, state: State, metrics: Metrics) -> None:
        self.state = state
        self.metrics = metrics
        self._pending: set[asyncio.Task[None]] = set()

    @staticmethod
    def _limits(tenant: Tenant, tokens: int) -> tuple[list[str], list[Limit]]:
        # One hash tag per tenant: its windows share a Redis Cluster slot, so one script
        # can charge them together.
        prefix = f"quota:{{{tenant.name}}}:"
        kinds: list[str] = []
        limits: list[Limit] = []
        if tenant.spec.tpm is not None:
            kinds.append("tokens")
            limits.append(Limit(prefix + "tokens", tokens, tenant.spec.tpm))
        if tenant.spec.rpm is not None:
            kinds.append("requests")
            limits.append(Limit(prefix + "requests", 1, tenant.spec.rpm))
        return kinds, limits

    async def reserve(self, ctx: Ctx) -> Charge | None:
        """Charge the tenant's windows or raise 429; None when there is nothing to correct."""
        if ctx.tenant is None:
            return None
        tenant = ctx.tenant
        kinds, limits = self._limits(tenant, ctx.reserved_tokens)
        if not limits:
            return None
        result = await self.state.reserve(limits)
        ctx.ratelimit_headers = _headers(kinds, result.windows)
        if isinstance(result, Refusal):
            kind, limit = kinds[result.index], limits[result.index]
            self.metrics.quota_rejections.labels(tenant.name, kind).inc()
            per_minute = f"{limit.limit} {kind} per minute"
            if result.retry_after_s is None:
                raise OverQuota(
                    f"this request needs {limit.amount} {kind}, more than tenant"
                    f" {tenant.name!r}'s whole limit of {per_minute}"
                )
            raise QuotaExceeded(
                f"tenant {tenant.name!r} is at its limit of {per_minute}; this request needs"
                f" {limit.amount}; try again in {result.retry_after_s:.1f}s",
                retry_after_s=result.retry_after_s,
            )
        tokens_key = limits[0].key if kinds[0] == "tokens" else None
        return Charge(result.id, tokens_key, ctx.reserved_tokens)

    async def describe(self, ctx: Ctx) -> None:
        """Give a response refused before the quota stage (a 400 of a known tenant) the headers
        too, so every answer to a limited tenant says where its windows stand; never raises:
        the headers inform, they must not turn a refusal into a failure."""
        if ctx.tenant is None or ctx.ratelimit_headers:
            return
        kinds, limits = self._limits(ctx.tenant, 0)
        if not limits:
            return
        try:
            ctx.ratelimit_headers = _headers(kinds, await self.state.peek(limits))
        except Exception:
            log.exception("reading tenant %s's windows failed", ctx.tenant.name)

    def settle(self, ctx: Ctx, charge: Charge) -> None:
        """Correct the token charge to real usage. Call after `account`, which fills in output
        tokens from the chunks counted when a stream broke; never raises, never awaits."""
        if charge.tokens_key is None:
            return
        actual = ctx.input_tokens + (ctx.output_tokens or 0) if ctx.replica else 0
        task = asyncio.create_task(
            self.state.adjust(charge.tokens_key, charge.id, charge.reserved, actual)
        )
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
