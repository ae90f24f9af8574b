"""Sending the planned requests: one level of closed-loop users or open-loop Poisson arrivals.

A level is bounded twice: by its planned requests and by `max_seconds`. At the deadline every
request still in flight is cancelled (which closes its connection, so a vLLM server stops
generating it) and kept as `unfinished`: it was neither completed nor failed by the server, and
the statistics count it apart (see stats.py).

A session's turns run one after the other, each once the previous answer is in (and the
session's think time has passed), while sessions interleave as users or arrivals allow: a user
runs one session to its end, an arrival starts one. A turn is recorded with its whole prompt's
input tokens as its ISL. A failed turn ends its session: its history has no answer to go on.

A planned request's tier and objectives go out as `x-priority`, `x-slo-ttft-ms` and
`x-slo-tpot-ms`; the gateway's `x-gateway-predicted-ttft-ms` / `-tpot-ms` answers and the error
code of a refusal (`slo_unreachable`, `queue_full`, ...) come back into the record. The
objectives are planned in simulated milliseconds and the gateway measures wall time, so with a
time scale K they are sent divided by K, and its predictions are recorded in wall seconds like
every other latency here (the reports multiply them by K).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from loadtest.loadgen.progress import Progress
from loadtest.loadgen.prompts import SESSION_HEADER, Body, Turn
from loadtest.loadgen.workloads import Endpoint, Planned

PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
}
JSON = {"Content-Type": "application/json"}
RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})
UNFINISHED = "unfinished"
PRIORITY_HEADER = "x-priority"
SLO_HEADERS = {"ttft_ms": "x-slo-ttft-ms", "tpot_ms": "x-slo-tpot-ms"}
PREDICTED_HEADERS = {"ttft": "x-gateway-predicted-ttft-ms", "tpot": "x-gateway-predicted-tpot-ms"}

# Transport failures by kind, most specific first (as httpx maps foreign errors onto its own).
ERRORS: tuple[tuple[type[BaseException], str], ...] = (
    (aiohttp.ClientConnectorError, "connect"),
    (aiohttp.ServerTimeoutError, "timeout"),
    (TimeoutError, "timeout"),
    (aiohttp.ServerDisconnectedError, "reset"),
    (aiohttp.ClientPayloadError, "reset"),
    (ConnectionResetError, "reset"),
    (aiohttp.ClientError, "client_error"),
    (ValueError, "bad_response"),  # orjson.JSONDecodeError, or an over-long SSE line
)


@dataclass(slots=True)
class RequestRecord:
    """What one request did. Times are seconds: `start_s` from the level's start, the rest from
    the request's own start. Token counts are the server's (its usage), `None` when it gave none."""

    index: int
    cls: str
    endpoint: Endpoint
    isl: int  # planned input tokens
    osl: int  # planned output tokens (max_tokens with ignore_eos)
    start_s: float
    status: int = 0  # HTTP status; 0 when no response arrived
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    session: str | None = None  # a session's id, as sent in `user` and x-session-id
    turn: int | None = None
    priority: str | None = None  # the x-priority sent, if any
    code: str | None = None  # a refusal's `error.code`, as the answer's body gave it
    predicted_ttft_s: float | None = None  # the gateway's prediction, wall seconds
    predicted_tpot_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def unfinished(self) -> bool:
        return self.error == UNFINISHED

    @property
    def outcome(self) -> str:
        """`ok`, or the failure's key: an HTTP status, or a transport error's kind."""
        if self.ok:
            return "ok"
        return self.error if self.error and self.status in (0, 200) else str(self.status)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as vLLM's benchmarks define it."""
        if self.ttft_s is None or self.e2e_s is None or (self.output_tokens or 0) < 2:
            return None
        assert self.output_tokens is not None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def row(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "class": self.cls,
            "endpoint": self.endpoint,
            "isl": self.isl,
            "osl": self.osl,
            "start_s": round(self.start_s, 6),
            "status": self.status,
            "error": self.error,
            "ttft_s": _round(self.ttft_s),
            "tpot_s": _round(self.tpot_s),
            "e2e_s": _round(self.e2e_s),
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "session": self.session,
            "turn": self.turn,
            "priority": self.priority,
            "code": self.code,
            "predicted_ttft_s": _round(self.predicted_ttft_s),
            "predicted_tpot_s": _round(self.predicted_tpot_s),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


@dataclass
class LevelRun:
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0


def _text_in(chunk: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries output (vLLM's first chunk is often just the role; an
    Anthropic stream's output is in its `content_block_delta` events)."""
    if chunk.get("type") == "content_block_delta":
        delta = chunk.get("delta") or {}
        return bool(delta.get("text") or delta.get("thinking") or delta.get("partial_json"))
    if str(chunk.get("type")).endswith(".delta"):  # the Responses API's text, reasoning, calls
        return bool(chunk.get("delta"))
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if delta is None:
            piece = choice.get("text")
        else:  # a reasoning model's first output is its reasoning: that is its first token too
            piece = delta.get("content") or delta.get("reasoning_content")
        if piece:
            return True
    return False


def _content(chunk: dict[str, Any]) -> str:
    """The answer's text in a chunk or a whole response: what a session's history keeps."""
    if chunk.get("type") == "content_block_delta":
        return str((chunk.get("delta") or {}).get("text") or "")
    if chunk.get("type") == "message":
        return "".join(b.get("text") or "" for b in chunk.get("content") or ())
    if chunk.get("type") == "response.output_text.delta":
        return str(chunk.get("delta") or "")
    if chunk.get("object") == "response":  # a whole Responses API answer: its output messages
        return "".join(
            part.get("text") or ""
            for item in chunk.get("output") or ()
            if item.get("type") == "message"
            for part in item.get("content") or ()
        )
    pieces = []
    for choice in chunk.get("choices") or ():
        message = choice.get("delta") or choice.get("message") or {}
        pieces.append(message.get("content") or "")
    return "".join(pieces)


def _usage(rec: RequestRecord, usage: dict[str, Any] | None) -> None:
    if usage and "output_tokens" in usage:  # Anthropic's and the Responses API's (Anthropic's
        # cache counts are prompt tokens too)
        rec.input_tokens = sum(
            usage.get(key) or 0
            for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        )
        rec.output_tokens = usage["output_tokens"]
    elif usage:
        rec.input_tokens = usage.get("prompt_tokens")
        rec.output_tokens = usage.get("completion_tokens")


async def _read_stream(
    resp: aiohttp.ClientResponse, rec: RequestRecord, started: float, reply: list[str] | None
) -> None:
    done = False
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        chunk = orjson.loads(payload)
        kind = chunk.get("type")
        if "error" in chunk or kind == "error":  # an error event mid-stream (every API's shape)
            rec.error = "stream_error"
            return
        if kind == "message_stop":  # an Anthropic stream's end
            done = True
            break
        if kind in RESPONSE_ENDS:  # a Responses API stream's end, with the whole response
            _usage(rec, (chunk.get("response") or {}).get("usage"))
            done = True
            break
        if kind == "message_start":
            _usage(rec, (chunk.get("message") or {}).get("usage"))
            continue
        if rec.ttft_s is None and _text_in(chunk):
            rec.ttft_s = time.perf_counter() - started
        if reply is not None:
            reply.append(_content(chunk))
        _usage(rec, chunk.get("usage"))
    if not done:
        rec.error = "incomplete"


def slo_headers(planned: Planned, time_scale: float = 1.0) -> dict[str, str]:
    """The request's tier and objectives as headers; objectives in the gateway's wall ms."""
    out: dict[str, str] = {PRIORITY_HEADER: planned.priority} if planned.priority else {}
    if planned.slo is not None:
        for field_name, header in SLO_HEADERS.items():
            if (ms := getattr(planned.slo, field_name)) is not None:
                out[header] = f"{ms / time_scale:.6g}"
    return out


def _predicted_s(resp: aiohttp.ClientResponse, kind: str) -> float | None:
    """A prediction header in seconds; None when absent or not a finite non-negative number
    (the gateway's answer is read like any other, not trusted)."""
    text = resp.headers.get(PREDICTED_HEADERS[kind])
    try:
        ms = float(text) if text is not None else None
    except ValueError:
        return None
    return ms / 1000 if ms is not None and 0 <= ms < float("inf") else None


def _error_code(body: bytes) -> str | None:
    """`error.code` of an answer in the gateway's (OpenAI's) error shape, if it is one."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    planned: Planned,
    rec: RequestRecord,
    stream: bool,
    headers: dict[str, str] = JSON,
    reply: list[str] | None = None,
) -> None:
    """Send one request and fill `rec` in place, so a cancelled request is still on record;
    `reply`, if given, collects the answer's text."""
    started = time.perf_counter()
    try:
        async with session.post(url + PATHS[planned.endpoint], data=body, headers=headers) as resp:
            rec.status = resp.status
            rec.predicted_ttft_s = _predicted_s(resp, "ttft")
            rec.predicted_tpot_s = _predicted_s(resp, "tpot")
            if resp.status != 200:
                rec.code = _error_code(await resp.read())
            elif stream and planned.endpoint != "embeddings":
                await _read_stream(resp, rec, started, reply)
            else:
                answer = orjson.loads(await resp.read())
                _usage(rec, answer.get("usage"))
                if reply is not None:
                    reply.append(_content(answer))
    except asyncio.CancelledError:
        rec.error = UNFINISHED
        raise
    except Exception as exc:
        rec.error = next((kind for cls, kind in ERRORS if isinstance(exc, cls)), None)
        if rec.error is None:
            raise
    finally:
        rec.e2e_s = time.perf_counter() - started


def units(planned: Sequence[Planned]) -> list[list[int]]:
    """What a user or an arrival takes: a request on its own, or a session's turns in order."""
    out: list[list[int]] = []
    sessions: dict[int, list[int]] = {}
    for i, p in enumerate(planned):
        if p.session is None:
            out.append([i])
        elif p.session in sessions:
            sessions[p.session].append(i)
        else:
            out.append(sessions.setdefault(p.session, [i]))
    return out


async def run_level(
    session: aiohttp.ClientSession,
    url: str,
    planned: Sequence[Planned],
    bodies: Sequence[Body],
    users: int | None,
    max_seconds: float,
    stream: bool,
    progress: Progress,
    time_scale: float = 1.0,
) -> LevelRun:
    """Closed loop with `users` concurrent users, or open loop (`users=None`) at `planned[i].at`;
    `time_scale` converts the planned objectives into the wall milliseconds sent."""
    run = LevelRun()
    started = time.perf_counter()

    async def one(i: int) -> bool:
        p, body = planned[i], bodies[i]
        rec = RequestRecord(i, p.cls, p.endpoint, p.isl, p.osl, 0.0, priority=p.priority)
        reply: list[str] | None = None  # kept only for a session's history
        if isinstance(body, Turn):
            reply = []
            # Affinity may key on either: the OpenAI `user` field (in the body) or this header.
            headers = {**JSON, SESSION_HEADER: body.conversation.id}
            rec.session, rec.turn = body.conversation.id, p.turn
            data, rec.isl = await body.render()
        else:
            headers, data = JSON, body
        if p.priority is not None or p.slo is not None:
            headers = {**headers, **slo_headers(p, time_scale)}
        rec.start_s = time.perf_counter() - started
        run.records.append(rec)
        await send(session, url, data, p, rec, stream, headers, reply)
        if isinstance(body, Turn) and rec.ok:
            body.answered("".join(reply or ()))
        progress.tick(rec.ok)
        return rec.ok

    async def unit(indices: list[int]) -> None:
        for i in indices:
            if planned[i].turn and planned[i].think_s:
                await asyncio.sleep(planned[i].think_s)
            if not await one(i):
                return  # a failed turn ends its session

    todo = units(planned)
    work = iter(todo)

    async def user() -> None:
        for indices in work:  # one shared iterator: each request or session is taken by one user
            await unit(indices)

    try:
        async with asyncio.timeout(max_seconds), asyncio.TaskGroup() as tasks:
            if users is not None:
                for _ in range(min(users, len(todo))):
                    tasks.create_task(user())
            else:
                for indices in todo:
                    at = planned[indices[0]].at
                    assert at is not None
                    await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
                    tasks.create_task(unit(indices))
    except TimeoutError:
        run.duration_s = max_seconds
    else:
        ends = [r.start_s + r.e2e_s for r in run.records if r.e2e_s is not None]
        run.duration_s = max(ends, default=0.0)
    return run
