"""A request's latency objective and the latency predicted for it where it was placed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from gateway.config.schema import PRIORITIES, PoolSloSpec, SloSpec


class Objective(NamedTuple):
    """What the request is promised: seconds to its first token and per output token after it
    (`math.inf`: not asked), and the deadline its first token is due by (`time.perf_counter`),
    the key of its queue's deadline order."""

    ttft_s: float
    tpot_s: float
    deadline: float


class Prediction(NamedTuple):
    """The latency model's word for a request on one replica (gateway/admit/latency.py)."""

    ttft_s: float
    tpot_s: float

    def headroom(self, objective: Objective, now: float) -> float:
        """The smaller margin left of the two objectives at `now`, each a fraction of itself:
        positive, the request is predicted to meet both; else its worse predicted miss."""
        ttft = tpot = 1.0
        if objective.ttft_s != math.inf:
            ttft = (objective.deadline - now - self.ttft_s) / objective.ttft_s
        if objective.tpot_s != math.inf:
            tpot = 1.0 - self.tpot_s / objective.tpot_s
        return min(ttft, tpot)


Bound = tuple[float | None, float | None]  # (ttft_s, tpot_s) a source states; None: not stated


def seconds(spec: SloSpec | None) -> Bound:
    if spec is None:
        return (None, None)
    return (
        None if spec.ttft_ms is None else spec.ttft_ms / 1000,
        None if spec.tpot_ms is None else spec.tpot_ms / 1000,
    )


class Defaults:
    """A pool's objectives where the request states none, compiled once: by class and by tier
    (index into PRIORITIES); a tenant's own are on its record."""

    __slots__ = ("by_class", "by_tier", "headers")

    def __init__(self, spec: PoolSloSpec, classes: Mapping[str, SloSpec | None]) -> None:
        self.headers = spec.headers
        self.by_tier = tuple(seconds(spec.objectives.get(tier)) for tier in PRIORITIES)  # type: ignore[call-overload]
        self.by_class = {name: seconds(slo) for name, slo in classes.items() if slo is not None}
