"""The estimate stage: how many tokens will this request generate?

`max_completion_tokens` / `max_tokens` is a bound, and clients often send 4,096 for a 10-token answer.
So an output-length estimator learns what similar requests really produced and the expected output
is the smaller of the two. "Similar" is keyed by (tenant, endpoint, requested model, prompt
fingerprint): the fingerprint hashes the start of the prompt (a chat's first message: a system
prompt or a rules block; each endpoint says which, `Api.fingerprint` in gateway/api/), which is
what makes a classification prompt recognisable from one request to the next.

The tenant is part of the key because an estimate decides what a request reserves of its tenant's
TPM and which class it falls in: with a shared key, 22 requests of one tenant asking for 5,000
tokens on a common system prompt made another tenant's every request need more than its whole
TPM. Each tenant learns only from its own traffic, in a table of its own, so one tenant's flood of
new prompts cannot evict another's estimates either.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from gateway.config.plugins import register
from gateway.context.ctx import Ctx

Key = tuple[
    str | None, str, str, int
]  # tenant (None without tenants), endpoint, model, fingerprint


class OutputEstimator(Protocol):
    """Learns output lengths; one instance per policy (a plug-in: `plugins.output_estimator`).

    The estimator names what makes requests similar (`key`): one that learns from more of a
    request than the default key (its input length, its class's rules) says so there, and
    neither the stage nor the accounting that feeds it changes."""

    def key(self, ctx: Ctx) -> Hashable:
        """What the estimate of this request is learned under: read once the request is parsed
        and its candidates found, before it is counted, and again when it has been answered."""
        ...

    def estimate(self, key: Any) -> int | None:
        """The learned expected output for this key, or None while it knows too little."""
        ...

    def observe(self, key: Any, output_tokens: int) -> None: ...


def estimator_key(ctx: Ctx) -> Key:
    tenant = ctx.tenant.name if ctx.tenant is not None else None
    return (tenant, ctx.endpoint, ctx.requested_model, ctx.fingerprint)


def estimate_output(ctx: Ctx, estimator: OutputEstimator, default_tokens: int) -> None:
    """Set `expected_output` and `estimate_source` (`max_tokens`, `learned`, `default`).

    A request that forces its length is not estimated: `ignore_eos` generates `max_tokens`
    (without it, to the context's end: `force_length` once counted), and `min_tokens` at least
    that many, whatever the tenant's past answers taught the estimator. A bound the gateway
    gave (gateway/request/quota.py `bound_output`) is no client's number: it only caps the estimate."""
    ctx.fingerprint = ctx.api.fingerprint(ctx.body)
    bound = None if ctx.bounded_by_gateway else ctx.max_output
    learned = None if ctx.forced_output else estimator.estimate(estimator.key(ctx))
    if learned is not None and (bound is None or learned < bound):
        ctx.expected_output, ctx.estimate_source = max(learned, ctx.min_output), "learned"
    elif bound is not None:
        ctx.expected_output, ctx.estimate_source = bound, "max_tokens"
    else:
        ctx.expected_output, ctx.estimate_source = max(default_tokens, ctx.min_output), "default"
    if ctx.bounded_by_gateway and ctx.max_output is not None:
        ctx.expected_output = min(ctx.expected_output, ctx.max_output)


def force_length(ctx: Ctx, max_model_len: int) -> None:
    """Once counted: an `ignore_eos` request without `max_tokens` generates to the end of the
    context, as vLLM's default `max_tokens` is what the context leaves; a bound the gateway gave
    (gateway/request/quota.py `bound_output`) is cut to what the context leaves."""
    if ctx.bounded_by_gateway and ctx.max_output is not None:
        room = max_model_len - ctx.longest_prompt
        if 0 < room < ctx.max_output:
            ctx.max_output = room
            ctx.expected_output = min(ctx.expected_output, room)
    elif ctx.forced_output and ctx.max_output is None:
        ctx.expected_output = max(max_model_len - ctx.longest_prompt, 0)
        ctx.estimate_source = "forced"


class _Window:
    """The last `size` samples, in arrival order and sorted.

    Every request reads its key's quantile and every answer adds a sample, so a cached quantile
    would be stale at each read and sorting the window would be paid per request; keeping a sorted copy costs a binary search and a short memmove per sample instead.
    """

    __slots__ = ("ordered", "samples", "updated")

    def __init__(self, size: int, now: float) -> None:
        self.samples: deque[int] = deque(maxlen=size)
        self.ordered: list[int] = []
        self.updated = now

    def add(self, sample: int) -> None:
        if len(self.samples) == self.samples.maxlen:  # the oldest leaves both
            del self.ordered[bisect_left(self.ordered, self.samples[0])]
        self.samples.append(sample)
        insort(self.ordered, sample)


class _Table:
    """One tenant's windows, an LRU of at most `max_keys`."""

    __slots__ = ("first", "windows")

    def __init__(self) -> None:
        self.windows: OrderedDict[Key, _Window] = OrderedDict()
        # Most keys are seen once (a chat's first message is often unique): they only get a
        # window when they come back, so one-offs cost a pair each, not a deque.
        self.first: OrderedDict[Key, tuple[int, float]] = OrderedDict()


@register("output_estimator", "rolling-quantile")
class RollingQuantileEstimator:
    """A rolling quantile (default p90) of completion tokens over the last `window` responses."""

    class Params(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")
        quantile: float = Field(0.9, gt=0, le=1)
        window: int = Field(200, ge=1)
        min_samples: int = Field(20, ge=1)
        max_keys: int = Field(10_000, ge=1, description="Keys kept per tenant (LRU).")
        max_age_s: float = Field(
            600.0,
            gt=0,
            description=(
                "A key with no new sample for this long is forgotten: its requests fall back to"
                " their `max_tokens` or the model's default, so an estimate that nothing refreshes"
                " (its requests refused, its traffic gone) does not stay in force."
            ),
        )

    def __init__(self, params: Params, clock: Callable[[], float] = time.monotonic) -> None:
        self.params = params
        self.clock = clock
        # Tenants are the policy's (plus None): the tables are bounded by the policy.
        self._tables: dict[str | None, _Table] = {}

    key = staticmethod(estimator_key)

    def _table(self, key: Key) -> _Table:
        table = self._tables.get(key[0])
        if table is None:
            table = self._tables[key[0]] = _Table()
        return table

    def estimate(self, key: Key) -> int | None:
        table = self._tables.get(key[0])
        window = None if table is None else table.windows.get(key)
        if table is None or window is None:
            return None
        if self.clock() - window.updated > self.params.max_age_s:
            del table.windows[key]
            return None
        ordered = window.ordered
        if len(ordered) < self.params.min_samples:
            return None
        rank = max(0, math.ceil(self.params.quantile * len(ordered)) - 1)
        return max(1, ordered[rank])

    def observe(self, key: Key, output_tokens: int) -> None:
        now = self.clock()
        table = self._table(key)
        window = table.windows.get(key)
        if window is not None and now - window.updated > self.params.max_age_s:
            window = None  # stale samples describe traffic that is gone: start again
            del table.windows[key]
        if window is None:
            first = table.first.pop(key, None)
            if first is None or now - first[1] > self.params.max_age_s:
                table.first[key] = (output_tokens, now)
                if len(table.first) > self.params.max_keys:
                    table.first.popitem(last=False)
                return
            window = table.windows[key] = _Window(self.params.window, now)
            window.add(first[0])
            if len(table.windows) > self.params.max_keys:
                table.windows.popitem(last=False)
        else:
            table.windows.move_to_end(key)
        window.add(output_tokens)
        window.updated = now
