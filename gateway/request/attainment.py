"""What a request's latency objective came to: what was predicted for it where it was granted
(its response headers, the access log, `llm_slo_predicted_headroom`) and what was observed when
it ended (`llm_slo_requests_total`).

Read only for a request with `ctx.objective` (a pool with `slo`): a request without one costs
the test of that field and nothing else.

A prediction is reported from the request's arrival, as its objective and its observed TTFT
are: the wait before its grant plus the latency model's TTFT from the grant
(gateway/admit/latency.py predicts from there). So `predicted_ttft_s - ttft_s` in the access
log is the model's own error, the wait being known exactly.

An objective is met or missed as observed: TTFT on a stream (its first token, or the end of a
stream whose deadline passed without one), TPOT on an answer of two tokens or more, as the
latency histograms measure them. A request the pool had no room for (a refusal counted as
demand: `queue_full`, `shed`, `queue_timeout`, `queue_wait_too_long`, `slo_unreachable`,
`preempted`) is `refused` on each objective it had, so attainment reads with refusals
(met / all) or without (met / (met + missed)). Anything else (a non-stream's TTFT, a client's
own error) says nothing of the objective and is not counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from gateway.context.ctx import Ctx
from gateway.context.objective import Objective, Prediction

TTFT, TPOT = "ttft", "tpot"
MET, MISSED, REFUSED = "met", "missed", "refused"


def observed_tpot(ctx: Ctx) -> float | None:
    """Seconds per output token after the first, for an answer that streamed two or more."""
    if ctx.first_token is None or not ctx.output_tokens or ctx.output_tokens < 2:
        return None
    return (ctx.ended - ctx.first_token) / (ctx.output_tokens - 1)


def _observed_ttft(ctx: Ctx, objective_s: float) -> float | None:
    if ctx.first_token is not None:
        return ctx.first_token - ctx.arrived
    waited = ctx.ended - ctx.arrived
    # A stream that ended without a first token after its deadline missed it, whatever ended it.
    return waited if ctx.stream and waited > objective_s else None


def outcomes(ctx: Ctx, objective: Objective) -> Iterator[tuple[str, str]]:
    """(objective, outcome) for each objective the request had and that says something."""
    # Refused or, a stream cancelled after its first byte (`preempted`), ended with the refusal:
    # its status is the 200 it began with, so the refusal is read, not `ctx.refused`.
    refused = ctx.refusal is not None and ctx.refusal.counts_as_demand
    for name, objective_s in ((TTFT, objective.ttft_s), (TPOT, objective.tpot_s)):
        if math.isinf(objective_s):
            continue
        if refused:
            yield name, REFUSED
            continue
        seen = _observed_ttft(ctx, objective_s) if name == TTFT else observed_tpot(ctx)
        if seen is not None:
            yield name, MET if seen <= objective_s else MISSED


def from_arrival(ctx: Ctx, predicted: Prediction) -> Prediction:
    """The latency predicted at the grant (`ctx.predicted`), from the request's arrival."""
    return Prediction(ctx.granted - ctx.arrived + predicted.ttft_s, predicted.tpot_s)


def headroom(objective: Objective, prediction: Prediction) -> Iterator[tuple[str, float]]:
    """(objective, (objective - predicted) / objective) for each objective the request had."""
    for name, objective_s, predicted_s in (
        (TTFT, objective.ttft_s, prediction.ttft_s),
        (TPOT, objective.tpot_s, prediction.tpot_s),
    ):
        if not math.isinf(objective_s):
            yield name, (objective_s - predicted_s) / objective_s


def _finite(seconds: float) -> float | None:
    return None if math.isinf(seconds) else round(seconds, 6)


def logged(ctx: Ctx, objective: Objective) -> dict[str, float | None]:
    """The access log's fields: the objective applied and the prediction at the grant."""
    prediction = None if ctx.predicted is None else from_arrival(ctx, ctx.predicted)
    return {
        "slo_ttft_s": _finite(objective.ttft_s),
        "slo_tpot_s": _finite(objective.tpot_s),
        "predicted_ttft_s": None if prediction is None else round(prediction.ttft_s, 6),
        "predicted_tpot_s": None if prediction is None else round(prediction.tpot_s, 6),
    }


def _ms(seconds: float) -> str:
    return f"{round(seconds * 1000, 1):g}"


def response_headers(ctx: Ctx, objective: Objective) -> dict[str, str]:
    """The objective applied, in milliseconds, and with a prediction, the predicted latency and
    whether it meets both objectives (`met`) or not (`at-risk`)."""
    out = {}
    if not math.isinf(objective.ttft_s):
        out["x-gateway-slo-ttft-ms"] = _ms(objective.ttft_s)
    if not math.isinf(objective.tpot_s):
        out["x-gateway-slo-tpot-ms"] = _ms(objective.tpot_s)
    if ctx.predicted is not None:
        prediction = from_arrival(ctx, ctx.predicted)
        out["x-gateway-predicted-ttft-ms"] = _ms(prediction.ttft_s)
        out["x-gateway-predicted-tpot-ms"] = _ms(prediction.tpot_s)
        met = ctx.predicted.headroom(objective, ctx.granted) >= 0  # placement's own reading
        out["x-gateway-slo"] = "met" if met else "at-risk"
    return out
