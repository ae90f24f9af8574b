"""How fast a pool drains: hold times, for the fail-fast prediction, and demand, for the HPA."""

from __future__ import annotations

import math
import time
from collections import deque

from gateway.admit.forecast import Holt
from gateway.config.schema import ForecastSpec


class HoldTimes:
    """How long the pool's last `SIZE` slots were held: by Little's law the queue drains at the
    slots in use over their mean hold time, which is what a wait is predicted from."""

    SIZE = 256
    MIN_SAMPLES = 20  # fewer: not enough history to refuse anybody early

    def __init__(self) -> None:
        self._ring: deque[float] = deque(maxlen=self.SIZE)
        self._sum = 0.0
        self._squares = 0.0

    def add(self, seconds: float) -> None:
        ring = self._ring
        if len(ring) == self.SIZE:
            old = ring[0]
            self._sum -= old
            self._squares -= old * old
        ring.append(seconds)
        self._sum += seconds
        self._squares += seconds * seconds

    def mean(self) -> tuple[float, float] | None:
        """The mean hold time and a confident lower bound of it (three standard errors below);
        None without enough history."""
        n = len(self._ring)
        if n < self.MIN_SAMPLES:
            return None
        mean = self._sum / n
        variance = max(0.0, self._squares / n - mean * mean)
        return mean, max(0.0, mean - 3 * math.sqrt(variance / n))


class Demand:
    """The cluster-level signal: how many replicas this pool's traffic needs, smoothed.

    By Little's law the slots in use on average are busy seconds per second; waiting and refused
    requests are demand too (a refused one would have held a slot for the mean hold time). Their
    sum over the per-replica cap in force (`LivePool.replica_cap`) is `llm_pool_desired_replicas`, which an HPA can target. The same
    sum, forecast `startup_s` ahead (forecast.py), is `llm_pool_desired_replicas_forecast`.
    """

    SMOOTHING = 0.2  # weight of the newest tick in the moving average

    def __init__(self) -> None:
        self.arrivals = 0
        self.refused = 0
        self.busy_s = 0.0
        self.queued_s = 0.0
        self.desired_replicas = 0.0
        self.desired_replicas_forecast = 0.0
        self._forecast = Holt()
        self._last: tuple[float, int, int, float, float] | None = None

    def retune(self, params: ForecastSpec) -> None:
        """New forecast constants from a policy reload; what was learned carries over."""
        self._forecast.params = params

    def tick(self, cap: float, startup_s: float) -> None:
        now = time.perf_counter()
        if self._last is not None:
            then, arrivals, refused, busy_s, queued_s = self._last
            dt = now - then
            if dt > 0:
                served = max(1, (self.arrivals - arrivals) - (self.refused - refused))
                hold_s = (self.busy_s - busy_s) / served
                slots = (self.busy_s - busy_s + self.queued_s - queued_s) / dt + (
                    self.refused - refused
                ) * hold_s / dt
                self.desired_replicas += self.SMOOTHING * (slots / cap - self.desired_replicas)
                self._forecast.add(slots, dt)  # unsmoothed: Holt smooths by time, not by tick
                # The ceiling holds against the demand measured now as well as the level: when
                # demand falls faster than the level follows (a burst ended), the forecast
                # falls with it, instead of asking for replicas after the need has gone.
                ceiling = self._forecast.params.ceiling * self.desired_replicas
                forecast = self._forecast.ahead(startup_s) / cap
                self.desired_replicas_forecast = min(forecast, ceiling)
        self._last = (now, self.arrivals, self.refused, self.busy_s, self.queued_s)
