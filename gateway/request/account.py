"""The account stage: after every request, whatever happened — metrics, estimator, access log.

Runs in the pipeline's `finally`; it never raises and never awaits, so a cancelled handler still
records what it did.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import IO, Any

import orjson

from gateway.api.usage import read_usage
from gateway.config.schema import PRIORITIES
from gateway.context.ctx import Ctx
from gateway.context.objective import Objective
from gateway.observability.instruments import NONE, Instruments
from gateway.request import attainment
from gateway.request.estimate import OutputEstimator

log = logging.getLogger("gateway.request.account")
MAX_LOGGED_REPLICAS = 1024  # replicas come from the policy and discovery; a bound all the same


class _Series:
    """The labelled children for one (model, pool, class), looked up once and reused."""

    __slots__ = ("_labels", "_metrics", "_queue_wait", "e2e", "input_tokens", "output_tokens",
                 "tpot", "ttft")  # fmt: skip

    def __init__(self, metrics: Instruments, labels: tuple[str, str, str]) -> None:
        self._metrics, self._labels = metrics, labels
        self.e2e = metrics.e2e.labels(*labels)
        self.ttft = metrics.ttft.labels(*labels)
        self.tpot = metrics.tpot.labels(*labels)
        self._queue_wait: list[Any] = [None] * len(PRIORITIES)  # made per tier when first seen
        self.input_tokens = metrics.input_tokens.labels(*labels)
        self.output_tokens = metrics.output_tokens.labels(*labels)

    def queue_wait(self, priority: int) -> Any:
        child = self._queue_wait[priority]
        if child is None:
            child = self._metrics.queue_wait.labels(*self._labels, PRIORITIES[priority])
            self._queue_wait[priority] = child
        return child


def _delivered(ctx: Ctx) -> None:
    """A stream that ended without its final usage (the client left, the stream broke): its
    output is the running count of the last chunk relayed (gateway/api/openai.py `delivered`),
    if every chunk relayed since the counting began carried one; a chunk after it without one
    is a replica no longer counting, and the request settles on its reservation."""
    if ctx.output_tokens is not None or ctx.delivered is None:
        return
    if ctx.chunks > ctx.delivered_at:
        ctx.delivered, ctx.untrusted_usage = None, "completion_tokens"
        return
    ctx.output_tokens = ctx.delivered


class Accountant:
    def __init__(self, metrics: Instruments, access_log: IO[bytes] | None) -> None:
        self.metrics = metrics
        self.access_log = access_log
        self._series: dict[tuple[str, str, str], _Series] = {}
        self._outcomes: dict[tuple[str, str, str, str, int], Any] = {}
        self._slo: dict[tuple[str, ...], Any] = {}  # llm_slo_requests_total's children
        self._untrusted: set[str] = set()  # replicas whose untrusted usage was logged
        self._flush_due = False

    def _labels(self, ctx: Ctx) -> tuple[str, str, str]:
        if ctx.pool is None:
            return (NONE, NONE, ctx.workload or NONE)
        return (ctx.pool.spec.model, ctx.pool.name, ctx.workload)

    def account(self, ctx: Ctx, estimator: OutputEstimator | None) -> None:
        try:
            self._account(ctx, estimator)
        except Exception:  # accounting must never turn a served request into an error
            log.exception("accounting failed for %s", ctx.request_id)

    def _account(self, ctx: Ctx, estimator: OutputEstimator | None) -> None:
        ctx.ended = time.perf_counter()
        read_usage(ctx)  # a whole answer's, decoded here: after the client has the answer
        labels = self._labels(ctx)
        key = (*labels, ctx.endpoint, ctx.status)
        outcome = self._outcomes.get(key)
        if outcome is None:  # endpoints and statuses come from small sets: children are kept
            outcome = self._outcomes[key] = self.metrics.requests.labels(
                *labels, ctx.endpoint, str(ctx.status)
            )
        outcome.inc()
        if ctx.adapter and ctx.pool is not None:  # set only for an adapter the catalog knows
            adapter = self.metrics.adapter_label(ctx.adapter)
            self.metrics.adapter_requests.labels(ctx.pool.name, adapter, str(ctx.status)).inc()
        if ctx.refused and ctx.refusal is not None:
            # A client that leaves was not refused: it is in `llm_requests_total{code="499"}`.
            self.metrics.rejections.labels(labels[1], ctx.refusal.label).inc()
        if ctx.admitted and ctx.pool is not None:
            _delivered(ctx)
            self._bound_usage(ctx, ctx.pool.model.spec.max_model_len)
            # Read before the fallbacks below fill the output in from the relayed chunks.
            ctx.usage_believed = ctx.output_tokens is not None and not ctx.untrusted_usage
        if ctx.output_tokens is None and ctx.chunks and ctx.stream:
            # The stream broke or the client left before the usage chunk, and no believed
            # running count says what was sent: count the chunks.
            ctx.output_tokens = ctx.chunks
        if ctx.queued:
            self._observe(ctx, labels, estimator)
        objective = ctx.objective
        if objective is not None and ctx.pool is not None:
            self._attainment(ctx, ctx.pool.name, objective)
        if self.access_log is not None:
            record = self.record(ctx)
            if objective is not None:
                record.update(attainment.logged(ctx, objective))
            self.access_log.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
            if not self._flush_due:  # one write(2) a loop turn, whatever ended in it
                self._flush_due = True
                asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """The access log's buffered lines out: at the end of the loop turn a request ended in,
        so a line is out within the turn, at one system call for all the turn's requests."""
        self._flush_due = False
        if self.access_log is not None:
            self.access_log.flush()

    def _bound_usage(self, ctx: Ctx, max_model_len: int) -> None:
        """A replica's usage is input too: a count it could not have made (over the request's
        `max_tokens` or the context, per sequence), a prompt count far from the gateway's own
        exact one, or no count at all is not settled as given. The prompt falls back to the
        gateway's own count; the output to the chunks a stream relayed, else to what was
        reserved for it. Counted per replica, logged once per one.

        Where the gateway's count is vLLM's own (a tokenizer, no image a processor expands), a
        template's difference moves the replica's by a few tokens; under half or over twice it
        is a replica undercharging or overcharging the tenant."""
        assert ctx.pool is not None
        prompt, counted = ctx.prompt_tokens, ctx.input_tokens
        exact = ctx.pool.model.counter.exact and ctx.api.exact and not ctx.images
        if prompt is not None and (
            prompt > max_model_len * ctx.sequences
            or (exact and (2 * prompt < counted or prompt > 2 * counted))
        ):
            ctx.prompt_tokens, ctx.untrusted_usage = None, "prompt_tokens"
        if ctx.cached_tokens is not None and ctx.cached_tokens > (ctx.prompt_tokens or counted):
            ctx.cached_tokens, ctx.untrusted_usage = None, "cached_tokens"
        most = ctx.most_output(max_model_len)
        if ctx.output_tokens is not None and ctx.output_tokens > most and not ctx.output_counted:
            ctx.output_tokens, ctx.untrusted_usage = None, "completion_tokens"
        if not ctx.untrusted_usage:
            return
        if ctx.output_tokens is None and not (ctx.stream and ctx.chunks):
            ctx.output_tokens = min(ctx.expected_output * ctx.sequences, most)
        self.metrics.untrusted_usage.labels(ctx.pool.name, ctx.replica, ctx.untrusted_usage).inc()
        if ctx.replica not in self._untrusted:
            if len(self._untrusted) >= MAX_LOGGED_REPLICAS:
                self._untrusted.clear()
            self._untrusted.add(ctx.replica)
            log.warning(
                "replica %s reported a usage %s that is not a count this request could make;"
                " settled on the gateway's own numbers (counted in llm_untrusted_usage_total)",
                ctx.replica, ctx.untrusted_usage,
            )  # fmt: skip

    def _observe(
        self, ctx: Ctx, labels: tuple[str, str, str], estimator: OutputEstimator | None
    ) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = _Series(self.metrics, labels)
        assert ctx.queue_wait is not None
        trace = ctx.trace.trace_id if ctx.trace is not None else None  # the exemplars'
        series.queue_wait(ctx.priority).observe(ctx.queue_wait, trace)
        if not ctx.admitted:  # it waited, then timed out or left
            return
        series.e2e.observe(ctx.ended - ctx.arrived, trace)
        series.input_tokens.inc(ctx.input_tokens)
        if ctx.output_tokens:
            series.output_tokens.inc(ctx.output_tokens)
        if ctx.tenant is not None:  # the configured name: label values bounded by the policy
            self.metrics.tenant_tokens.labels(ctx.tenant.name, "input").inc(ctx.input_tokens)
            self.metrics.tenant_tokens.labels(ctx.tenant.name, "output").inc(ctx.output_tokens or 0)
            if ctx.cached_tokens:
                tenant_cached = self.metrics.tenant_tokens.labels(ctx.tenant.name, "cached_input")
                tenant_cached.inc(ctx.cached_tokens)
        if ctx.first_token is not None:
            series.ttft.observe(ctx.first_token - ctx.arrived, trace)
            if (tpot := attainment.observed_tpot(ctx)) is not None:
                series.tpot.observe(tpot, trace)
        # Only a whole answer teaches the estimator: one cut short (preempted, broken) would
        # teach it its requests' answers are shorter than they are.
        if (
            estimator is not None
            and ctx.status == 200
            and ctx.refusal is None
            and ctx.output_tokens
        ):
            estimator.observe(estimator.key(ctx), ctx.output_tokens // ctx.sequences)

    def _attainment(self, ctx: Ctx, pool: str, objective: Objective) -> None:
        """Whether the request met each objective it had (`gateway/request/attainment.py`),
        and the headroom predicted for it where it was granted."""
        tier = PRIORITIES[ctx.priority]
        for name, outcome in attainment.outcomes(ctx, objective):
            key = (pool, tier, name, outcome)
            child = self._slo.get(key)
            if child is None:
                child = self._slo[key] = self.metrics.slo_requests.labels(*key)
            child.inc()
        if ctx.predicted is not None:
            prediction = attainment.from_arrival(ctx, ctx.predicted)
            for name, headroom in attainment.headroom(objective, prediction):
                self.metrics.slo_headroom.labels(pool, name).observe(headroom)

    @staticmethod
    def record(ctx: Ctx) -> dict[str, Any]:
        arrived, first = ctx.arrived, ctx.first_token
        return {
            "ts": time.time(),
            "request_id": ctx.request_id,
            "upstream_request_id": ctx.upstream_id or None,
            "tenant": ctx.tenant.name if ctx.tenant else None,
            "endpoint": ctx.endpoint,
            "model": ctx.requested_model,
            "served_model": ctx.served_model or None,
            "adapter": ctx.adapter or None,
            "pool": ctx.pool.name if ctx.pool else None,
            "spilled_from": ctx.spilled_from or None,
            "replica": ctx.replica or None,
            "retries": ctx.retries,
            "class": ctx.workload or None,
            "stream": ctx.stream,
            "input_tokens": ctx.input_tokens,
            "expected_output_tokens": ctx.expected_output,
            "estimate_source": ctx.estimate_source or None,
            "output_tokens": ctx.output_tokens,
            "cached_tokens": ctx.cached_tokens,
            "queue_wait_s": None if ctx.queue_wait is None else round(ctx.queue_wait, 6),
            "ttft_s": None if first is None else round(first - arrived, 6),
            "e2e_s": round(ctx.ended - arrived, 6),  # set by `_account` before the record
            "status": ctx.status,
            # The code the client saw, so a log line matches its error body: the refusal's
            # name, or a `BadRequest`'s detail; a client that left got none, and is logged
            # `client_disconnect`.
            "reason": ctx.code or ctx.refusal or None,
        }


def stdout_log() -> IO[bytes]:
    return sys.stdout.buffer
