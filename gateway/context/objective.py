"""A request's latency objective and the latency predicted for it where it was placed."""

from __future__ import annotations

from typing import NamedTuple


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

    def headroom(self, objective: Objective, waited_s: float = 0.0) -> float:
        """The smaller margin of the two objectives, each as a fraction of itself: positive,
        the request is predicted to meet both; the most negative miss otherwise."""
        ttft = 1.0 - (waited_s + self.ttft_s) / objective.ttft_s
        tpot = 1.0 - self.tpot_s / objective.tpot_s
        return min(ttft, tpot)
