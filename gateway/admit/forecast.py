"""Demand ahead of time: where a pool's slot demand will be once a replica started now can serve.

A TPU replica takes minutes to come up (`startup_s`), so a reactive signal asks for capacity one
startup too late on every ramp. The forecast extrapolates the slot-seconds per second that
`Demand` measures to now + `startup_s`.

Why Holt's linear trend (double exponential smoothing): demand ramps (a morning, a batch job
starting) are locally linear over minutes, and Holt is the simplest model that has a trend at
all; it is two numbers updated in O(1) a tick, and its forecast, level + trend x horizon (the
horizon shortened by the damping below), can be read off a dashboard and checked by hand.
Seasonal models need days of history the gateway does not keep, and a restart would lose it.

Why damped and capped: a trend measured over a few minutes says little about the tenth minute
ahead, so the trend is assumed to fade with time constant `damping_s` over the horizon. And the
trend misreads a step (a tenant switched on, an idle pool woken) as a steep ramp until the level
catches up, worst from a level near zero. The forecast is therefore capped at `ceiling` x the
current level (1.5 by default): it may ask for at most half as much again as is measured. The
same ceiling holds against the reactive estimate (`Demand.tick`): after a burst the level takes
a minute or more to fall and the trend still rises, so the forecast kept climbing while the
measured demand had already collapsed, and, the HPA following the larger of the two, bought
replicas after the need was gone; capped by what is measured now it falls with the burst. A ramp steeper than
+50% per startup is rare, and what it exceeds the reactive signal still catches; a misread
cannot buy more than half the pool again in accelerators. It is never negative. What the
forecast may not do is ask for less than the reactive signal: that floor is applied where the
two meet (the HPA takes the larger of its metrics), not here.

The smoothing weights come from time constants in seconds, not per tick, because the tick is the
shortest of the pool's health intervals and changes with the policy.
"""

from __future__ import annotations

import math

from gateway.config.schema import ForecastSpec

DEFAULT = ForecastSpec()  # the policy's defaults: a pool's `forecast` unset


class Holt:
    """Holt's level and trend of one series sampled at irregular intervals."""

    def __init__(self, params: ForecastSpec = DEFAULT) -> None:
        self.params = params  # a policy reload may replace them; level and trend carry over
        self.level: float | None = None
        self.trend = 0.0  # per second

    def add(self, value: float, dt: float) -> None:
        """The series' value over the last `dt` seconds."""
        if self.level is None:
            self.level = value
            return
        alpha = 1 - math.exp(-dt / self.params.level_s)
        beta = 1 - math.exp(-dt / self.params.trend_s)
        predicted = self.level + self.trend * dt
        level = predicted + alpha * (value - predicted)
        if level <= 0:  # a drained pool: a falling trend would dig below nothing and stay there
            self.level, self.trend = 0.0, 0.0
            return
        self.trend += beta * ((level - self.level) / dt - self.trend)
        self.level = level

    def ahead(self, horizon_s: float) -> float:
        """The value forecast `horizon_s` from now: the level plus the damped trend's integral,
        within [0, ceiling x level]."""
        if self.level is None:
            return 0.0
        damping_s = self.params.damping_s
        rise = self.trend * damping_s * (1 - math.exp(-horizon_s / damping_s))
        return min(max(0.0, self.level + rise), self.params.ceiling * self.level)
