"""A scripted replica: vLLM's API on every endpoint the adversary draws, honest or lying on cue.

The harness puts a nonce (`adv-` and 12 hex digits) in every prompt and files a `Script` for it
in the shared `Ledger`; the replica finds the nonce in the body it receives and does what the
script says. Whatever it says in `usage`, it records what it really did: the prompt counted by
`transformers` with the model's own chat template (an independent reimplementation of vLLM's
rendering, not the gateway's code) and the output tokens it wrote until the connection closed.
Every output token is the text " hello", one token in Gemma 3, Llama 3 and Qwen 3 alike, so a
client or the gateway counting the relayed text counts tokens.

A speech upload (transcription, translation) is answered as vLLM answers it: a whole answer is
`{"text": ...}` whose honest `usage` is the audio's seconds (no token count; a lying one is a
token count, missing, negative, huge or understated), a stream is transcription chunks and,
when the form asks (`stream_include_usage`), a usage chunk. Its prompt is its text `prompt`.

What it never lies about is generation itself: like vLLM it stops at the request's `max_tokens`
(or the end of the context), so a reservation of the request's bound always covers its output.
A lie the gateway could not possibly see (a plausible understatement) is marked in the script,
and the quota check takes the replica at its word there.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from gateway.api import BY_NAME
from loadtest.adversary.count import Counter
from loadtest.adversary.endpoints import DRAWN

PIECE = " hello"  # one token in every model the harness serves
NONCE = re.compile(rb"adv-[0-9a-f]{12}")
USAGE_LIES = ("truth", "missing", "negative", "huge", "understate")
# The client's headers the gateway reads and drops (gateway/request/forward.py).
CLIENT_ONLY = frozenset(
    {"x-slo-ttft-ms", "x-slo-tpot-ms", "x-llm-d-slo-ttft-ms", "x-llm-d-slo-tpot-ms", "x-priority"}
)
TRANSPORT = ("ok", "redirect", "hang", "reset_head", "reset_body", "error")
SECRET = "internal-service-secret"  # what a redirect target answers: relayed, it is a leak


@dataclass
class Script:
    """What the replica does with one request."""

    natural: int = 64  # tokens the model says before its end-of-sequence, without ignore_eos
    tokens_per_event: int = 1  # speculative decoding, `--stream-interval`
    usage: str = "truth"
    transport: str = "ok"
    tiny_events: int = 0  # usage-bearing events of a few bytes each, before the text
    pace_s: float = 0.0  # between events: a model's decode time
    huge_event_bytes: int = 0  # one SSE comment this long before the text
    # Lies to the latency model: the first token this late (a stream's, after its head; a
    # whole answer's, before it), past the gateway's `first_token_s` or `read_s` or not; and a
    # stream that ends without one.
    first_delay_s: float = 0.0
    tokenless: bool = False


@dataclass
class Arrival:
    """One time the request reached the replica (a gateway's retry reaches it again)."""

    endpoint: str
    model: str
    upstream_id: str
    started: float
    prompt_tokens: int | None = None
    produced: int = 0
    reported: int | None = None  # the completion tokens its usage claimed, if any
    ended: float | None = None
    finished: bool = False  # wrote its whole answer
    nonce: str = ""
    # The request headers it got that the gateway must never send upstream (the client's
    # latency objectives and priority): what X checks is none.
    leaked_headers: tuple[str, ...] = ()


@dataclass
class Ledger:
    """What the harness scripted and what the replica really did, by nonce."""

    scripts: dict[str, Script] = field(default_factory=dict)
    arrivals: dict[str, list[Arrival]] = field(default_factory=dict)
    open_requests: int = 0
    secret_url: str = ""

    def script(self, nonce: str) -> Script:
        return self.scripts.get(nonce, Script())


def _nonce(raw: bytes) -> str:
    found = NONCE.search(raw)
    return found.group(0).decode() if found else ""


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def _output_bound(endpoint: str, body: dict[str, Any]) -> int | None:
    """The bound the request sets upstream, as vLLM reads it; None: the end of the context."""
    names = {
        "chat": ("max_completion_tokens", "max_tokens"),
        "completions": ("max_tokens",),
        "messages": ("max_tokens",),
        "responses": ("max_output_tokens",),
    }[endpoint]
    for name in names:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 16 if endpoint == "completions" else None  # vLLM's completions default


def _to_produce(endpoint: str, body: dict[str, Any], script: Script, room: int) -> int:
    bound = _output_bound(endpoint, body)
    limit = room if bound is None else min(bound, room)
    wanted = limit if body.get("ignore_eos") is True else script.natural
    floor = body.get("min_tokens")
    if isinstance(floor, int) and not isinstance(floor, bool):
        wanted = max(wanted, floor)
    return max(0, min(wanted, limit))


class Replica:
    """The app factory and its shared state: one `Ledger`, one counting thread."""

    def __init__(
        self, ledger: Ledger, counter: asyncio.Future[Counter], max_model_len: int
    ) -> None:
        self.ledger = ledger
        self._counter = counter  # loaded while the gateways start
        self.max_model_len = max_model_len
        self.stored: dict[str, tuple[str, list[dict[str, Any]]]] = {}  # id -> (model, chat)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="replica-count")

    @property
    def counter(self) -> Counter:
        return self._counter.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def app(self) -> web.Application:
        """A route for every path of every endpoint `endpoints.DRAWN` names, by its kind."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for name, drawn in DRAWN.items():
            if drawn.kind == "tokenize":  # answered by the gateway itself
                continue
            api = BY_NAME.get(name)
            paths = (drawn.path, *(api.aliases if api is not None else ()))
            handler = {
                "generative": self._generative(name),
                "embed": self._pooling(name, "embed"),
                "pair": self._pooling(name, "pair"),
                "speech": self._generative(name, speech=True),
                "passthrough": self._passthrough,
            }[drawn.kind]
            for path in paths:
                app.router.add_post(path, handler)
        app.router.add_get("/v1/responses/{rid}", self._retrieve)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _count(self, fn: Callable[[], int]) -> int:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _generative(
        self, endpoint: str, speech: bool = False
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, endpoint, speech)

        return handle

    async def _serve(self, request: web.Request, endpoint: str, speech: bool) -> web.StreamResponse:
        raw = await request.read()
        nonce = _nonce(raw)
        script = self.ledger.script(nonce)
        body = _form(raw, request.headers.get("Content-Type", "")) if speech else orjson.loads(raw)
        model = str(body.get("model", ""))
        arrival = Arrival(endpoint, model, request.headers.get("x-request-id", ""), time.time())
        arrival.nonce = nonce
        arrival.leaked_headers = _client_only(request)
        self.ledger.arrivals.setdefault(nonce, []).append(arrival)
        self.ledger.open_requests += 1
        try:
            return await self._answer(request, endpoint, body, script, arrival)
        finally:
            self.ledger.open_requests -= 1
            arrival.ended = time.time()

    async def _answer(
        self,
        request: web.Request,
        endpoint: str,
        body: dict[str, Any],
        script: Script,
        arrival: Arrival,
    ) -> web.StreamResponse:
        chat: list[dict[str, Any]] | None = None
        if endpoint in _SPEECH:
            return await self._speech(request, endpoint, body, script, arrival)
        if endpoint == "responses":
            previous = body.get("previous_response_id")
            if previous is not None and previous not in self.stored:
                return _error(404, f"Response with id '{previous}' not found.")
            chat = self.counter.responses_chat(
                body, self.stored[previous][1] if previous is not None else []
            )
        try:
            arrival.prompt_tokens = await self._count(
                lambda: self.counter.prompt(arrival.model, endpoint, body, chat)
            )
        except Exception as exc:  # vLLM's 400 for a request its template cannot render
            return _error(400, f"adversary replica could not render: {exc!r}"[:300])
        if (failed := await self._transport(request, script, arrival)) is not None:
            return failed
        room = max(0, self.max_model_len - arrival.prompt_tokens)
        sequences = body.get("n") if endpoint in ("chat", "completions") else 1
        sequences = sequences if isinstance(sequences, int) and 1 <= sequences <= 16 else 1
        produce = _to_produce(endpoint, body, script, room)
        text_of = _Shapes(endpoint, body, arrival, sequences)
        if body.get("stream") is True:
            return await self._stream(request, text_of, script, arrival, produce, sequences, chat)
        if script.first_delay_s:
            await asyncio.sleep(script.first_delay_s)
        arrival.produced = produce * sequences
        answer = text_of.whole(PIECE * produce, self._usage(script, arrival, produce * sequences))
        self._store(endpoint, body, arrival, chat, PIECE * produce, answer)
        arrival.finished = True
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def _transport(
        self, request: web.Request, script: Script, arrival: Arrival
    ) -> web.StreamResponse | None:
        """The script's lie about the transport before any byte of the answer, if any."""
        if script.transport == "redirect":
            raise web.HTTPFound(self.ledger.secret_url)
        if script.transport == "reset_head" and len(self.ledger.arrivals[arrival.nonce]) == 1:
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if script.transport == "hang":
            await asyncio.sleep(3600)
        if script.transport == "error":  # an engine error after the prompt was read: a 500
            return _error(500, "adversary replica: EngineCore encountered an issue")
        return None

    async def _speech(
        self,
        request: web.Request,
        endpoint: str,
        form: dict[str, Any],
        script: Script,
        arrival: Arrival,
    ) -> web.StreamResponse:
        """A transcription: its prompt counted, then the script's transport, then the text."""
        arrival.prompt_tokens = await self._count(lambda: self.counter.speech(arrival.model, form))
        if (failed := await self._transport(request, script, arrival)) is not None:
            return failed
        room = max(0, self.max_model_len - arrival.prompt_tokens)
        produce = min(script.natural, room)
        shapes = _Shapes("speech", form, arrival, 1)
        if form.get("stream") == "true":
            return await self._stream(request, shapes, script, arrival, produce, 1, None)
        arrival.produced = produce
        usage = self._usage(script, arrival, produce)
        answer = shapes.whole(PIECE * produce, None if script.usage == "truth" else usage)
        if script.usage == "truth":  # vLLM's: the audio's seconds, no token count
            answer["usage"] = {"type": "duration", "seconds": 1}
        arrival.finished = True
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    def _usage(self, script: Script, arrival: Arrival, output: int) -> tuple[int, int] | None:
        prompt = arrival.prompt_tokens or 0
        lie = script.usage
        if lie == "missing":
            return None
        if lie == "negative":
            return (-prompt - 5, -output - 7)
        if lie == "huge":
            return (prompt * 1000 + 10**9, 10**12)
        if lie == "understate":  # plausible: the quota check takes this at its word
            arrival.reported = max(1, output // 10)
            return (prompt, arrival.reported)
        arrival.reported = output
        return (prompt, output)

    def _store(
        self,
        endpoint: str,
        body: dict[str, Any],
        arrival: Arrival,
        chat: list[dict[str, Any]] | None,
        text: str,
        answer: dict[str, Any],
    ) -> None:
        if endpoint != "responses" or body.get("store") is False or chat is None:
            return
        turns = [m for m in chat if m.get("role") != "system"] + [
            {"role": "assistant", "content": text}
        ]
        self.stored[answer["id"]] = (arrival.model, turns)

    async def _stream(
        self,
        request: web.Request,
        shapes: _Shapes,
        script: Script,
        arrival: Arrival,
        produce: int,
        sequences: int,
        chat: list[dict[str, Any]] | None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(shapes.start())
        if script.huge_event_bytes:
            await resp.write(b": " + b"x" * script.huge_event_bytes + b"\n\n")
        if script.tiny_events:
            tiny = shapes.tiny_usage()
            batch = 12_000  # about 256 KB a write, as the break issue 35 found was sent
            for start in range(0, script.tiny_events, batch):
                await resp.write(tiny * min(batch, script.tiny_events - start))
        if script.first_delay_s:
            await asyncio.sleep(script.first_delay_s)
        if script.tokenless:
            produce = 0
        sent = 0
        per = max(1, script.tokens_per_event)
        cut_at = produce // 2 if script.transport == "reset_body" else None
        while sent < produce:
            k = min(per, produce - sent)
            if cut_at is not None and sent >= cut_at:
                assert request.transport is not None
                request.transport.abort()
                return resp
            for index in range(sequences):
                await resp.write(shapes.delta(PIECE * k, index))
            sent += k
            arrival.produced = sent * sequences
            if script.pace_s:
                await asyncio.sleep(script.pace_s)
        usage = self._usage(script, arrival, produce * sequences)
        text = PIECE * produce
        whole = shapes.whole(text, usage)
        self._store(shapes.endpoint, shapes.body, arrival, chat, text, whole)
        await resp.write(shapes.end(text, usage, whole))
        arrival.finished = True
        await resp.write_eof()
        return resp

    def _pooling(
        self, endpoint: str, kind: str
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._pooled(request, endpoint, kind)

        return handle

    async def _pooled(self, request: web.Request, endpoint: str, kind: str) -> web.Response:
        raw = await request.read()
        nonce = _nonce(raw)
        body = orjson.loads(raw)
        arrival = Arrival(endpoint, str(body.get("model", "")), "", time.time())
        arrival.leaked_headers = _client_only(request)
        self.ledger.arrivals.setdefault(nonce, []).append(arrival)
        self.ledger.open_requests += 1
        try:
            arrival.prompt_tokens = await self._count(
                lambda: self.counter.pooling(arrival.model, kind, body)
            )
            usage = {"prompt_tokens": arrival.prompt_tokens, "total_tokens": arrival.prompt_tokens}
            data: dict[str, Any] = {
                "embeddings": {"object": "embedding", "index": 0, "embedding": [0.0, 1.0]},
                "classify": {"index": 0, "label": "a", "probs": [1.0], "num_classes": 1},
                "pooling": {"object": "pooling", "index": 0, "data": [0.0, 1.0]},
                "score": {"object": "score", "index": 0, "score": 0.5},
            }.get(endpoint, {})
            answer: dict[str, Any] = {"object": "list", "data": [data], "usage": usage}
            if endpoint == "rerank":
                answer = {"id": "rerank-1", "results": [], "usage": usage}
            answer["model"] = arrival.model
            arrival.finished = True
            return web.json_response(answer)
        finally:
            self.ledger.open_requests -= 1
            arrival.ended = time.time()

    async def _passthrough(self, request: web.Request) -> web.Response:
        raw = await request.read()
        arrival = Arrival("passthrough", "", "", time.time(), finished=True, ended=time.time())
        arrival.leaked_headers = _client_only(request)
        self.ledger.arrivals.setdefault(_nonce(raw), []).append(arrival)
        return web.json_response({"ok": True})

    async def _retrieve(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        if self.ledger.script(_nonce(rid.encode())).transport == "redirect":
            raise web.HTTPFound(self.ledger.secret_url)
        if rid not in self.stored:
            return _error(404, f"Response with id '{rid}' not found.")
        return web.json_response({"id": rid, "object": "response", "status": "completed"})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="")


_SPEECH = tuple(name for name, drawn in DRAWN.items() if drawn.kind == "speech")


def _client_only(request: web.Request) -> tuple[str, ...]:
    return tuple(name for name in request.headers if name.lower() in CLIENT_ONLY)


def _form(raw: bytes, content_type: str) -> dict[str, Any]:
    """A multipart form's text fields, the first of each name, read by the standard library's
    MIME parser (not the gateway's)."""
    head = f"Content-Type: {content_type}\r\n\r\n".encode()
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if isinstance(name, str) and name not in fields and isinstance(payload, bytes):
            if not part.get_filename():
                fields[name] = payload.decode()
    return fields


def _error(status: int, message: str) -> web.Response:
    error = {"message": message, "type": "BadRequestError", "code": status}
    return web.json_response({"error": error, "object": "error"}, status=status)


class _Shapes:
    """One endpoint's answer and stream events, as vLLM writes them."""

    def __init__(
        self, endpoint: str, body: dict[str, Any], arrival: Arrival, sequences: int
    ) -> None:
        self.endpoint, self.body, self.arrival, self.sequences = endpoint, body, arrival, sequences
        self.id = str(body.get("request_id") or f"resp_{uuid.uuid4().hex}")
        self.model = arrival.model

    def _usage(self, usage: tuple[int, int] | None) -> dict[str, int] | None:
        if usage is None:
            return None
        prompt, output = usage
        if self.endpoint == "messages":
            return {"input_tokens": prompt, "output_tokens": output}
        if self.endpoint == "responses":
            return {
                "input_tokens": prompt,
                "output_tokens": output,
                "total_tokens": prompt + output,
            }
        return {
            "prompt_tokens": prompt,
            "completion_tokens": output,
            "total_tokens": prompt + output,
        }

    def whole(self, text: str, usage: tuple[int, int] | None) -> dict[str, Any]:
        out: dict[str, Any]
        if self.endpoint == "speech":
            shaped = self._usage(usage)
            return {"text": text, **({"usage": shaped} if shaped is not None else {})}
        if self.endpoint == "chat":
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
                for i in range(self.sequences)
            ]
            out = {"id": "chatcmpl-a", "object": "chat.completion", "choices": choices}
        elif self.endpoint == "completions":
            choices = [
                {"index": i, "text": text, "finish_reason": "length"} for i in range(self.sequences)
            ]
            out = {"id": "cmpl-a", "object": "text_completion", "choices": choices}
        elif self.endpoint == "messages":
            out = {
                "id": "msg_a",
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": text}],
                "stop_reason": "max_tokens",
            }
        else:
            out = {
                "id": self.id,
                "object": "response",
                "status": "completed",
                "output": [
                    {
                        "type": "message",
                        "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": text}],
                    }
                ],
            }
        out["model"] = self.model
        shaped = self._usage(usage)
        if shaped is not None:
            out["usage"] = shaped
        return out

    def start(self) -> bytes:
        if self.endpoint == "messages":
            usage = {"input_tokens": self.arrival.prompt_tokens or 0, "output_tokens": 0}
            message = {
                "id": "msg_a",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": self.model,
                "usage": usage,
            }
            return _sse({"type": "message_start", "message": message}, "message_start") + _sse(
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
                "content_block_start",
            )
        if self.endpoint == "responses":
            response = {
                "id": self.id,
                "object": "response",
                "status": "in_progress",
                "model": self.model,
                "output": [],
            }
            return _sse({"type": "response.created", "response": response}, "response.created")
        return b""

    def tiny_usage(self) -> bytes:
        """A few bytes that carry `usage`: what a scan per event must not pay for quadratically."""
        if self.endpoint == "messages":
            return b'event: message_delta\ndata: {"usage":{"output_tokens":0}}\n\n'
        if self.endpoint == "responses":
            return b'data: {"usage":{}}\n\n'
        return b'data: {"usage":{}}\n\n'

    def delta(self, text: str, index: int) -> bytes:
        if self.endpoint == "speech":
            choice = {"index": index, "delta": {"content": text}, "finish_reason": None}
            return _sse(
                {"id": "trsc-a", "object": "transcription.chunk", "model": self.model,
                 "choices": [choice]}
            )  # fmt: skip
        if self.endpoint == "chat":
            choice = {"index": index, "delta": {"content": text}, "finish_reason": None}
            return _sse(
                {
                    "id": "chatcmpl-a",
                    "object": "chat.completion.chunk",
                    "model": self.model,
                    "choices": [choice],
                }
            )
        if self.endpoint == "completions":
            choice = {"index": index, "text": text, "finish_reason": None}
            return _sse(
                {
                    "id": "cmpl-a",
                    "object": "text_completion",
                    "model": self.model,
                    "choices": [choice],
                }
            )
        if self.endpoint == "messages":
            delta = {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": text},
            }
            return _sse(delta, "content_block_delta")
        return _sse(
            {
                "type": "response.output_text.delta",
                "item_id": "msg_a",
                "output_index": 0,
                "content_index": 0,
                "delta": text,
            },
            "response.output_text.delta",
        )

    def end(self, text: str, usage: tuple[int, int] | None, whole: dict[str, Any]) -> bytes:
        shaped = self._usage(usage)
        if self.endpoint == "speech":
            out = b""
            if shaped is not None and self.body.get("stream_include_usage") == "true":
                chunk = {"object": "transcription.chunk", "choices": [], "usage": shaped}
                out = _sse({"id": "trsc-a", "model": self.model, **chunk})
            return out + b"data: [DONE]\n\n"
        if self.endpoint in ("chat", "completions"):
            kind = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
            out = b""
            for i in range(self.sequences):
                done: dict[str, Any] = {"index": i, "finish_reason": "length"}
                done |= {"delta": {}} if self.endpoint == "chat" else {"text": ""}
                out += _sse({"id": "a", "object": kind, "model": self.model, "choices": [done]})
            options = self.body.get("stream_options") or {}
            if shaped is not None and options.get("include_usage"):
                out += _sse(
                    {"id": "a", "object": kind, "model": self.model, "choices": [], "usage": shaped}
                )
            return out + b"data: [DONE]\n\n"
        if self.endpoint == "messages":
            delta: dict[str, Any] = {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens"},
            }
            if shaped is not None:
                delta["usage"] = {"output_tokens": shaped["output_tokens"]}
            return (
                _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                + _sse(delta, "message_delta")
                + _sse({"type": "message_stop"}, "message_stop")
            )
        return _sse(
            {"type": "response.output_text.done", "delta": text}, "response.output_text.done"
        ) + _sse({"type": "response.completed", "response": whole}, "response.completed")
