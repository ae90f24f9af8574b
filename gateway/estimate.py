"""Stage 3, estimate: how many tokens will this request generate?

`max_completion_tokens` / `max_tokens` is a bound, and clients often send 4,096 for a 10-token answer.
So an output-length estimator learns what similar requests really produced and the expected output
is the smaller of the two. "Similar" is keyed by (endpoint, requested model, prompt fingerprint): the
fingerprint hashes the start of the first message (a system prompt or a rules block), which is what
makes a classification prompt recognisable from one request to the next.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from gateway.context import Ctx
from gateway.policy.plugins import register
from gateway.tokens import message_text

FINGERPRINT_CHARS = 256

Key = tuple[str, str, int]


class OutputEstimator(Protocol):
    """Learns output lengths; one instance per policy."""

    def estimate(self, key: Key) -> int | None:
        """The learned expected output for this key, or None while it knows too little."""
        ...

    def observe(self, key: Key, output_tokens: int) -> None: ...


def fingerprint(ctx: Ctx) -> int:
    if ctx.endpoint == "chat":
        head = message_text(ctx.body["messages"][0].get("content"))[:FINGERPRINT_CHARS]
    else:
        prompt = ctx.body["prompt"]
        if isinstance(prompt, str):
            head = prompt[:FINGERPRINT_CHARS]
        elif isinstance(prompt[0], int):  # token ids
            return hash(tuple(prompt[:64]))
        elif isinstance(prompt[0], str):
            head = prompt[0][:FINGERPRINT_CHARS]
        else:
            return hash(tuple(prompt[0][:64]))
    return hash(head)


def estimator_key(ctx: Ctx) -> Key:
    return (ctx.endpoint, ctx.requested_model, ctx.fingerprint)


def estimate_output(ctx: Ctx, estimator: OutputEstimator, default_tokens: int) -> None:
    """Set `expected_output` and `estimate_source` (`max_tokens`, `learned`, `default`)."""
    ctx.fingerprint = fingerprint(ctx)
    learned = estimator.estimate(estimator_key(ctx))
    bound = ctx.max_output
    if learned is not None and (bound is None or learned < bound):
        ctx.expected_output, ctx.estimate_source = learned, "learned"
    elif bound is not None:
        ctx.expected_output, ctx.estimate_source = bound, "max_tokens"
    else:
        ctx.expected_output, ctx.estimate_source = default_tokens, "default"


class _Window:
    __slots__ = ("quantile", "samples")

    def __init__(self, size: int) -> None:
        self.samples: deque[int] = deque(maxlen=size)
        self.quantile: int | None = None  # cached; None after a new sample


@register("output_estimator", "rolling-quantile")
class RollingQuantileEstimator:
    """A rolling quantile (default p90) of completion tokens over the last `window` responses."""

    class Params(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")
        quantile: float = Field(0.9, gt=0, le=1)
        window: int = Field(200, ge=1)
        min_samples: int = Field(20, ge=1)
        max_keys: int = Field(10_000, ge=1)

    def __init__(self, params: Params) -> None:
        self.params = params
        self._windows: OrderedDict[Key, _Window] = OrderedDict()
        # Most keys are seen once (a chat's first message is often unique): they only get a
        # window when they come back, so one-offs cost an int each, not a deque.
        self._first: OrderedDict[Key, int] = OrderedDict()

    def estimate(self, key: Key) -> int | None:
        window = self._windows.get(key)
        if window is None or len(window.samples) < self.params.min_samples:
            return None
        if window.quantile is None:
            ordered = sorted(window.samples)
            rank = max(0, math.ceil(self.params.quantile * len(ordered)) - 1)
            window.quantile = max(1, ordered[rank])
        return window.quantile

    def observe(self, key: Key, output_tokens: int) -> None:
        window = self._windows.get(key)
        if window is None:
            first = self._first.pop(key, None)
            if first is None:
                self._first[key] = output_tokens
                if len(self._first) > self.params.max_keys:
                    self._first.popitem(last=False)
                return
            window = self._windows[key] = _Window(self.params.window)
            window.samples.append(first)
            if len(self._windows) > self.params.max_keys:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
        window.samples.append(output_tokens)
        window.quantile = None
