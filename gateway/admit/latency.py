"""Each replica's latency model: the TTFT and TPOT a request would see there, learned online.

A pool with `slo` predicts, for every replica a request may take, its time to first token and
per output token, from the work the request would join there:

- TTFT (from the grant): a base, plus the prefill ahead of its first token (the uncached prompt
  tokens of the requests granted there that have not produced theirs, and its own uncached
  tokens, from the picker's prefix view), plus the sequences decoding there, whose steps the
  prefill shares (vLLM's chunked prefill);
- TPOT: a base, plus the decode batch it joins (the sequences running there, itself included),
  plus the context those sequences hold (decode is memory-bound: each step reads their KV).

Both are linear in their features and fitted by recursive least squares with a forgetting
factor, one fit per replica (a replica of another build, or one its neighbours' traffic slows,
learns its own) started from the pool's fit, which learns from them all and starts from the
policy's seed (`slo.model`). A prediction is three multiplications; a sample a 3x3 update. What
the gateway measures trains it: a stream's first token (TTFT, from the grant, so the gateway's
own queue is not in it) and its TPOT when it ends. A non-streamed answer shows no first token:
its prompt counts as prefill until its predicted TTFT has passed, and it trains nothing.

Other gateways' and direct clients' requests on a replica (`Replica.others`, from its /metrics)
count as decoding: the gateway cannot see their phase.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from typing import TYPE_CHECKING

from gateway.config.schema import LatencyModelSpec
from gateway.context.objective import Prediction

if TYPE_CHECKING:
    from gateway.admit.claim import Claim
    from gateway.admit.replica import Replica

Features = tuple[float, float, float]
_PER_1K = 1e-3  # token features are in thousands of tokens
_PER_100 = 1e-2  # sequence counts in hundreds: every feature of the order of one
_PRIOR = 1.0  # the seed's variance, in the features' units: a few samples move it
_LEAST_S = 1e-3  # the smallest prediction an outlier bound is taken of
_OWN_FIT_AFTER = 16  # samples before a replica's own fit is trusted over the pool's
_PREFILLING, _DECODING, _DONE = 0, 1, 2


class Fit:
    """y ≈ θ·x over three features, by recursive least squares with forgetting, θ kept ≥ 0
    (no load makes a replica faster).

    Forgetting grows the uncertainty of every direction at each sample, and only samples that
    vary along a direction bring it back down: a feature that stays put (nothing decoding on a
    replica served one request at a time, prompts all of one length) would wind its variance
    up without end, until one sample set the whole coefficient to its noise and, later, the
    variance overflowed and the fit fell to 0 for good. So no direction is ever less certain
    than the seed was (`_PRIOR`): its row and column are scaled back, which keeps P positive
    definite and leaves the directions samples do excite as they were. And P is updated as the
    symmetric matrix it is: the update adds nothing to an asymmetry rounding leaves, and
    forgetting multiplies it by 1/λ every sample, so at the default λ the fit diverged (θ to
    infinity, predictions to NaN) within thousands of samples."""

    __slots__ = ("forgetting", "p", "samples", "theta")

    def __init__(self, theta: Features, forgetting: float) -> None:
        self.theta = list(theta)
        self.p = [[_PRIOR if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.forgetting = forgetting
        self.samples = 0

    def predict(self, x: Features) -> float:
        t = self.theta
        return t[0] * x[0] + t[1] * x[1] + t[2] * x[2]

    def observe(self, x: Features, y: float) -> None:
        p, lam = self.p, self.forgetting
        px = [p[i][0] * x[0] + p[i][1] * x[1] + p[i][2] * x[2] for i in range(3)]
        denominator = lam + x[0] * px[0] + x[1] * px[1] + x[2] * px[2]
        gain = [v / denominator for v in px]
        predicted = self.predict(x)
        # A stall (another request's long prefill sharing the steps) is one sample, not a new
        # law: it moves the fit at most as a sample three times the prediction would.
        bound = 2.0 * max(predicted, _LEAST_S)
        error = max(-bound, min(y - predicted, bound))
        theta = self.theta
        for i in range(3):
            theta[i] = max(0.0, theta[i] + gain[i] * error)
        for i in range(3):  # P stays exactly symmetric: rounding's asymmetry grows by 1/λ a step
            row = p[i]
            for j in range(i, 3):
                row[j] = p[j][i] = (row[j] - gain[i] * px[j]) / lam
        for i in range(3):
            if p[i][i] > _PRIOR:
                scale = math.sqrt(_PRIOR / p[i][i])
                for j in range(3):
                    p[i][j] *= scale
                    p[j][i] *= scale
        self.samples += 1


class Flight:
    """One request on its replica, from its grant to its release: its prefill in the replica's
    sum until its first token (`prefilled`, called by the forward stage) or, for an answer that
    shows none, its predicted TTFT; and the features its samples are taken against."""

    __slots__ = ("granted", "replica", "state", "tokens", "tpot_x", "ttft_x")

    def __init__(
        self, replica: ReplicaLatency, tokens: int, ttft_x: Features, granted: float
    ) -> None:
        self.replica = replica
        self.tokens = tokens  # its uncached prompt tokens
        self.ttft_x = ttft_x
        self.tpot_x: Features | None = None  # the batch it joined at its first token
        self.granted = granted
        self.state = _PREFILLING

    def prefilled(self, at: float) -> None:
        """Its first token arrived (a stream's, at `at`): a TTFT sample, and it now decodes."""
        replica = self.replica
        if self.state != _PREFILLING:
            return
        replica.to_decoding(self)
        self.tpot_x = replica.tpot_features(0, 0)  # itself in the batch and its context now
        replica.model.observe_ttft(replica, self.ttft_x, at - self.granted)


class ReplicaLatency:
    """A replica's prefill and decode work as this gateway placed it, and its own fits."""

    __slots__ = ("decoding", "model", "pending", "prefill_tokens", "replica", "tpot", "ttft")

    def __init__(self, model: LatencyModel, replica: Replica) -> None:
        self.model = model
        self.replica = replica
        self.prefill_tokens = 0
        self.decoding = 0
        # Non-streamed flights, by when their prefill is presumed done.
        self.pending: list[tuple[float, int, Flight]] = []
        self.ttft = Fit(tuple(model.ttft.theta), model.forgetting)  # type: ignore[arg-type]
        self.tpot = Fit(tuple(model.tpot.theta), model.forgetting)  # type: ignore[arg-type]

    def to_decoding(self, flight: Flight) -> None:
        flight.state = _DECODING
        self.prefill_tokens -= flight.tokens
        self.decoding += 1

    def settle(self, now: float) -> None:
        """Non-streamed flights past their predicted TTFT decode now."""
        pending = self.pending
        while pending and pending[0][0] <= now:
            flight = heapq.heappop(pending)[2]
            if flight.state == _PREFILLING:
                self.to_decoding(flight)

    def ttft_features(self, own: int) -> Features:
        running = self.decoding + self.replica.others
        return (1.0, (self.prefill_tokens + own) * _PER_1K, running * _PER_100)

    def tpot_features(self, joining: int, tokens: int) -> Features:
        """The decode batch and its context, with `joining` sequences and `tokens` not yet
        counted in them."""
        replica = self.replica
        batch = self.decoding + replica.others + joining
        context = replica.inflight_tokens + tokens
        return (1.0, batch * _PER_100, context * _PER_1K)

    def fits(self) -> tuple[Fit, Fit]:
        model = self.model
        ttft = self.ttft if self.ttft.samples >= _OWN_FIT_AFTER else model.ttft
        tpot = self.tpot if self.tpot.samples >= _OWN_FIT_AFTER else model.tpot
        return ttft, tpot


class LatencyModel:
    """One pool's latency model: its replicas' fits and what runs on them."""

    def __init__(self, spec: LatencyModelSpec) -> None:
        self.seed = spec
        self.forgetting = spec.forgetting
        ms = 1e-3
        self.ttft = Fit(
            (
                spec.ttft_base_ms * ms,
                spec.ttft_per_1k_prefill_ms * ms,
                spec.ttft_per_running_ms * ms / _PER_100,
            ),
            spec.forgetting,
        )
        self.tpot = Fit(
            (
                spec.tpot_base_ms * ms,
                spec.tpot_per_running_ms * ms / _PER_100,
                spec.tpot_per_1k_context_ms * ms,
            ),
            spec.forgetting,
        )
        self._seq = itertools.count()

    def of(self, replica: Replica) -> ReplicaLatency:
        state = replica.latency
        if state is None or state.model is not self:
            state = replica.latency = ReplicaLatency(self, replica)
        return state

    def predict(self, replica: Replica, claim: Claim, cached: float) -> Prediction:
        """The latency `claim` would see on `replica`, were it granted there now; `cached`: the
        share of its prompt the replica's prefix cache holds."""
        state = self.of(replica)
        state.settle(time.perf_counter())
        ttft, tpot = state.fits()
        own = round(claim.input_tokens * (1.0 - cached))
        return Prediction(
            ttft.predict(state.ttft_features(own)),
            tpot.predict(state.tpot_features(1, claim.tokens)),
        )

    def admitted(
        self, replica: Replica, claim: Claim, cached: float, stream: bool
    ) -> tuple[Flight, Prediction]:
        """`claim` was granted on `replica` (already counted in its `inflight`): its flight, and
        what was predicted for it there."""
        state = self.of(replica)
        now = time.perf_counter()
        state.settle(now)
        ttft_fit, tpot_fit = state.fits()
        own = round(claim.input_tokens * (1.0 - cached))
        x = state.ttft_features(own)
        # Taken already (its tokens in the replica's), not yet decoding.
        predicted = Prediction(ttft_fit.predict(x), tpot_fit.predict(state.tpot_features(1, 0)))
        flight = Flight(state, own, x, now)
        state.prefill_tokens += own
        if not stream:  # no first token to see: its prefill ends when predicted
            heapq.heappush(state.pending, (now + predicted.ttft_s, next(self._seq), flight))
        return flight, predicted

    def released(self, flight: Flight) -> None:
        state = flight.replica
        if flight.state == _PREFILLING:
            state.prefill_tokens -= flight.tokens
        elif flight.state == _DECODING:
            state.decoding -= 1
        flight.state = _DONE

    def observe_ttft(self, state: ReplicaLatency, x: Features, ttft_s: float) -> None:
        state.ttft.observe(x, ttft_s)
        self.ttft.observe(x, ttft_s)

    def observe_tpot(self, flight: Flight, tpot_s: float) -> None:
        if flight.tpot_x is None:
            return
        flight.replica.tpot.observe(flight.tpot_x, tpot_s)
        self.tpot.observe(flight.tpot_x, tpot_s)
