"""The quota stage: charge the tenant's TPM and RPM windows before admission, correct them after.

Cheap refusals first. Counting a prompt costs tokenizer time every tenant shares, so a request its
tenant's windows cannot admit is refused before it is counted. The charge is therefore made in two
all-or-nothing reservations that together charge each window exactly once:

1. `reserve_early`, once the request's candidates are known and before it is counted: 1 request
   to each RPM window, and to each TPM window what the request provably costs at least (its
   output bound, which needs no count, plus a floor on its input: token ids are counted by
   length, a completion's text by `TokenFloor`, a chat's images at the model's rate; a chat's
   text has no floor before its template renders it, since templates may drop content). Only
   the windows every pool the request may end on shares are known then: the tenant's overall
   ones always, a model's when every candidate route and fallback serves that model, a pool's
   when there is one pool. A refusal here costs no tokenizer work at all.
2. `reserve`, once the request is counted and its pool chosen: the rest of each token charge and
   the windows not charged yet (pool, model). The early charge stays held meanwhile, so a burst
   cannot slip through between the two: each early reservation is atomic (one Lua script with
   Redis), and the room it took is the request's until it ends.

Why reserve-then-count rather than a check (peek) then the old reservation: a peek lets every
request of a burst through to the tokenizer while the window still looks open (a thousand
concurrent requests against 1 request left are all counted); a reservation lets exactly the ones
that fit. The residual: the early token charge is a floor, so requests whose floor fits but whose
full size does not are counted and then refused by step 2: a completion's text only as long as
the room its floor found allows, a chat's (whose floor is only its output) up to the context's
floor. Each such request still costs the tenant one request of its RPM: a request that reached
the tokenizer was served as far as that, so a tenant with an RPM cannot buy unbounded counting
with refusals. With Redis the two steps are two scripts: should Redis fail between them, the
rest is charged to the local windows `FailoverState` falls back to (each part is corrected where
it was charged, by its id). A request
refused by step 1 charges nothing, as a refusal always did; its `Retry-After` (exact for RPM) is
when its floor fits, so for TPM the whole request may be refused again then, with a later one.

A TPM window is charged the input and all the output a request may produce (`reservation`): its
own bound, or for a request that states none the one `bound_output` gives it and the forward
stage writes upstream; never the learned estimate, which a tenant can teach short answers. A
request larger than a whole window is refused for good (`request_over_limit`) only on its own
numbers; see `_charged`. When the response ends, however it ended, the token charge is corrected
to what the tenant got (`used`): the replica's usage when it is believed (for a chat or
completions stream the client left, the running count of what it was sent), else the
reservation (0 if it never reached a replica). The request itself stays counted against RPM.

`/tokenize`, `/detokenize` and `/v1/messages/count_tokens` are charged to the tenant's overall
windows (`reserve_counting`): a request and a token before their body is read, then the token
corrected to the tokens they counted or decoded. They generate nothing and use no replica, but
the tokenizer threads they use are every tenant's: a tenant refused every chat made the gateway
count 474k tokens in 6 s through `count_tokens` alone. Like a chat's, the count is known only
once made, so a window with any room left admits one; the next waits for the window.

Every response for a limited tenant carries OpenAI's `x-ratelimit-{limit,remaining,reset}-
{tokens,requests}` headers, as the windows stood after the reservation (or the refusal), and
those of the request's API besides (Anthropic's `anthropic-ratelimit-*` on `/v1/messages`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.context.compiled import Tenant
from gateway.context.ctx import CLIENT_CLOSED, Ctx
from gateway.context.endpoint import Api
from gateway.errors import GatewayError, OverQuota, QuotaExceeded, Refusal, StateUnavailable
from gateway.observability.instruments import Instruments
from gateway.state.base import (
    Correction,
    Limit,
    Reservation,
    State,
    StateUnreachable,
    TenantWindow,
    Window,
    WindowFull,
)

log = logging.getLogger("gateway.request.quota")


@dataclass(slots=True)
class Charge:
    """A request's reservations, to correct when it ends.

    `parts` are the token charges, `(reservation id, window key, tokens)`, the early one of a
    window before its rest: `settle` spreads the real use over them in that order. `charged` is
    every window charged so far and how much (requests too), so the second reservation charges
    only what the first did not; `windows` the latest view of each, for the headers.
    """

    parts: list[tuple[str, TenantWindow, int]] = field(default_factory=list)
    charged: dict[TenantWindow, int] = field(default_factory=dict)
    windows: dict[TenantWindow, Window] = field(default_factory=dict)


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
    """OpenAI's reset format, Go's durations to the millisecond: `20ms`, `6s`, `1.5s`, `6m0s`,
    `1m0.5s`. Rounded once, first, so a value a hair under a unit reads as that unit (59.9996 s
    is `1m0s`, never `60s`)."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _headers(pairs: Iterable[tuple[_Scoped, Window]], api: Api | None = None) -> dict[str, str]:
    """Per kind, the window with the least room left: the one that binds the next request; and
    the API's own headers for it (Anthropic's `anthropic-ratelimit-*`)."""
    binding: dict[str, Window] = {}
    for item, window in pairs:
        held = binding.get(item.kind)
        if held is None or window.remaining < held.remaining:
            binding[item.kind] = window
    out = {}
    for kind, window in binding.items():
        out[f"x-ratelimit-limit-{kind}"] = str(window.limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(window.remaining)
        out[f"x-ratelimit-reset-{kind}"] = duration(window.reset_s)
    if api is not None:
        api.ratelimit_headers(binding, out)
    return out


def has_tpm(tenant: Tenant) -> bool:
    """Whether any TPM window of the tenant's (overall, a model's, a pool's) may charge tokens."""
    spec = tenant.spec
    return spec.tpm is not None or any(
        limits.tpm is not None for limits in (*spec.models.values(), *spec.pools.values())
    )


def bound_output(ctx: Ctx, default_tokens: int) -> None:
    """Give a request that states no output bound the tenant's (`max_output_tokens`, else the
    model's `default_output_tokens`) when the tenant has a TPM window: the quota reserves what a
    request may produce, and without a bound vLLM generates to the end of the context. The
    bound is written into the replica's body (gateway/request/forward.py `upstream_body`), so what was
    reserved is all the replica may produce. Set before the estimate, which treats it as a
    client's bound; `force_length` and `Quotas.reserve` cut it to the context and the window."""
    tenant = ctx.tenant
    if ctx.max_output is not None or ctx.api.bound_field is None or tenant is None:
        return
    if not has_tpm(tenant):
        return
    ctx.max_output = max(tenant.spec.max_output_tokens or default_tokens, ctx.min_output)
    ctx.bounded_by_gateway = True


def _output_bound(ctx: Ctx) -> int:
    """The most output the request may produce over all its sequences: its bound (its own or
    the gateway's), else (a tenant with no TPM window: no token charge) the estimate."""
    per_sequence = ctx.expected_output if ctx.max_output is None else ctx.max_output
    return per_sequence * ctx.sequences


def reservation(ctx: Ctx, input_tokens: int | None = None) -> int:
    """What a request reserves of its tenant's TPM: its input (`input_tokens`, else the count)
    and all the output it may produce. The learned estimate has no part in it: a tenant that
    teaches the estimator short answers must not then be let through at the estimate's rate."""
    counted = ctx.input_tokens if input_tokens is None else input_tokens
    return counted + _output_bound(ctx)


def _stated_output(ctx: Ctx) -> int:
    """The output the request itself says it makes: all of its bound when the client set it,
    else its `min_tokens` (a bound the gateway set is cut to the window, so a refusal no wait
    can lift rests on the client's numbers only)."""
    if ctx.max_output is not None and not ctx.bounded_by_gateway:
        return ctx.max_output * ctx.sequences
    return ctx.min_output * ctx.sequences


def _stated(ctx: Ctx) -> int:
    """The tokens the request itself says it uses: its input and `_stated_output`."""
    return ctx.input_tokens + _stated_output(ctx)


def _charged(reserved: int, stated: int, tpm: int) -> int:
    """What to charge a window of `tpm` for a request of `reserved` tokens (`stated` certain).

    A refusal that no wait can lift must rest on the client's own numbers: a reservation larger
    than the whole window only because of the bound the gateway gave it is cut to the window
    (and the bound with it, by `Quotas.reserve`), so the request runs once the window is empty.
    Non-decreasing in both arguments, so lower bounds of them give a lower bound of the charge
    (what `reserve_early` relies on).
    """
    if reserved <= tpm:
        return reserved
    return max(stated, tpm)


def _windows(
    tenant: Tenant, reserved: int, stated: int, model: str | None, pool: str | None
) -> list[_Scoped]:
    """The tenant's overall windows, then those of `model` and `pool` (None: not known)."""
    scopes = [("", tenant.spec.tpm, tenant.spec.rpm)]
    by_model = tenant.spec.models.get(model) if model is not None else None
    by_pool = tenant.spec.pools.get(pool) if pool is not None else None
    if by_model is not None:
        scopes.append((f"model:{model}:", by_model.tpm, by_model.rpm))
    if by_pool is not None:
        scopes.append((f"pool:{pool}:", by_pool.tpm, by_pool.rpm))
    out = []
    for scope, tpm, rpm in scopes:
        if tpm is not None:
            amount = _charged(reserved, stated, tpm)
            window = TenantWindow(tenant.name, scope + "tokens")
            out.append(_Scoped("tokens", scope, Limit(window, amount, tpm)))
        if rpm is not None:
            window = TenantWindow(tenant.name, scope + "requests")
            out.append(_Scoped("requests", scope, Limit(window, 1, rpm)))
    return out


def tenant_windows(tenant: Tenant, ctx: Ctx, tokens: int) -> list[_Scoped]:
    """The windows a request charges on the model and pool it was routed to, `tokens` to each
    TPM window (as `_charged` cuts it)."""
    stated = _stated(ctx) if tokens else 0
    pool = ctx.pool.name if ctx.pool is not None else None
    return _windows(tenant, tokens, stated, ctx.served_model or None, pool)


def _fit_bound(ctx: Ctx, scoped: Sequence[_Scoped]) -> bool:
    """Cut the gateway's bound to what the tightest TPM window can take whole (as `_charged`
    cut its charge), so the replica is never let produce more than is reserved; whether it
    changed. Never below 1 or the request's `min_tokens`: then the window refuses it."""
    assert ctx.max_output is not None
    room = (
        min((s.limit.amount for s in scoped if s.kind == "tokens"), default=reservation(ctx))
        - ctx.input_tokens
    )
    fits = max(room // ctx.sequences, ctx.min_output, 1)
    if fits >= ctx.max_output:
        return False
    ctx.max_output = fits
    ctx.expected_output = min(ctx.expected_output, fits)
    return True


def _shared_scopes(ctx: Ctx) -> tuple[str | None, str | None]:
    """The model and the pool every place the request may end on shares, before it is counted:
    its candidate routes' pools and their fallbacks (the class, hence the route, and a spill
    are decided on the count); None where they differ."""
    pools = {
        pool.name: pool.spec.model
        for route in ctx.candidates
        for pool in (route.pool, *(fallback.pool for fallback in route.fallbacks))
    }
    models = set(pools.values())
    model = next(iter(models)) if len(models) == 1 else None
    pool = next(iter(pools)) if len(pools) == 1 else None
    return model, pool


def input_floor(ctx: Ctx) -> int:
    """Input tokens the request provably has before it is counted: its API's
    (gateway/api/), by the model's counter."""
    assert ctx.model is not None
    return ctx.api.input_floor(ctx, ctx.model.counter)


def used(ctx: Ctx, burst: int) -> int:
    """The tokens a request's tenant got, as its charge is settled: never less than it may have
    got, as far as the gateway can tell.

    - Never reached a replica: 0. A replica's error answer (4xx, 5xx, a time-out before the
      first byte): the input alone, as counted: the client got no output.
    - The replica's usage, when believed (`account` checks every field is a count within the
      request's bounds): its `prompt_tokens` (else the gateway's count) and its output, up to
      the reservation plus `burst`. Past the reservation only a prompt the replica counts higher
      than the gateway can take it (images its processor expands, an estimate-counted model);
      `burst` bounds what a replica's word alone adds to a window. A chat or completions stream
      that ended early (the client left, the stream broke) has as its output the running count
      of the last chunk relayed (gateway/api/openai.py `delivered`): what the client got.
    - An output no bound limits (a transcription's: `ctx.max_output` None, as the reservation
      cannot bound it): the believed count, whole, be it the replica's usage (a stream's, within
      the context) or the gateway's own count of a whole answer's text (`Api.count_answer`).
    - Otherwise (no usage: a Messages or Responses stream the client left, whose events carry
      no running count, a replica that sent none; or a usage out of bounds): the reservation,
      which is all the replica was allowed to produce, or input plus the chunks the gateway
      relayed if that is more (a replica that ignored the bound). Settling on the relayed
      chunks instead would charge a client that left a stream of multi-token chunks
      (speculative decoding, `--stream-interval`) a tenth of what it got.
    - Preempted (`slo.preempt`): the gateway's decision, not the tenant's, so only what its
      client was delivered: 0 before a token of its answer; after, as above, but with no
      running count the input plus the chunks relayed, never the reservation.
    """
    if not ctx.admitted:
        return 0
    preempted = ctx.refusal is Refusal.PREEMPTED
    if preempted and ctx.first_token is None:
        return 0
    if ctx.status >= 400 and ctx.status != CLIENT_CLOSED:
        return ctx.input_tokens
    reserved = reservation(ctx)
    if ctx.usage_believed and ctx.output_tokens is not None:
        prompt = ctx.input_tokens if ctx.prompt_tokens is None else ctx.prompt_tokens
        if ctx.max_output is None:  # no bound limits it (a transcription): its whole count
            return prompt + ctx.output_tokens
        return min(prompt + ctx.output_tokens, reserved + burst)
    if preempted:
        return ctx.input_tokens + ctx.chunks
    return max(reserved, ctx.input_tokens + ctx.chunks)


def _spread(parts: Sequence[tuple[str, TenantWindow, int]], use: int) -> list[Correction]:
    """Each token part with what it is corrected to, `use` spread over a window's parts in order:
    each takes up to what it reserved, the last the rest, so while the charges are in the window
    their sum becomes `use`, and once they have left only an excess is charged (`State.adjust`)."""
    by_key: dict[TenantWindow, list[tuple[str, int]]] = {}
    for charge_id, key, amount in parts:
        by_key.setdefault(key, []).append((charge_id, amount))
    out = []
    for key, charges in by_key.items():
        left = use
        for i, (charge_id, amount) in enumerate(charges):
            actual = left if i == len(charges) - 1 else min(left, amount)
            left -= actual
            out.append(Correction(key, charge_id, amount, actual))
    return out


class Quotas:
    """Tenants' windows in a `State`. Corrections run as tasks kept here and awaited at close,
    so the pipeline's `finally` never awaits (a cancelled handler still corrects its charge)."""

    def __init__(self, state: State, metrics: Instruments) -> None:
        self.state = state
        self.metrics = metrics
        self._pending: set[asyncio.Task[Any]] = set()

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._pending.add(task)
        task.add_done_callback(self._done)

    async def _reserve(self, scoped: Sequence[_Scoped]) -> Reservation | WindowFull:
        """`State.reserve`, never lost to a cancellation: the client leaving while the call runs
        (with Redis, the script may already have charged) lets the call finish, then gives its
        tokens back, as `settle` does for a request that never reached a replica. The one seam
        where a state that fails closed becomes the client's 503: every charge goes through here.
        """
        call = asyncio.ensure_future(self.state.reserve([item.limit for item in scoped]))
        self._pending.add(call)  # awaited at close; its error is the caller's, not logged here
        call.add_done_callback(self._pending.discard)
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            tokens = [item.limit for item in scoped if item.kind == "tokens"]
            call.add_done_callback(lambda done: self._orphaned(done, tokens))
            raise
        except StateUnreachable as exc:
            raise StateUnavailable(exc.message, retry_after_s=exc.retry_after_s) from exc

    def _orphaned(self, call: asyncio.Task[Reservation | WindowFull], tokens: list[Limit]) -> None:
        """A reservation whose caller left: its tokens back (its request stays counted)."""
        if call.cancelled() or call.exception() is not None:
            return
        result = call.result()
        if isinstance(result, Reservation) and tokens:
            self._correct([Correction(limit.key, result.id, limit.amount, 0) for limit in tokens])

    def _correct(self, corrections: list[Correction]) -> asyncio.Task[None]:
        """One call for all of a request's corrections: its windows are one tenant's."""
        task = asyncio.create_task(self.state.adjust(corrections))
        self._track(task)
        return task

    def _refuse(self, tenant: Tenant, item: _Scoped, retry_after_s: float | None) -> GatewayError:
        """The 429 for `item`'s window, counted in `llm_quota_rejections_total`."""
        self.metrics.quota_rejections.labels(tenant.name, item.kind).inc()
        per_minute = f"{item.limit.limit} {item.kind} per minute{item.where}"
        if retry_after_s is None:
            return OverQuota(
                f"this request needs {item.limit.amount} {item.kind}, more than tenant"
                f" {tenant.name!r}'s whole limit of {per_minute}"
            )
        return QuotaExceeded(
            f"tenant {tenant.name!r} is at its limit of {per_minute}; this request needs"
            f" {item.limit.amount}; try again in {retry_after_s:.1f}s",
            retry_after_s=retry_after_s,
        )

    async def reserve_early(self, ctx: Ctx) -> Charge | None:
        """Before the prompt is counted: charge what the request costs at least (see the module's
        docstring) or raise 429, the tokenizer untouched; None when nothing was charged.

        Needs `ctx.candidates` and the output estimate (`estimate_output` reads no count)."""
        if ctx.tenant is None:
            return None
        floor = input_floor(ctx)
        reserved = reservation(ctx, floor)
        stated = floor + _stated_output(ctx)
        scoped = _windows(ctx.tenant, reserved, stated, *_shared_scopes(ctx))
        if not scoped:
            return None
        result = await self._reserve(scoped)
        ctx.ratelimit_headers = _headers(zip(scoped, result.windows, strict=True), ctx.api)
        if isinstance(result, WindowFull):
            raise self._refuse(ctx.tenant, scoped[result.index], result.retry_after_s)
        charge = Charge()
        self._record(charge, result, scoped)
        return charge

    @staticmethod
    def _record(charge: Charge, result: Reservation, scoped: Sequence[_Scoped]) -> None:
        for item, window in zip(scoped, result.windows, strict=True):
            key, amount = item.limit.key, item.limit.amount
            charge.charged[key] = charge.charged.get(key, 0) + amount
            charge.windows[key] = window
            if item.kind == "tokens":
                charge.parts.append((result.id, key, amount))

    async def reserve(self, ctx: Ctx, early: Charge | None = None) -> Charge | None:
        """Once counted and routed: charge what `early` did not, or raise 429; None when there is
        nothing to correct. A refusal gives `early`'s tokens back at once (its request stays
        counted), so the refusal's headers, read after, show the window as it will stay."""
        if ctx.tenant is None:
            return early
        tenant = ctx.tenant
        scoped = tenant_windows(tenant, ctx, reservation(ctx))
        if ctx.bounded_by_gateway and _fit_bound(ctx, scoped):
            scoped = tenant_windows(tenant, ctx, reservation(ctx))
        charge = early if early is not None else Charge()
        over = next((s for s in scoped if s.limit.amount > s.limit.limit), None)
        if over is not None:
            raise await self._refused_late(ctx, charge, over, None)
        rest = [
            _Scoped(s.kind, s.scope, Limit(s.limit.key, missing, s.limit.limit))
            for s in scoped
            if (missing := s.limit.amount - charge.charged.get(s.limit.key, 0)) > 0
        ]
        if rest:
            result = await self._reserve(rest)
            if isinstance(result, WindowFull):
                refused = rest[result.index]
                item = next(s for s in scoped if s.limit.key == refused.limit.key)
                raise await self._refused_late(ctx, charge, item, result.retry_after_s)
            self._record(charge, result, rest)
        ctx.ratelimit_headers = _headers(
            ((s, charge.windows[s.limit.key]) for s in scoped if s.limit.key in charge.windows),
            ctx.api,
        )
        ctx.tokens_charged = bool(charge.parts)
        return charge if charge.charged else None

    async def _refused_late(
        self, ctx: Ctx, charge: Charge, item: _Scoped, retry_after_s: float | None
    ) -> GatewayError:
        """The refusal of a counted request: its early tokens given back (awaited; tasks kept
        here, so a client leaving meanwhile loses none) and its headers left to `describe`."""
        assert ctx.tenant is not None
        error = self._refuse(ctx.tenant, item, retry_after_s)
        releases = [Correction(key, i, amount, 0) for i, key, amount in charge.parts]
        charge.parts.clear()
        if releases:
            await asyncio.wait([self._correct(releases)])
        ctx.ratelimit_headers = {}
        return error

    async def reserve_counting(
        self, tenant: Tenant, headers: dict[str, str], api: Api | None = None
    ) -> Charge | None:
        """Charge one request to `tenant`'s overall RPM and one token (all it provably costs
        before its body is read) to its overall TPM, for `/tokenize`, `/detokenize` or
        `/v1/messages/count_tokens`, or raise 429; `headers` gets the windows' `x-ratelimit-*`
        either way. `settle_counted` corrects the token to the tokens the call handled: the
        tokenizer time every tenant shares is paid for like a prompt's, so a tenant refused
        every chat cannot have the gateway count for it instead. Never a model's or pool's
        window: no replica serves them. None when there is nothing to correct."""
        scoped = _windows(tenant, 1, 1, None, None)
        if not scoped:
            return None
        result = await self._reserve(scoped)
        headers.update(_headers(zip(scoped, result.windows, strict=True), api))
        if isinstance(result, WindowFull):
            raise self._refuse(tenant, scoped[result.index], result.retry_after_s)
        charge = Charge()
        self._record(charge, result, scoped)
        return charge

    def settle_counted(self, charge: Charge, tokens: int) -> None:
        """Correct a `reserve_counting` charge to the `tokens` counted or decoded; never
        awaits."""
        if charge.parts:
            self._correct(_spread(charge.parts, tokens))
        charge.parts.clear()

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
        ctx.ratelimit_headers = _headers(zip(scoped, windows, strict=True), ctx.api)

    def settle(self, ctx: Ctx, charge: Charge) -> None:
        """Correct the token charges to what the tenant got (`used`). Call after `account`,
        which decides whether the replica's usage is believed; never raises, never awaits."""
        if charge.parts:
            assert ctx.tenant is not None
            self._correct(_spread(charge.parts, used(ctx, ctx.tenant.spec.burst_tokens)))
        charge.parts.clear()

    def _done(self, task: asyncio.Task[Any]) -> None:
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
