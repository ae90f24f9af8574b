"""The forward stage: send the request to the admitted replica and relay the answer untouched
(but its `model`, with `server.response_model: requested`).

Streams are relayed event by event as they arrive: the relay only looks inside an event that
carries `"usage"`, to read the real token counts, to drop the final usage chunk that the gateway
asked for on the client's behalf and to strip the running counts it asked for on every chunk
(`_RUNNING`). What a usage looks like, what the replica must be asked for it
and how a broken stream ends are the endpoint's (`ctx.api`, gateway/api/); finding the events
that carry one, framing and relaying them are the same for all. If the client leaves, the
upstream connection is closed at once: vLLM aborts a generation only when its connection closes.
A request the gateway preempts (gateway/admit/preempt.py) has its exchange ended the same way,
from outside (`ctx.cancel`): before the answer's head its client gets the `preempted` 429, after
it its stream ends with the same code, as a broken stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy, MultiMapping

from gateway.api.usage import USAGE, USAGE_KEY
from gateway.config.schema import PRIORITIES, TimeoutSpec
from gateway.context.ctx import CLIENT_CLOSED, Ctx
from gateway.errors import (
    GatewayError,
    MalformedRequest,
    Preempted,
    Refusal,
    ReplicaRefused,
    ResponseTooLarge,
    TotalTimeout,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.request import attainment
from gateway.request.objective import SLO_HEADERS
from gateway.upstream import Answer, Cancelled, ExchangeError, ExchangeTimeout, Refused, Upstream

log = logging.getLogger("gateway.request.forward")

# Hop-by-hop headers, plus those the gateway recomputes: it re-frames bodies and reads SSE events,
# so it asks for identity encoding and sets its own lengths.
_DROP_REQUEST = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "x-priority",
     "expect",  # the gateway has read the whole body already: a replica's 100 would be noise
     # vLLM takes this header over the body's `priority` (`_get_priority` in
     # vllm/entrypoints/generate/base/serving.py): a client could pick its place in the replica.
     "x-vllm-priority"} | SLO_HEADERS
)  # fmt: skip
_DROP_RESPONSE = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "content-length", "content-encoding", "date", "server"}
)  # fmt: skip
_EVENT_END = b"\n\n"
_MAX_PENDING = 1 << 16  # an SSE event this long without a separator is passed on unparsed
_DATA = b"data: "
_DATA_LINE = b"\n" + _DATA
# A chunk's running usage as vLLM writes it, after the chunk's choices (gateway/api/openai.py
# `delivered`): stripped when the gateway asked for it and the client did not. The final usage
# chunk's follows `"choices":[]` and is not one. Inside a JSON string a quote is escaped, so these
# bytes are only ever a key; each span is bounded (a usage is a few counts, two objects of details
# at most), so a replica's bytes cost a few passes over a run, never one per byte of the run
# after each key. A usage over the bounds reaches the client as the replica wrote it.
_RUNNING = re.compile(
    rb',"usage":\{(?<!"choices":\[\],"usage":\{)'
    rb"[^{}\n]{0,160}+(?:\{[^{}\n]{0,64}+\}[^{}\n]{0,96}+){0,2}+\}"
)
# A `"model"` key and its string value. Inside a JSON string quotes are escaped, so these bytes
# are only ever a key: the top-level one, the only `model` in an answer or a stream's event.
_MODEL_KEY = b'"model"'
_MODEL = re.compile(rb'("model"\s*:\s*)"(?:[^"\\]|\\.)*"')


def client_left(ctx: Ctx) -> None:
    """The client went away: 499 `client_disconnect`, unless its whole answer was written. A
    one-shot client (the OpenAI SDK) closes its connection once it has read `[DONE]`, which can
    be before the replica's stream has ended: it was served, whatever it does after."""
    if not ctx.answered:
        ctx.status, ctx.refusal = CLIENT_CLOSED, Refusal.CLIENT_DISCONNECT


def upstream_priority(ctx: Ctx) -> int | None:
    """vLLM's `priority` for this request, when its pool sends one: the request's tier (0
    critical, 1 standard, 2 sheddable) or the pool's number for it. vLLM runs the lowest first
    (`Request.__lt__` in vllm/v1/request.py orders `PriorityRequestQueue`), as the tiers do."""
    given = ctx.pool.spec.upstream_priority if ctx.pool is not None else False
    if isinstance(given, dict):
        return given[PRIORITIES[ctx.priority]]  # type: ignore[index]
    return ctx.priority if given else None


def upstream_body(ctx: Ctx) -> bytes:
    """The body the replica gets (the endpoint's to encode: `Api.upstream_body`), with what the
    gateway changes: the model when it is rewritten, usage when it must be asked, the output
    bound when it is the gateway's (`Ctx.bounded_by_gateway`), `priority` when the pool sends
    one. Nothing changed: the client's own bytes."""
    changes: dict[str, Any] = {}
    if ctx.requested_model != ctx.upstream_model:
        changes["model"] = ctx.upstream_model
    ctx.api.upstream_fields(ctx, changes)
    if ctx.bounded_by_gateway:  # the output the tenant's window reserved: all it may produce
        assert ctx.api.bound_field is not None
        changes[ctx.api.bound_field] = ctx.max_output
    priority = upstream_priority(ctx)
    if priority is not None:
        changes["priority"] = priority
    return ctx.api.upstream_body(ctx, changes)


@dataclass(frozen=True, slots=True)
class ModelRename:
    """Gives answers back the `model` the client sent (`server.response_model: requested`)."""

    sent: bytes  # `"model":"<what the replica was sent>"`, compact, as vLLM writes it
    renamed: bytes  # the same with the client's name
    wanted: bytes  # the client's name, JSON-encoded

    @classmethod
    def of(cls, ctx: Ctx) -> ModelRename | None:
        """None when there is nothing to rewrite: the replica's name is the one asked for (a
        model's own, an adapter's)."""
        if ctx.requested_model == ctx.upstream_model:
            return None
        wanted = orjson.dumps(ctx.requested_model)
        sent = _MODEL_KEY + b":" + orjson.dumps(ctx.upstream_model)
        return cls(sent, _MODEL_KEY + b":" + wanted, wanted)

    def _value(self, key: re.Match[bytes]) -> bytes:
        return key[1] + self.wanted

    def events(self, run: bytes) -> bytes:
        """Every event of a run of whole SSE events. When each `"model"` in it is the exact bytes
        vLLM writes for the name it was sent, a plain replace does it at a quarter of the
        regular expression's cost; a replica answering with another of its served names, or
        spacing its JSON, takes the expression."""
        if run.count(self.sent) == run.count(_MODEL_KEY):
            return run.replace(self.sent, self.renamed)
        return _MODEL.sub(self._value, run)

    def answer(self, body: bytearray) -> tuple[int, int]:
        """A JSON answer's `model`, in place: the top-level key leads the object, so the search
        stops at the first rather than scanning megabytes of choices, and nothing is copied.
        Returns where the body changed and by how many bytes it grew (or shrank)."""
        key = _MODEL.search(body)
        if key is None:
            return 0, 0
        start, end = key.end(1), key.end()
        body[start:end] = self.wanted
        return start, len(self.wanted) - (end - start)


def _hop_by_hop(headers: MultiMapping[str], always: frozenset[str]) -> frozenset[str]:
    """`always`, plus the headers the `Connection` header names: those are hop-by-hop too
    (RFC 9110, 7.6.1), and forwarding them lets a client smuggle headers past a proxy."""
    named = ",".join(headers.getall("Connection", ()))  # every line, in any case
    if not named:
        return always
    return always | {token.strip().lower() for token in named.split(",")}


def _end_to_end(headers: MultiMapping[str], always: frozenset[str]) -> CIMultiDict[str]:
    """A copy of `headers` without the hop-by-hop ones, order and case kept.

    Copied whole and then pruned by name: both are C calls on the multidict, where filtering
    item by item lowercases every name in Python, twice the cost for a few headers and more the
    more a client sends (an SDK sends a dozen)."""
    out = CIMultiDict(headers)
    for name in _hop_by_hop(headers, always):
        if name in out:
            del out[name]  # every line of it
    return out


def check_forwardable(raw_headers: tuple[tuple[bytes, bytes], ...]) -> None:
    """Refuse a header value that is not UTF-8: aiohttp's client cannot send it as received (it
    went upstream empty), and a proxy that forwards something other than what it got is worse than
    one that says no."""
    for name, value in raw_headers:
        if not value.isascii():
            try:
                value.decode()
            except UnicodeDecodeError:
                field = name[:64].decode("ascii", "replace")
                raise MalformedRequest(
                    f"the value of header field {field!r} is not valid UTF-8"
                ) from None


def _forwarded_for(peer: str) -> str:
    """A `Forwarded` element naming the peer (RFC 7239, 6: IPv6 in brackets, quoted)."""
    return f'for="[{peer}]"' if ":" in peer else f"for={peer}"


def upstream_headers(
    headers: CIMultiDictProxy[str], ctx: Ctx, api_key: str | None, peer: str | None = None
) -> CIMultiDict[str]:
    """The client's end-to-end headers, the gateway's own request id (`Ctx.upstream_id`, in
    place of the client's), the peer appended to
    `X-Forwarded-For` (and to `Forwarded` when the client sent one) as any proxy does, and the
    credentials the policy says (docs/api.md, "Endpoints and headers")."""
    out = _end_to_end(headers, _DROP_REQUEST)
    out["x-request-id"] = ctx.upstream_id
    if peer:
        out["X-Forwarded-For"] = ", ".join([*out.popall("X-Forwarded-For", []), peer])
        if "Forwarded" in out:
            out["Forwarded"] = ", ".join([*out.popall("Forwarded"), _forwarded_for(peer)])
    # With tenants the client's key is the gateway's business, never the replica's: in
    # `Authorization` or in Anthropic's `x-api-key`, whichever it came in.
    forward_auth = ctx.tenant is None and (
        ctx.pool is None or ctx.pool.spec.forward_client_authorization
    )
    if not forward_auth:
        out.popall("Authorization", None)
        out.popall("x-api-key", None)
    if api_key is not None:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def _response_headers(upstream: MultiMapping[str], ctx: Ctx) -> CIMultiDict[str]:
    out = _end_to_end(upstream, _DROP_RESPONSE)
    out["x-request-id"] = ctx.request_id
    # Which pool and model answered: a spilled request (`place.py`) may be served by another.
    if ctx.pool is not None:
        out["x-gateway-pool"] = ctx.pool.name
        out["x-gateway-model"] = ctx.upstream_model
    if ctx.objective is not None:
        out.update(attainment.response_headers(ctx, ctx.objective))
    out.update(ctx.ratelimit_headers)
    return out


def _count(ctx: Ctx, events: bytes) -> None:
    """Count the generated chunks of a run that carries no usage (the API's: `deltas`), and
    note the first token's time."""
    count = ctx.api.deltas(events)
    if count and ctx.first_token is None:
        ctx.first_token = now = time.perf_counter()
        if ctx.prefill is not None:  # the pool's latency model learns the TTFT
            ctx.prefill.prefilled(now)
    ctx.chunks += count


def _usage_event(ctx: Ctx, event: bytes, drop_usage: bool) -> bytes:
    """Read the usage from one event (its data line: OpenAI's events are one, Anthropic's have
    an `event:` line first); return what the client should get of it."""
    line = event.find(_DATA_LINE)
    at = 0 if event.startswith(_DATA) else line + 1 if line >= 0 else -1
    try:
        chunk = orjson.loads(event[at + len(_DATA) :]) if at >= 0 else None
    except orjson.JSONDecodeError:
        chunk = None
    if not isinstance(chunk, dict):
        _count(ctx, event)
        return event
    if ctx.api.usage_event(ctx, chunk):  # it only carries the usage
        return b"" if drop_usage else event
    _count(ctx, event)
    return event


def _last_usage(events: bytes) -> int:
    """Where the last `"usage"` key of a run is, or -1. A `"usage"` not followed by `:` is a
    string's value (a token that reads `usage`), not a key: inside a string quotes are escaped."""
    at = events.rfind(USAGE)
    while at >= 0 and USAGE_KEY.match(events, at) is None:
        at = events.rfind(USAGE, 0, at)
    return at


def _scan(ctx: Ctx, events: bytes, drop_usage: bool) -> bytes:
    """Account for a run of complete SSE events; return what the client should get.

    Only the last event of the run that carries a `"usage"` key is parsed: usage is cumulative,
    so the last is all the accounting needs, and vLLM's usage-only chunk (the gateway's to drop
    when it asked for it) is its stream's last. The rest is counted with substring searches, so
    the work is a few passes over the run at C speed, however many of its events carry usage: a
    replica cannot make a read cost a parse, or a copy, per event.
    """
    at = _last_usage(events)
    if at < 0:
        _count(ctx, events)
        return events
    cut = events.rfind(_EVENT_END, 0, at)
    start = cut + 2 if cut >= 0 else 0
    end = events.find(_EVENT_END, at)
    end = len(events) if end < 0 else end + 2
    if start == 0 and end == len(events):  # one event a read: a stream's usual run
        return _usage_event(ctx, events, drop_usage)
    before, after = events[:start], events[end:]
    _count(ctx, before)
    usage = _usage_event(ctx, events[start:end], drop_usage)
    _count(ctx, after)
    return b"".join((before, usage, after))


def _relayed(ctx: Ctx, events: bytes, drop_usage: bool, strip: bool) -> bytes:
    """A run of whole events accounted for (`_scan`), the running usage the client did not ask
    for stripped when `strip`: what the client gets of it, but for its `model`."""
    out = _scan(ctx, events, drop_usage)
    return _RUNNING.sub(b"", out) if strip else out


def _failed(ctx: Ctx, replica_url: str, told: str, exc: BaseException | str) -> str:
    """Log what the replica did, for the operator, in one line; return `told`, all the client
    learns: replica addresses and the HTTP client's internals are none of its business."""
    detail = exc if isinstance(exc, str) else str(exc) or type(exc).__name__
    log.warning("request %s: replica %s: %s: %s", ctx.request_id, replica_url, told, detail)
    return told


def _preempted(ctx: Ctx, replica_url: str) -> Preempted:
    """The refusal of a request the gateway cancelled for a critical one: the client retries
    after the pool's `retry_after_s`, when the critical request may have finished."""
    log.info("request %s: preempted on replica %s", ctx.request_id, replica_url)
    assert ctx.pool is not None  # only a pool's slot is preempted
    return Preempted(
        "the request was cancelled to make room for a critical one; retry it",
        retry_after_s=ctx.pool.spec.queue.retry_after_s,
    )


def _stream_error(ctx: Ctx, replica_url: str, exc: BaseException, total: float) -> GatewayError:
    if isinstance(exc, Cancelled):
        return _preempted(ctx, replica_url)
    if isinstance(exc, TimeoutError):
        return _timed_out(ctx, replica_url, "the replica stopped streaming (time-out)", exc, total)
    return UpstreamError(_failed(ctx, replica_url, "the replica broke the stream", exc))


async def _relay(
    ctx: Ctx,
    up: Answer,
    resp: web.StreamResponse,
    first: float,
    total: float,
    rename: ModelRename | None,
) -> None:
    """Relay events until the end; `first` and `total` are loop-time deadlines for the first
    bytes and for the whole answer. Any bytes end the wait for the first: an SSE comment
    (`: ping`) carries no token but proves the replica alive; silence stays bounded by `read_s`.
    `rename` rewrites each run of whole events, so an event split across reads is renamed once
    it is complete, and nothing waits longer than it does without it."""
    drop_usage = not ctx.client_wants_usage
    api = ctx.api
    strip = api.asks_continuous(ctx) and not ctx.client_wants_continuous
    pending = b""
    deadline = min(first, total)
    while True:
        data = await up.read_chunk(deadline)  # no timer per chunk: the answer's watchdog
        if not data:
            break
        deadline = total
        if pending:
            data = pending + data
        end = data.rfind(_EVENT_END)
        if end < 0:
            if len(data) <= _MAX_PENDING:
                pending = data
                continue
            end = len(data) - 2
        pending = data[end + 2 :]
        out = _relayed(ctx, data[: end + 2], drop_usage, strip)
        if rename is not None:
            out = rename.events(out)
        if out:
            await resp.write(out)
            if api.ended(out):  # the client has it all: the stream's end may lag
                ctx.answered = True
    if pending:
        out = _relayed(ctx, pending, drop_usage, strip)
        await resp.write(out if rename is None else rename.events(out))
    ctx.answered = True


async def forward(
    ctx: Ctx,
    request: web.Request,
    upstream: Upstream,
    replica_url: str,
    api_key: str | None,
    timeouts: TimeoutSpec,
    max_response_bytes: int,
    *,
    retry_503: bool = False,
    rename_model: bool = False,
) -> web.StreamResponse:
    """Send upstream and relay the answer; raise a `GatewayError` only before the first byte.

    `ReplicaRefused` means the replica never took the request (refused, reset before headers, or
    503 when `retry_503`): the caller may retry it elsewhere. Nothing is retried after a byte
    reached the client. What went wrong is logged; the client is told less. `rename_model`
    gives the answer the `model` the client sent (`server.response_model`).
    """
    rename = ModelRename.of(ctx) if rename_model else None
    headers = upstream_headers(request.headers, ctx, api_key, request.remote)
    now = asyncio.get_running_loop().time()
    total = now + timeouts.total_s
    first = now + timeouts.first_token_s
    # The deadlines are the answer's watchdog's to keep, with `read_s`: one timer per request.
    head_by = min(first, total) if ctx.stream else total
    if ctx.trace is not None:
        ctx.trace.sending(replica_url, headers)
    up = await _post(ctx, upstream, replica_url, headers, timeouts, head_by, total)
    if ctx.trace is not None:
        ctx.trace.answered(up.status)
    if not ctx.stream or up.status != 200 or up.content_type != "text/event-stream":
        return await _answer(ctx, up, replica_url, max_response_bytes, rename, retry_503, total)
    try:
        ctx.status = up.status
        resp = web.StreamResponse(status=200, headers=_response_headers(up.headers, ctx))
        try:
            await resp.prepare(request)  # the first write: the client may be gone already
            await _relay(ctx, up, resp, first, total, rename)
        except ConnectionResetError:  # the client left mid-stream (before cancellation reached us)
            up.close()
            client_left(ctx)
            return resp
        except (TimeoutError, ExchangeError) as exc:
            up.close()
            error = _stream_error(ctx, replica_url, exc, total)
            ctx.refusal, ctx.code = error.refusal, error.code
            with contextlib.suppress(ConnectionResetError):
                await resp.write(ctx.api.stream_error(error))
        with contextlib.suppress(ConnectionResetError):  # it had it all and hung up first
            await resp.write_eof()
        return resp
    except BaseException:
        up.close()  # the client left or we failed: make the replica stop generating
        raise
    finally:
        up.release()


def _timed_out(
    ctx: Ctx, replica_url: str, told: str, exc: BaseException, total: float
) -> GatewayError:
    """An `UpstreamTimeout` saying `told`; a `TotalTimeout` when the request ran out its own
    `total_s` (loop time `total`): a deadline passed, not the replica's silence (`read_s`,
    `connect_s`: an `ExchangeTimeout`), and it was the whole answer's, not the first bytes'
    (`first_token_s`, sooner)."""
    if not isinstance(exc, ExchangeTimeout) and asyncio.get_running_loop().time() >= total:
        told = "the request reached the gateway's time limit for an answer"
        return TotalTimeout(_failed(ctx, replica_url, told, exc))
    return UpstreamTimeout(_failed(ctx, replica_url, told, exc))


async def _post(
    ctx: Ctx,
    upstream: Upstream,
    replica_url: str,
    headers: CIMultiDict[str],
    timeouts: TimeoutSpec,
    deadline: float,
    total: float,
) -> Answer:
    """Send the request; what fails before an answer's head (by `deadline`, loop time; the
    whole answer's is `total`), as a `GatewayError`."""
    try:
        return await upstream.post(
            replica_url,
            ctx.path,
            headers,
            upstream_body(ctx),
            timeouts.connect_s,
            timeouts.read_s,
            deadline,
            ctx.cancel,
        )
    except Cancelled:
        raise _preempted(ctx, replica_url) from None
    except TimeoutError as exc:  # connect_s, read_s or the deadline
        raise _timed_out(
            ctx, replica_url, "the replica did not answer in time", exc, total
        ) from None
    except Refused as exc:
        raise ReplicaRefused(
            _failed(ctx, replica_url, "the replica failed before answering", exc)
        ) from None
    except ExchangeError as exc:
        raise UpstreamError(
            _failed(ctx, replica_url, "the replica failed before answering", exc)
        ) from None


async def _answer(
    ctx: Ctx,
    up: Answer,
    replica_url: str,
    limit: int,
    rename: ModelRename | None,
    retry_503: bool,
    deadline: float,
) -> web.Response:
    """An answer that is not an event stream, read whole by `deadline` (loop time); the
    connection is closed on a failure or a refusal, so the replica stops working on it."""
    try:
        if up.status == 503 and retry_503:
            raise ReplicaRefused(_failed(ctx, replica_url, "the replica is unavailable", "503"))
        ctx.status = up.status
        return await _whole(ctx, up, replica_url, limit, rename, deadline)
    except BaseException:
        up.close()
        raise
    finally:
        up.release()


async def _whole(
    ctx: Ctx,
    up: Answer,
    replica_url: str,
    limit: int,
    rename: ModelRename | None,
    deadline: float,
) -> web.Response:
    """Read the answer whole, but no more than `limit` bytes: past it, the request ends and the
    caller closes the connection, so a huge answer costs the gateway `limit` at most."""
    usage_at = -1  # where `"usage"` last occurs, looked for in each chunk as it arrives
    try:
        if (up.content_length or 0) > limit:
            raise _too_large(ctx, replica_url, limit, f"Content-Length {up.content_length}")
        data = bytearray()
        while chunk := await up.read_chunk(deadline):
            start = max(0, len(data) - len(USAGE) + 1)
            data += chunk
            if len(data) > limit:
                raise _too_large(ctx, replica_url, limit, "it sent more")
            usage_at = max(usage_at, data.rfind(USAGE, start))
    except TimeoutError as exc:  # read_s or the deadline
        told = "the replica did not finish its answer in time"
        raise _timed_out(ctx, replica_url, told, exc, deadline) from None
    except Cancelled:
        raise _preempted(ctx, replica_url) from None
    except ExchangeError as exc:
        raise UpstreamError(
            _failed(ctx, replica_url, "the replica broke its answer", exc)
        ) from None
    if up.status == 200 and rename is not None:
        changed_at, grown = rename.answer(data)
        if usage_at > changed_at:
            usage_at += grown
    if up.status == 200 and usage_at >= 0:
        ctx.unread_usage = (data, usage_at)
    if up.status == 200:
        await ctx.api.count_answer(ctx, data)
    return web.Response(status=up.status, body=data, headers=_response_headers(up.headers, ctx))


def _too_large(ctx: Ctx, replica_url: str, limit: int, why: str) -> ResponseTooLarge:
    told = f"the replica's answer is over the gateway's {limit}-byte limit"
    return ResponseTooLarge(_failed(ctx, replica_url, told, why))
