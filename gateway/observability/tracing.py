"""OpenTelemetry traces: one server span per request, its stages' spans, and the replica's.

A request's span continues the client's W3C `traceparent` (and `tracestate`); its children are
the stages that take time: `count` (the prompt counted, classified and routed), `queue` (the wait
for a slot), `upstream` (from sending to the replica until its answer's head: the span whose
context the replica gets, so vLLM's own spans, with `--otlp-traces-endpoint`, are its children)
and, for a stream, `stream` (from the head to the last byte). The attributes are OpenTelemetry's
GenAI semantic conventions (`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...) and the
gateway's own under `llm_gateway.` (class, pool, replica, tier, tenant name, spill, refusal):
never a key, never a prompt.

Only the server span and the upstream span live while the request runs (the upstream one must
exist before the request is sent, to be propagated); the others are made at the end from the
times the stages already record, so a traced request costs a few spans, one the sampler leaves
out only its sampling decision, and without `tracing` in the policy nothing (`ctx.trace` None). Export is the SDK's batch processor on its
own thread, over OTLP/HTTP; sampling is parent-based with the policy's ratio for new traces.

Closing (a reload that changes `tracing`, the gateway's stop) exports what is left for at most
`CLOSE_S`: a collector that accepts and never answers would otherwise hold it for the SDK's own
30 s, the reload lock or the whole drain with it. Past the bound the spans are dropped (a
WARNING says so) and the SDK's daemon threads are left to end on their own, with the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config.schema import PRIORITIES

if TYPE_CHECKING:
    from multidict import CIMultiDict, CIMultiDictProxy

    from gateway.config.schema import TracingSpec

# `gen_ai.operation.name` by endpoint; the pooling endpoints keep their own names.
_OPERATIONS = {
    "chat": "chat", "completions": "text_completion", "messages": "chat", "responses": "chat",
    "embeddings": "embeddings",
}  # fmt: skip
_PROPAGATOR = TraceContextTextMapPropagator()
CLOSE_S = 2.0  # the longest closing waits for the last spans to be exported

log = logging.getLogger("gateway.observability.tracing")


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class _Endpoint(Protocol):
    @property
    def path(self) -> str: ...


class Traced(Protocol):
    """What a trace reads of its request: the pipeline's `Ctx`, named here so that tracing, which
    every stage may reach, imports none of them."""

    headers: CIMultiDictProxy[str]
    arrived: float
    request_id: str
    requested_model: str
    stream: bool
    priority: int
    max_output: int | None
    input_tokens: int
    expected_output: int
    workload: str
    spilled_from: str
    replica: str
    retries: int
    queue_wait: float | None
    output_tokens: int | None
    prompt_tokens: int | None
    cached_tokens: int | None
    counted: tuple[float, float] | None
    granted: float
    status: int
    code: str
    ended: float

    @property
    def api(self) -> _Endpoint: ...

    @property
    def tenant(self) -> _Named | None: ...

    @property
    def pool(self) -> _Named | None: ...

    @property
    def refusal(self) -> object: ...

    @property
    def endpoint(self) -> str: ...

    @property
    def served_model(self) -> str: ...

    @property
    def refused(self) -> bool: ...


class Tracing:
    """The policy's tracing: a tracer provider exporting to its endpoint."""

    def __init__(self, spec: TracingSpec) -> None:
        self.spec = spec
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": spec.service_name}),
            sampler=ParentBased(TraceIdRatioBased(spec.sample_ratio)),
        )
        exporter = OTLPSpanExporter(endpoint=spec.endpoint, timeout=spec.timeout_s)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self._provider.get_tracer("llm-admission-gateway")

    def begin(self, ctx: Traced, method: str) -> RequestTrace | None:
        """The request's server span, a child of the client's `traceparent` if it sent one;
        None when the sampler leaves it out: then nothing more is made for it, and a client's
        `traceparent` goes to the replica as it came, its decision with it."""
        parent = _PROPAGATOR.extract(ctx.headers)
        wall = time.time_ns() - int((time.perf_counter() - ctx.arrived) * 1e9)
        span = self.tracer.start_span(
            f"{method} {ctx.api.path}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=wall,
            attributes={"http.request.method": method, "http.route": ctx.api.path},
        )
        return RequestTrace(self, span, wall, ctx.arrived) if span.is_recording() else None

    async def close(self) -> None:
        """Export what is left and stop, waiting `CLOSE_S` at most. The SDK's shutdown blocks
        until its exporter answers: it runs on a daemon thread of its own, not the default
        executor's, which `asyncio.run` waits on at exit."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def shutdown() -> None:
            try:
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(finished)

        threading.Thread(target=shutdown, name="tracing-close", daemon=True).start()
        try:
            await asyncio.wait_for(done, CLOSE_S)
        except TimeoutError:
            log.warning(
                "trace collector %s took no spans within %ss: the last ones are dropped",
                self.spec.endpoint,
                CLOSE_S,
            )


class RequestTrace:
    """One request's spans (`ctx.trace`)."""

    __slots__ = ("_context", "_perf", "_tracing", "_wall", "head", "span", "upstream")

    def __init__(self, tracing: Tracing, span: Span, wall_ns: int, perf: float) -> None:
        self._tracing, self.span, self._wall, self._perf = tracing, span, wall_ns, perf
        self._context: Context = set_span_in_context(span)
        self.upstream: Span | None = None
        self.head = 0.0  # perf_counter when the replica's answer began

    @property
    def trace_id(self) -> str:
        """The trace's id in hex: what an exemplar carries."""
        return format(self.span.get_span_context().trace_id, "032x")

    def _at(self, perf: float) -> int:
        return self._wall + int((perf - self._perf) * 1e9)

    def _stage(self, name: str, start: float, end: float, **attributes: Any) -> None:
        span = self._tracing.tracer.start_span(
            name, context=self._context, start_time=self._at(start), attributes=attributes
        )
        span.end(end_time=self._at(end))

    def sending(self, replica: str, headers: CIMultiDict[str]) -> None:
        """The upstream span begins (an attempt before it that failed ends); its context goes
        to the replica in `headers`."""
        self.answered(None)
        self.upstream = self._tracing.tracer.start_span(
            "upstream",
            context=self._context,
            kind=SpanKind.CLIENT,
            attributes={"server.address": replica},
        )
        _PROPAGATOR.inject(headers, context=set_span_in_context(self.upstream))

    def answered(self, status: int | None) -> None:
        """The replica's answer began (`status`), or it failed before one (None)."""
        if self.upstream is None:
            return
        if status is None or status >= 500:
            self.upstream.set_status(Status(StatusCode.ERROR))
        if status is not None:
            self.upstream.set_attribute("http.response.status_code", status)
            self.head = time.perf_counter()
        self.upstream.end()
        self.upstream = None

    def finish(self, ctx: Traced) -> None:
        """The stages' spans from the times they recorded, the request's attributes, the end."""
        self.answered(None)  # an upstream span still open: the request ended without an answer
        if ctx.counted:
            self._stage("count", *ctx.counted, **{"gen_ai.usage.input_tokens": ctx.input_tokens})
        if ctx.queue_wait is not None and ctx.granted:
            self._stage("queue", ctx.granted - ctx.queue_wait, ctx.granted)
        if ctx.stream and self.head:
            self._stage("stream", self.head, ctx.ended)
        span = self.span
        span.set_attributes(_attributes(ctx))
        span.set_attribute("http.response.status_code", ctx.status)
        if ctx.refused or ctx.status >= 500:
            span.set_status(Status(StatusCode.ERROR, ctx.code or None))
        span.end(end_time=self._at(ctx.ended))


def _attributes(ctx: Traced) -> dict[str, Any]:
    """GenAI's conventions and the gateway's own; unset values left out (OTel takes no None)."""
    values: dict[str, Any] = {
        "gen_ai.operation.name": _OPERATIONS.get(ctx.endpoint, ctx.endpoint),
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": ctx.requested_model,
        "gen_ai.response.model": ctx.served_model,
        "gen_ai.request.max_tokens": ctx.max_output,
        "gen_ai.usage.input_tokens": (
            ctx.prompt_tokens if ctx.prompt_tokens is not None else ctx.input_tokens
        ),
        "gen_ai.usage.output_tokens": ctx.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": ctx.cached_tokens,
        "llm_gateway.endpoint": ctx.endpoint,
        "llm_gateway.request_id": ctx.request_id,
        "llm_gateway.input_tokens": ctx.input_tokens,
        "llm_gateway.expected_output_tokens": ctx.expected_output,
        "llm_gateway.class": ctx.workload,
        "llm_gateway.pool": ctx.pool.name if ctx.pool is not None else None,
        "llm_gateway.spilled_from": ctx.spilled_from,
        "llm_gateway.replica": ctx.replica,
        "llm_gateway.retries": ctx.retries,
        "llm_gateway.tier": PRIORITIES[ctx.priority],
        "llm_gateway.tenant": ctx.tenant.name if ctx.tenant is not None else None,
        "llm_gateway.queue_wait_s": ctx.queue_wait,
        "llm_gateway.refusal": ctx.code or (str(ctx.refusal) if ctx.refusal else None),
    }
    return {k: v for k, v in values.items() if v is not None and v != ""}
