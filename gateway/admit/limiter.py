"""Caps that find the knee: each replica's concurrency cap moves between a floor and a ceiling
(the pool's `max_concurrency`, or `slo.adaptive.max_concurrency` above it, when the pool's may
be written too low: there each cap starts) to hold the pool's latency target (`PoolSloSpec.adaptive_target`), and its
in-flight token cap with it, in proportion.

A cap written from last month's load test is either past the knee (latency turns non-linear) or
short of it (accelerators idle). The limiter is AIMD over windows of answers, as Netflix's
concurrency-limits (a windowed AIMD limit) and Envoy's adaptive concurrency filter (a percentile
of a sampling window) are: a window is at least `interval_s` and `min_samples` answers long, and
its `quantile` of TTFT and TPOT is judged against the target.

- Over the target (either one): the cap is multiplied by `backoff`, and falls by one at least.
- Under it by the `margin`, and the replica ran at or near its cap in the window: it grows by
  about the square root of the cap, so a cap half the knee's is back within a few windows. A
  replica its traffic leaves idle answers fast whatever its cap, which says nothing of a higher
  one: its cap holds.
- A cap that went over is remembered: growing back towards it halves the distance each time, so
  the cap spends its windows under the knee instead of probing past it every other one; past it,
  the knee has moved, and the full step is back.

TTFT counts from the grant, not the arrival: the gateway's own queue is not the replica's
latency, and counting it would shrink the caps that make the queue longer. Only requests granted
since the cap last moved are samples of it: one that ran under the previous cap (above all, the
requests over a cap just lowered) would move it twice for one cause. A non-streamed answer has
no first-token time unless it is one token long (a classifier's label): then its whole time is.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Literal

from gateway.admit.replica import Replica
from gateway.config.schema import AdaptiveSpec, PoolSpec, SloSpec
from gateway.context.ctx import Ctx

log = logging.getLogger("gateway.admit")  # one logger for the whole stage: operators grep it

Move = Literal["grow", "ttft_over", "tpot_over"]  # `llm_adaptive_cap_moves_total`'s reasons
WINDOW = 128  # the newest answers of a window that its quantile is taken over


class Samples:
    """One figure's newest values in the current window, in a ring allocated once."""

    __slots__ = ("count", "values")

    def __init__(self, size: int) -> None:
        self.values = [0.0] * size
        self.count = 0  # added in this window, the ring's overwritten ones too

    def add(self, value: float) -> None:
        self.values[self.count % len(self.values)] = value
        self.count += 1

    def quantile(self, q: float) -> float:
        """The nearest-rank `q` quantile of the values kept (the newest, when the ring is full)."""
        kept = sorted(self.values[: min(self.count, len(self.values))])
        return kept[max(0, math.ceil(q * len(kept)) - 1)]


class Cap:
    """One replica's limit, and the window its next move is judged on."""

    __slots__ = ("limit", "moved_at", "opened_at", "over", "peak", "peak_tokens", "tpot", "ttft")

    def __init__(self, limit: int, size: int) -> None:
        self.limit = limit
        self.over: int | None = None  # the last limit that went over its target
        self.moved_at = -math.inf  # answers to requests granted before this are not its samples
        self.ttft = Samples(size)
        self.tpot = Samples(size)
        self.opened_at = -math.inf  # a first window is judged once it has its answers
        self.peak = 0  # the most in flight at an answer in this window
        self.peak_tokens = 0

    def resized(self, size: int) -> Cap:
        """The same limit and history, an empty window in rings of `size`."""
        cap = Cap(self.limit, size)
        cap.over, cap.moved_at, cap.opened_at = self.over, self.moved_at, self.opened_at
        return cap

    def reopen(self, now: float) -> None:
        self.opened_at = now
        self.ttft.count = self.tpot.count = self.peak = self.peak_tokens = 0


class Limiter:
    """The adaptive caps of one pool's replicas (`PoolSloSpec.adaptive`)."""

    def __init__(self, pool: str, spec: PoolSpec) -> None:
        self.pool = pool
        self.moves: Counter[Move] = Counter()
        self._caps: dict[str, Cap] = {}
        self.retune(spec)

    def retune(self, spec: PoolSpec) -> None:
        """Take a reloaded pool spec: replicas that stay keep their limits, clamped to the new
        bounds; one that joins starts at its peers' mean limit (a replica of the same model and
        hardware has the same knee), or at `max_concurrency`, as written, when it has none."""
        assert spec.slo is not None and spec.slo.adaptive is not None
        self._spec: AdaptiveSpec = spec.slo.adaptive
        target = spec.slo.adaptive_target
        assert target is not None
        self._target: SloSpec = target
        self._floor = self._spec.min_concurrency
        self._ceiling = self._spec.max_concurrency or spec.max_concurrency
        self._start = spec.max_concurrency  # as written: where a cap starts
        self._tokens = spec.max_inflight_tokens
        size = max(WINDOW, self._spec.min_samples)
        for kept in self._caps.values():
            kept.limit = self._clamp(kept.limit)
        staying = [self._caps[url].limit for url in spec.replicas if url in self._caps]
        joins = round(sum(staying) / len(staying)) if staying else self._start
        caps: dict[str, Cap] = {}
        for url in spec.replicas:
            cap = self._caps.get(url)
            if cap is None:
                cap = Cap(joins, size)
            elif len(cap.ttft.values) != size:  # its window starts again, in rings of the size
                cap = cap.resized(size)
            caps[url] = cap
        self._caps = caps

    def _clamp(self, limit: int) -> int:
        return max(self._floor, min(self._ceiling, limit))

    def caps(self, url: str) -> tuple[int, int | None]:
        """The replica's concurrency cap in force and its in-flight token cap, which moves in
        proportion: at the floor it is `max_inflight_tokens` x floor / `max_concurrency`."""
        limit = self._caps[url].limit
        if self._tokens is None:
            return limit, None
        return limit, max(1, self._tokens * limit // self._start)

    def limits(self) -> dict[str, int]:
        return {url: cap.limit for url, cap in self._caps.items()}

    def answered(self, replica: Replica, ctx: Ctx, tpot_s: float | None) -> None:
        """A request granted on `replica` got its answer (`LivePool.answered`)."""
        if ctx.first_token is not None:
            ttft_s: float | None = ctx.first_token - ctx.granted
        elif ctx.output_tokens == 1:
            ttft_s = time.perf_counter() - ctx.granted
        else:
            ttft_s = None
        self.observe(replica, ctx.granted, ttft_s, tpot_s)

    def observe(
        self, replica: Replica, granted: float, ttft_s: float | None, tpot_s: float | None
    ) -> None:
        """One answer's figures, and how full the replica ran when it came: O(1), no allocation."""
        cap = self._caps.get(replica.url)
        if cap is None or granted < cap.moved_at:  # a replica that left, or an earlier cap's
            return
        if ttft_s is not None:
            cap.ttft.add(ttft_s)
        if tpot_s is not None:
            cap.tpot.add(tpot_s)
        # The ledger's count is every gateway's: with Redis the cap bounds them all together.
        load = max(replica.inflight, replica.shared or 0)
        if load > cap.peak:
            cap.peak = load
        if replica.inflight_tokens > cap.peak_tokens:
            cap.peak_tokens = replica.inflight_tokens

    def decide(self, replicas: Sequence[Replica], now: float) -> list[tuple[Replica, bool]]:
        """Judge each replica's window that is long enough; the replicas whose cap moved, each
        with whether it grew. Called on the health checker's tick, never per request."""
        moved: list[tuple[Replica, bool]] = []
        interval_s, margin = self._spec.interval_s, self._spec.margin
        for replica in replicas:
            cap = self._caps.get(replica.url)
            if cap is None or now - cap.opened_at < interval_s:
                continue
            judged = self._judged(cap)
            if judged is None:
                continue  # not enough answers yet: the window stays open
            used = self._used(cap, replica)
            cap.reopen(now)
            reason, ratio, figure, target_ms = judged
            if ratio > 1:
                if not self._lower(replica, cap, reason, figure, target_ms):
                    continue
                grew = False
            elif ratio < 1 - margin and used and self._grow(cap):
                self.moves["grow"] += 1
                grew = True
            else:
                continue  # within the margin, or idle: it holds
            cap.moved_at = now
            moved.append((replica, grew))
        return moved

    def _judged(self, cap: Cap) -> tuple[Move, float, float, float] | None:
        """The window's worst figure against its target: which, the ratio, the quantile and the
        target; None while no targeted figure has `min_samples` answers."""
        spec, target = self._spec, self._target
        worst: tuple[Move, float, float, float] | None = None
        figures: tuple[tuple[Move, Samples, float | None], ...] = (
            ("ttft_over", cap.ttft, target.ttft_ms),
            ("tpot_over", cap.tpot, target.tpot_ms),
        )
        for reason, samples, target_ms in figures:
            if target_ms is None or samples.count < spec.min_samples:
                continue
            figure = samples.quantile(spec.quantile)
            ratio = figure * 1000 / target_ms
            if worst is None or ratio > worst[1]:
                worst = (reason, ratio, figure, target_ms)
        return worst

    def _used(self, cap: Cap, replica: Replica) -> bool:
        """The replica ran at or near its cap (within the margin), in requests or in tokens."""
        near = 1 - self._spec.margin
        if cap.peak >= math.ceil(cap.limit * near):
            return True
        tokens = self.caps(replica.url)[1]
        return tokens is not None and cap.peak_tokens >= tokens * near

    def _grow(self, cap: Cap) -> bool:
        step = max(1, round(math.sqrt(cap.limit)))
        if cap.over is not None and cap.limit < cap.over:
            step = max(1, min(step, (cap.over - cap.limit) // 2))
        grown = min(self._ceiling, cap.limit + step)
        if grown == cap.limit:
            return False  # at the policy's cap already: nothing moved
        cap.limit = grown
        return True

    def _lower(
        self, replica: Replica, cap: Cap, reason: Move, figure: float, target_ms: float
    ) -> bool:
        was = cap.over = cap.limit
        cap.limit = self._clamp(min(was - 1, math.floor(was * self._spec.backoff)))
        if cap.limit == was:
            return False  # at the floor already: nothing moved
        self.moves[reason] += 1
        log.info(
            "pool %s: replica %s's cap %d -> %d: its p%g %s, %.0f ms, is over the %g ms target",
            self.pool, replica.url, was, cap.limit, self._spec.quantile * 100,
            "TTFT" if reason == "ttft_over" else "TPOT", figure * 1000, target_ms,
        )  # fmt: skip
        return True
