"""One simulated replica over HTTP: the surface of vLLM's OpenAI server, `/metrics`, admin.

    POST /v1/chat/completions, /v1/completions   streaming (SSE) or not, vLLM's wire format
    POST /v1/messages                             Anthropic's, as vLLM serves it (a chat, converted)
    POST /v1/responses, GET /v1/responses/{id}    OpenAI's Responses API (loadtest/sim/responses.py)
    POST /v1/audio/transcriptions                 a multipart upload: prefill work, a short text
    POST /v1/embeddings, /classify, /pooling, ... vLLM's pooling endpoints: prefill only
    (every path of every endpoint the gateway admits, `gateway.api.APIS`, by its `Api` class:
    `SERVED`, which fails at start for an endpoint it has no handler for)
    GET  /v1/models, /health, /metrics            as vLLM serves them
    GET  /kv_event_sources                        where KV-cache events are published (kv_events.py)
    GET  /admin/faults, POST /admin/faults        read or replace the fault set (faults.py)

`create_replica_app(profile, options)` builds the aiohttp app for one replica; run it with
`handler_cancellation=True` (as `start_replica` does) so that a client that leaves cancels
its handler and the engine aborts its sequence at once, as vLLM does. `start_replica(...)`
also listens on a loopback port and owns that listener, which the refuse-connections fault
needs.

Streams carry one token per SSE chunk at time scale 1. Under time scaling, a stream writes at
most one chunk per `stream_interval_ms` of wall time, carrying every token generated since
the last one (vLLM's `--stream-interval` batches tokens the same way): the first token and
the end are never held back, so time to first token and end-to-end latency are unaffected.
Responses say so in `x-sim-stream-interval-ms` (0: one token per chunk) and `x-sim-time-scale`,
and `sim_stream_packed_chunks_total` counts the chunks that carried several tokens.
"""

from __future__ import annotations

import asyncio
import base64 as b64
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from gateway.api import APIS, Api
from gateway.api.anthropic import MessagesApi, to_chat
from gateway.api.audio import SpeechToTextApi
from gateway.api.chat import ChatApi
from gateway.api.completions import CompletionsApi
from gateway.api.embeddings import PoolingApi
from gateway.api.responses import ResponsesApi
from gateway.errors import BadRequest
from loadtest.sim import responses
from loadtest.sim.engine import Engine
from loadtest.sim.faults import FaultDice, Faults
from loadtest.sim.kv_events import KVEventPublisher, KVEventsConfig
from loadtest.sim.metrics import VllmCollector
from loadtest.sim.profiles import Profile
from loadtest.sim.sequence import Sequence, Status
from loadtest.sim.tokens import PromptEncoder, PromptError, prompt_encoder

log = logging.getLogger("loadtest.sim")

DEFAULT_PACKED_INTERVAL_MS = 50.0
"""Stream interval under time scaling: at most 20 chunks/s per stream keeps 128 streams cheap
(an SSE write costs ~20 us here, and the load generator pays as much again to read it)."""


@dataclass(frozen=True)
class ReplicaOptions:
    """How to run one replica; every field has the value a plain `simulate` run uses."""

    time_scale: float = 1.0
    tokenizer: str | Path | None = None  # a HF tokenizer directory; None: 4 characters a token
    faults: Faults = field(default_factory=Faults)
    seed: int = 0
    served_model_names: tuple[str, ...] = ()  # empty: the profile's served_model_name
    # LoRA adapters (name, path) as vLLM's `--lora-modules name=path`: listed in /v1/models with
    # the first served name as `parent`, and accepted as `model`. The engine runs them as the base.
    lora_modules: tuple[tuple[str, str], ...] = ()
    stream_interval_ms: float | None = None  # None: 0 at time scale 1, else the default above
    fast_forward: bool = True  # decode spans; False steps one by one (tests compare the two)
    enable_prefix_caching: bool = True  # vLLM V1's default (--no-enable-prefix-caching: off)
    enable_prompt_tokens_details: bool = False  # vLLM's flag: usage says the cache's share
    kv_events_config: KVEventsConfig | None = None  # vLLM's --kv-events-config; None: off

    def interval_s(self) -> float:
        if self.stream_interval_ms is not None:
            return self.stream_interval_ms / 1000
        return 0.0 if self.time_scale == 1 else DEFAULT_PACKED_INTERVAL_MS / 1000


class ReplicaState:
    """What one replica's handlers share; kept under the app's `REPLICA` key."""

    def __init__(self, profile: Profile, options: ReplicaOptions) -> None:
        self.profile = profile
        self.options = options
        self.model_names = options.served_model_names or (profile.served_model_name,)
        self.adapters = dict(options.lora_modules)
        self.stream_interval_s = options.interval_s()
        self.engine = Engine(
            profile,
            time_scale=options.time_scale,
            stream_interval_s=self.stream_interval_s,
            fast_forward=options.fast_forward,
            enable_prefix_caching=options.enable_prefix_caching,
            seed=options.seed,
        )
        self.encoder: PromptEncoder = prompt_encoder(options.tokenizer)
        self.responses = responses.ResponseStore()
        self.dice = FaultDice(options.seed + 1)
        self.faults = Faults()
        self.refuser: Callable[[float], None] | None = None  # set by start_replica
        self.engine_task: asyncio.Task[None] | None = None
        self.publisher: KVEventPublisher | None = None  # bound while the app runs
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(VllmCollector(self.engine, self.model_names[0]))
        self.headers = {
            "x-sim-time-scale": f"{options.time_scale:g}",
            "x-sim-stream-interval-ms": f"{self.stream_interval_s * 1000:g}",
        }

    def fired(self, fault: str) -> None:
        faults = self.engine.stats.faults
        faults[fault] = faults.get(fault, 0) + 1

    def set_faults(self, faults: Faults) -> None:
        """Replace the fault set; the one-shot ones (stall, refusal) start now."""
        if faults.refuse_for_s and self.refuser is None:
            raise ValueError(
                "refuse_for_s needs a replica whose listener the simulator owns (start_replica)"
            )
        self.faults = faults
        if faults.stall_s:
            self.fired("stall")
            self.engine.stall(faults.stall_s)
        if faults.refuse_for_s and self.refuser is not None:
            self.fired("refuse")
            self.refuser(faults.refuse_for_s)


REPLICA = web.AppKey("replica", ReplicaState)


def error_response(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """vLLM's error body: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def bad_request(message: str, param: str | None = None) -> web.Response:
    return error_response(400, message, "BadRequestError", param)


def _max_tokens(body: dict[str, Any], chat: bool, prompt: int, limit: int) -> int | web.Response:
    """The output bound, or vLLM's 400 when the request cannot fit `max_model_len`."""
    if prompt >= limit:
        return bad_request(
            f"This model's maximum context length is {limit} tokens. However, your request has"
            f" {prompt} input tokens. Please reduce the length of the input messages."
        )
    requested = body.get("max_completion_tokens") if chat else None
    if requested is None:
        requested = body.get("max_tokens", None if chat else 16)  # OpenAI's completions default
    if requested is None:
        return limit - prompt
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        return bad_request("max_tokens must be at least 1", "max_tokens")
    if requested > limit - prompt:
        return bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's"
            f" maximum context length is {limit} tokens and your request has {prompt} input"
            f" tokens ({requested} > {limit} - {prompt}). (parameter=max_tokens,"
            f" value={requested})",
            "max_tokens",
        )
    return requested


def _usage(seq: Sequence, details: bool) -> dict[str, Any]:
    """vLLM's `UsageInfo`; `details`: its `--enable-prompt-tokens-details`, the prompt's tokens
    its prefix cache served."""
    usage: dict[str, Any] = {
        "prompt_tokens": seq.prompt_tokens,
        "total_tokens": seq.prompt_tokens + seq.generated,
        "completion_tokens": seq.generated,
    }
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": seq.cached_tokens}
    return usage


class _Chunks:
    """Pre-encoded SSE chunks for one stream: only the text and the finish reason vary."""

    def __init__(self, chat: bool, rid: str, model: str, token_text: str, details: bool) -> None:
        self.chat = chat
        self.details = details  # usage with `prompt_tokens_details`
        self.token_text = token_text  # one generated token's text (tokens.output_token_text)
        self.token_json = orjson.dumps(token_text)[1:-1]  # as it goes inside a JSON string
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.head = (
            b'data: {"id":"' + rid.encode() + b'","object":"' + self.object.encode()
            + b'","created":' + str(self.created).encode() + b',"model":' + orjson.dumps(model)
            + b',"choices":[{"index":0,'
        )  # fmt: skip

    def running(self, seq: Sequence | None) -> bytes:
        """A chunk's end: with `seq` (`continuous_usage_stats` asked), vLLM's running usage, the
        sequence's count so far (a chat's with its `completion_tokens_details`, set to null)."""
        if seq is None:
            return b"}\n\n"
        prompt, generated = seq.prompt_tokens, seq.generated
        usage = (
            b',"usage":{"prompt_tokens":' + str(prompt).encode() + b',"total_tokens":'
            + str(prompt + generated).encode() + b',"completion_tokens":'
            + str(generated).encode() + (b',"completion_tokens_details":null}' if self.chat else b"}")
        )  # fmt: skip
        return usage + b"}\n\n"

    def role(self, seq: Sequence | None = None) -> bytes:
        """The chat's first chunk; its running usage, when asked, counts no token yet."""
        head = self.head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
        if seq is None:
            return head + b'"finish_reason":null}]' + self.running(None)
        prompt = str(seq.prompt_tokens).encode()
        return (
            head + b'"finish_reason":null}],"usage":{"prompt_tokens":' + prompt
            + b',"total_tokens":' + prompt
            + b',"completion_tokens":0,"completion_tokens_details":null}}\n\n'
        )  # fmt: skip

    def tokens(self, count: int, finish_reason: str | None, seq: Sequence | None = None) -> bytes:
        """A chunk of `count` tokens; `seq`: with the running usage (`running`)."""
        text = self.token_json * count
        end = (
            b'"finish_reason":null}]'
            if finish_reason is None
            else b'"finish_reason":"' + finish_reason.encode() + b'","stop_reason":null}]'
        ) + self.running(seq)
        if self.chat:
            return self.head + b'"delta":{"content":"' + text + b'"},"logprobs":null,' + end
        if finish_reason is None:
            end = b'"finish_reason":null,"stop_reason":null}]' + self.running(seq)
        return self.head + b'"text":"' + text + b'","logprobs":null,' + end

    def usage(self, seq: Sequence) -> bytes:
        final = {
            "id": self.rid,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": _usage(seq, self.details),
        }
        return b"data: " + orjson.dumps(final) + b"\n\n"


async def _stream(
    request: web.Request, state: ReplicaState, seq: Sequence, chunks: _Chunks, body: dict[str, Any]
) -> web.StreamResponse:
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage"))
    # vLLM's `should_include_usage`: the running count only with the final one.
    running = seq if include_usage and options.get("continuous_usage_stats") else None
    reset_after = state.dice.reset_after(state.faults)
    stats = state.engine.stats
    interval = state.stream_interval_s
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **state.headers}
    )
    try:
        await resp.prepare(request)
        sent = written = 0
        while True:  # each pass writes one chunk or waits for the engine; ends with the sequence
            generated, status = seq.generated, seq.status
            if generated == sent and not seq.done:
                await seq.wait(any_token=True)
                continue
            if status is Status.ABORTED:  # only if the engine itself failed: no [DONE]
                break
            finished = status is Status.FINISHED
            payload = chunks.role(running) if chunks.chat and not sent else b""
            finish = seq.finish_reason if finished else None
            payload += chunks.tokens(generated - sent, finish, running)
            await resp.write(payload)
            stats.stream_chunks += 1
            stats.packed_chunks += generated - sent > 1
            sent = generated
            written += 1
            if reset_after is not None and written >= reset_after:
                state.fired("reset")
                assert request.transport is not None
                request.transport.abort()  # like a crashed pod: no final chunk, no [DONE]
                return resp
            if finished:
                if include_usage:
                    await resp.write(chunks.usage(seq))
                await resp.write(b"data: [DONE]\n\n")
                break
            if interval:
                await seq.wait(any_token=False, limit_s=interval)
        await resp.write_eof()
        return resp
    except ConnectionResetError:  # the client (the gateway) hung up: the caller aborts the sequence
        return resp


def _answer(chunks: _Chunks, seq: Sequence) -> dict[str, Any]:
    text = chunks.token_text * seq.generated
    if chunks.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": seq.finish_reason,
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": seq.finish_reason,
            "stop_reason": None,
        }
    return {
        "id": chunks.rid,
        "object": "chat.completion" if chunks.chat else "text_completion",
        "created": chunks.created,
        "model": chunks.model,
        "choices": [choice],
        "usage": _usage(seq, chunks.details),
    }


def _anthropic_error(answer: web.Response) -> web.Response:
    """vLLM's error, as its Anthropic router translates it (`translate_error_response`)."""
    assert isinstance(answer.body, bytes)
    error = orjson.loads(answer.body)["error"]
    body = {"type": "error", "error": {"type": error["type"], "message": error["message"]}}
    return web.Response(
        status=answer.status, body=orjson.dumps(body), content_type="application/json"
    )


def _as_chat(body: dict[str, Any], encoder: PromptEncoder) -> dict[str, Any] | web.Response:
    """A messages request as vLLM's Anthropic serving converts it to a chat
    (gateway/api/anthropic.py `to_chat`, the gateway's copy of that conversion)."""
    if type(body.get("max_tokens")) is not int:
        return bad_request("max_tokens: Field required", "max_tokens")
    template = getattr(encoder, "template", None)
    merge = template.merges_inline_system if template is not None else False
    effort = template.disabled_thinking_effort if template is not None else "none"
    try:
        return {**to_chat(body, merge, effort), "max_tokens": body["max_tokens"]}
    except (KeyError, TypeError, AttributeError) as exc:  # vLLM's request model would refuse
        return bad_request(f"invalid messages request: {exc!r}", "messages")


async def _generate(
    request: web.Request, chat: bool, anthropic: bool = False, responses_api: bool = False
) -> web.StreamResponse:
    answer = await _serve(request, chat, anthropic, responses_api)
    if anthropic and answer.status >= 400 and isinstance(answer, web.Response):
        return _anthropic_error(answer)
    return answer


async def _request_body(request: web.Request, state: ReplicaState) -> dict[str, Any] | web.Response:
    """The request's JSON object, or the answer vLLM would give instead: an injected fault, a
    body that is not a JSON object, a model it does not serve."""
    failure = state.dice.error(state.faults)
    if failure is not None:
        state.fired("error")
        kind = "InternalServerError" if failure == 500 else "ServiceUnavailableError"
        return error_response(failure, "injected fault", kind)
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return bad_request(f"invalid JSON body: {exc}")
    if not isinstance(body, dict):
        return bad_request("the body must be a JSON object")
    model = body.get("model")
    if model not in state.model_names and model not in state.adapters:
        return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    return body


async def _serve(
    request: web.Request, chat: bool, anthropic: bool, responses_api: bool
) -> web.StreamResponse:
    state = request.app[REPLICA]
    engine = state.engine
    body = await _request_body(request, state)
    if isinstance(body, web.Response):
        return body
    model = body["model"]
    encoder = state.encoder
    prompt_body = body
    if anthropic:
        converted = _as_chat(body, encoder)
        if isinstance(converted, web.Response):
            return converted
        prompt_body = converted
    elif responses_api:
        previous = body.get("previous_response_id")
        stored = None if previous is None else state.responses.get(previous)
        if previous is not None and stored is None:
            return responses.not_found(previous)
        try:
            prompt_body = responses.conversation(body, stored)
        except BadRequest as exc:
            return bad_request(exc.message, "input")
        # Its tokenization keeps the special tokens a chat completion's leaves out.
        prompt_body |= {"max_tokens": body.get("max_output_tokens"), "add_special_tokens": True}
    try:
        ids = await (
            encoder.encode_chat(prompt_body) if chat else encoder.encode_completion(prompt_body)
        )
    except PromptError as exc:
        return bad_request(str(exc), "messages" if chat else "prompt")
    max_tokens = _max_tokens(prompt_body, chat, len(ids), state.profile.serving.max_model_len)
    if isinstance(max_tokens, web.Response):
        return max_tokens
    # vLLM stamps arrival once the prompt is tokenized; an injected delay counts against it.
    received = engine.now()
    if state.faults.first_token_delay_s:
        state.fired("first_token_delay")
        await asyncio.sleep(state.faults.first_token_delay_s / engine.time_scale)
    # vLLM's Anthropic request model has no ignore_eos: a messages request never forces it.
    ignore_eos = bool(body.get("ignore_eos")) and not anthropic
    seq = engine.submit(ids, max_tokens, ignore_eos=ignore_eos)
    seq.arrival = received
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if responses_api:
        rid = responses.new_id(body)
    details = state.options.enable_prompt_tokens_details
    chunks = _Chunks(chat, rid, model, state.encoder.token_text, details)

    def store(response: dict[str, Any]) -> None:
        if body.get("store", True) is not False:
            state.responses.put(rid, responses.Stored(response, prompt_body["messages"]))

    try:
        if body.get("stream"):
            if anthropic:
                return await _typed_stream(request, state, seq, _AnthropicFraming(chunks, seq))
            if responses_api:
                framing = _ResponsesFraming(chunks, seq, body, store)
                return await _typed_stream(request, state, seq, framing)
            return await _stream(request, state, seq, chunks, body)
        await seq.wait(any_token=False)
        if seq.status is not Status.FINISHED:
            return error_response(500, "the simulated engine failed", "InternalServerError")
        if responses_api:
            text = chunks.token_text * seq.generated
            answer = responses.response_object(body, rid, model, "completed", text, seq)
            store(answer)
        else:
            answer = _anthropic_answer(chunks, seq) if anthropic else _answer(chunks, seq)
        return web.Response(
            body=orjson.dumps(answer), content_type="application/json", headers=state.headers
        )
    finally:
        engine.abort(seq)  # a client that left, a reset, a crash: free its blocks; else a no-op


def _stop_reason(seq: Sequence) -> str:
    """`_to_anthropic_stop_reason` for a text answer."""
    return "max_tokens" if seq.finish_reason == "length" else "end_turn"


def _anthropic_usage(seq: Sequence, details: bool) -> dict[str, int]:
    """`_build_anthropic_usage`: the cache's share split off the input, when vLLM reports it."""
    if not details:
        return {"input_tokens": seq.prompt_tokens, "output_tokens": seq.generated}
    return {"input_tokens": seq.prompt_tokens - seq.cached_tokens,
            "cache_read_input_tokens": seq.cached_tokens, "output_tokens": seq.generated}  # fmt: skip


def _anthropic_answer(chunks: _Chunks, seq: Sequence) -> dict[str, Any]:
    """vLLM's `messages_full_converter`, dumped without nulls."""
    return {
        "id": chunks.rid,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": chunks.token_text * seq.generated}],
        "model": chunks.model,
        "stop_reason": _stop_reason(seq),
        "usage": _anthropic_usage(seq, chunks.details),
    }


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class _AnthropicFraming:
    """vLLM's `message_stream_converter` over a text stream: `message_start` (the prompt's
    usage), a text block's start, one `content_block_delta` per chunk, its stop, `message_delta`
    (stop reason and the final usage), `message_stop`."""

    def __init__(self, chunks: _Chunks, seq: Sequence) -> None:
        self.chunks, self.seq = chunks, seq

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.chunks.rid, "type": "message", "role": "assistant", "content": [],
            "model": self.chunks.model, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.seq.prompt_tokens, "output_tokens": 0},
        }  # fmt: skip
        return _event("message_start", {"type": "message_start", "message": message})

    def first(self) -> bytes:
        start = {"type": "content_block_start", "content_block": {"type": "text", "text": ""},
                 "index": 0}  # fmt: skip
        return _event("content_block_start", start)

    def delta(self, text: str) -> bytes:
        delta = {"type": "text_delta", "text": text}
        return _event(
            "content_block_delta", {"type": "content_block_delta", "delta": delta, "index": 0}
        )

    def end(self, sent: int) -> bytes:
        end = b""
        if sent:
            end += _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        stop = {"stop_reason": _stop_reason(self.seq), "stop_sequence": None}
        usage = _anthropic_usage(self.seq, self.chunks.details)
        end += _event("message_delta", {"type": "message_delta", "delta": stop, "usage": usage})
        return end + _event("message_stop", {"type": "message_stop"})


class _ResponsesFraming:
    """The Responses API's typed events (loadtest/sim/responses.py); the answer is stored once
    it is whole."""

    def __init__(self, chunks: _Chunks, seq: Sequence, body: dict[str, Any], done: Any) -> None:
        self.chunks, self.seq, self.body, self.done = chunks, seq, body, done
        self.events = responses.EventWriter()
        self.item = f"msg_{chunks.rid[5:]}"

    def _response(self, status: str, seq: Sequence | None) -> dict[str, Any]:
        text = self.chunks.token_text * self.seq.generated
        return responses.response_object(
            self.body, self.chunks.rid, self.chunks.model, status, text, seq
        )

    def start(self) -> bytes:
        return b""

    def first(self) -> bytes:
        return responses.opening(self.events, self._response("in_progress", None), self.item)

    def delta(self, text: str) -> bytes:
        return responses.delta(self.events, self.item, text)

    def end(self, sent: int) -> bytes:
        response = self._response("completed", self.seq)
        self.done(response)
        opened = b"" if sent else self.first()
        return opened + responses.closing(self.events, response, self.item)


async def _typed_stream(
    request: web.Request, state: ReplicaState, seq: Sequence, framing: Any
) -> web.StreamResponse:
    """A stream of typed events (Anthropic's, the Responses API's): `framing.start()`, its
    `first()` before the first token, one `delta` per chunk, its `end` once finished. Faults
    as `_stream`'s."""
    reset_after = state.dice.reset_after(state.faults)
    interval = state.stream_interval_s
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **state.headers}
    )
    try:
        await resp.prepare(request)
        await resp.write(framing.start())
        sent = written = 0
        while True:
            generated, status = seq.generated, seq.status
            if generated == sent and not seq.done:
                await seq.wait(any_token=True)
                continue
            if status is Status.ABORTED:
                break
            payload = framing.first() if not sent and generated else b""
            if generated > sent:
                payload += framing.delta(state.encoder.token_text * (generated - sent))
            if payload:
                await resp.write(payload)
                state.engine.stats.stream_chunks += 1
            written += 1
            if reset_after is not None and written >= reset_after:
                state.fired("reset")
                assert request.transport is not None
                request.transport.abort()
                return resp
            if status is Status.FINISHED:
                await resp.write(framing.end(generated))
                break
            sent = generated
            if interval:
                await seq.wait(any_token=False, limit_s=interval)
        await resp.write_eof()
        return resp
    except ConnectionResetError:
        return resp


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's Messages API as vLLM serves it: converted to a chat, generated as one."""
    return await _generate(request, chat=True, anthropic=True)


async def create_response(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API as vLLM serves it: converted to a chat, generated as one."""
    return await _generate(request, chat=True, responses_api=True)


AUDIO_BYTES_PER_TOKEN = 1000  # the encoder's frames a transcription prefills, per upload byte
TRANSCRIPT_TOKENS = 8


async def transcriptions(request: web.Request) -> web.Response:
    """A speech-to-text upload (`file`, `model`), transcription or translation: prefill work in
    proportion to the audio's bytes, a short text generated, `{"text": ...}` answered (with
    the audio's seconds as `usage`, vLLM's, which the gateway does not read). No speech model
    runs: it is the work, not the words, that a gateway in front has to admit."""
    state = request.app[REPLICA]
    form = await request.post()
    model, audio = form.get("model"), form.get("file")
    if model not in state.model_names:
        return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    if not isinstance(audio, web.FileField):
        return bad_request("file: Field required", "file")
    size = len(audio.file.read())
    limit = state.profile.serving.max_model_len - TRANSCRIPT_TOKENS
    seq = state.engine.submit(
        max(1, min(size // AUDIO_BYTES_PER_TOKEN, limit)), TRANSCRIPT_TOKENS, ignore_eos=True
    )
    try:
        await seq.wait(any_token=False)
    finally:
        state.engine.abort(seq)
    seconds = max(1, size // 32_000)  # 16 kHz, 16-bit mono
    text = state.encoder.token_text * seq.generated
    return web.json_response({"text": text, "usage": {"type": "duration", "seconds": seconds}})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


def _embedding_bodies(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One encoder body per prompt of an embeddings request, in vLLM's shapes: texts or token ids
    (`input`), or conversations (`messages`, or `input` holding them) rendered without a
    generation prompt."""
    messages = body["messages"] if "messages" in body else body.get("input")
    convs = (
        [messages]
        if isinstance(messages, list) and messages and isinstance(messages[0], dict)
        else messages
    )
    if (
        isinstance(convs, list)
        and convs
        and all(isinstance(c, list) and c and all(isinstance(m, dict) for m in c) for c in convs)
    ):
        options = {k: body[k] for k in ("add_special_tokens", "chat_template_kwargs") if k in body}
        generation = body.get("add_generation_prompt", False)
        return [
            {"messages": c, "add_generation_prompt": generation, "chat": True, **options}
            for c in convs
        ]
    prompt = body.get("input")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
    ):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise PromptError("'input' must be a string, an array of strings or token ids")
    special = (
        {"add_special_tokens": body["add_special_tokens"]} if "add_special_tokens" in body else {}
    )
    return [{"prompt": p, **special} for p in prompt]


def _embedding(index: int, ids: Any, dimensions: int, base64: bool) -> dict[str, Any]:
    """A deterministic unit-free vector per prompt: its shape is what a client reads."""
    values = [((hash(tuple(ids[:8])) >> (4 * i)) & 0xFF) / 255.0 for i in range(dimensions)]
    vector: Any = values
    if base64:
        vector = b64.b64encode(struct.pack(f"<{dimensions}f", *values)).decode()
    return {"index": index, "object": "embedding", "embedding": vector}


def _pair_bodies(body: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """A scoring request's pairs, as a cross-encoder (or an LLM reranker) sees them: each pair's
    first and second text joined into one prompt."""
    if "rerank" in path:
        first, second = body.get("query"), body.get("documents")
    else:
        names = ("queries", "documents"), ("queries", "items"), ("data_1", "data_2")
        one, two = next((n for n in names if n[0] in body and n[1] in body), ("text_1", "text_2"))
        first, second = body.get(one), body.get(two)
    firsts = [first] if isinstance(first, str) else first
    seconds = [second] if isinstance(second, str) else second
    if not (
        isinstance(firsts, list)
        and isinstance(seconds, list)
        and firsts
        and seconds
        and all(isinstance(t, str) for t in [*firsts, *seconds])
        and len(firsts) in (1, len(seconds))
    ):
        raise PromptError("a scoring request needs texts: one or as many first texts as second")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    return [{"prompt": a + b} for a, b in zip(firsts, seconds, strict=True)]


def _score(ids: Any) -> float:
    return (hash(tuple(ids[:8])) & 0xFFFF) / 65535.0


def _pooling_answer(
    path: str, body: dict[str, Any], model: str, prompts: list[Any], tokens: int
) -> dict[str, Any]:
    """vLLM's answer of each pooling endpoint, its values deterministic from the prompt."""
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    head = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time())}
    if "rerank" in path:
        documents = (
            body["documents"] if isinstance(body["documents"], list) else [body["documents"]]
        )
        results = sorted(
            (
                {"index": i, "document": {"text": documents[i]}, "relevance_score": _score(ids)}
                for i, ids in enumerate(prompts)
            ),
            key=lambda r: -r["relevance_score"],
        )
        top_n = body.get("top_n") if type(body.get("top_n")) is int else 0
        usage.pop("completion_tokens")
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": model,
            "usage": usage,
            "results": results[:top_n] if top_n > 0 else results,
        }
    if "score" in path:
        data = [
            {"index": i, "object": "score", "score": _score(ids)} for i, ids in enumerate(prompts)
        ]
    elif path == "/classify":
        data = [
            {"index": i, "label": "LABEL_0", "probs": [p := _score(ids), 1 - p], "num_classes": 2}
            for i, ids in enumerate(prompts)
        ]
    elif path == "/pooling":
        data = [
            {"index": i, "object": "pooling", "data": _embedding(i, ids, 8, False)["embedding"]}
            for i, ids in enumerate(prompts)
        ]
    else:
        dimensions = body.get("dimensions") if type(body.get("dimensions")) is int else 8
        base64 = body.get("encoding_format") == "base64"
        data = [
            _embedding(i, ids, max(1, min(dimensions, 4096)), base64)
            for i, ids in enumerate(prompts)
        ]
    return {**head, "model": model, "data": data, "usage": usage}


async def pooling(request: web.Request) -> web.Response:
    """vLLM's pooling endpoints (`/v1/embeddings`, `/classify`, `/pooling`, `/rerank`, `/score`
    and their aliases) as prefill-only work: each prompt is scheduled for its prefill (and the
    one step that ends it); the answer is vLLM's, `usage` with the prompts' tokens. A scoring
    pair is one prompt, its two texts joined (a cross-encoder's work)."""
    state = request.app[REPLICA]
    engine = state.engine
    body = await _request_body(request, state)
    if isinstance(body, web.Response):
        return body
    model = body["model"]
    limit = state.profile.serving.max_model_len
    path = request.path
    scoring = "rerank" in path or "score" in path
    prompts = []
    try:
        for one in _pair_bodies(body, path) if scoring else _embedding_bodies(body):
            chat = one.pop("chat", False)
            prompts.append(
                await (
                    state.encoder.encode_chat(one) if chat else state.encoder.encode_completion(one)
                )
            )
    except PromptError as exc:
        return bad_request(str(exc), "input")
    for ids in prompts:
        if len(ids) > limit:
            return bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested"
                f" {len(ids)} tokens in the input for embedding generation. Please reduce the"
                " length of the input.",
                "input",
            )
    seqs = [engine.submit(ids, 1, ignore_eos=True) for ids in prompts]
    try:
        for seq in seqs:
            await seq.wait(any_token=False)
            if seq.status is not Status.FINISHED:
                return error_response(500, "the simulated engine failed", "InternalServerError")
        tokens = sum(seq.prompt_tokens for seq in seqs)
        answer = _pooling_answer(path, body, model, prompts, tokens)
        return web.Response(
            body=orjson.dumps(answer), content_type="application/json", headers=state.headers
        )
    finally:
        for seq in seqs:
            engine.abort(seq)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# What the replica does with each kind of endpoint the gateway admits, by `Api` class (the
# nearest in an API's class hierarchy wins); every path of each is served (`serve_apis`).
SERVED: dict[type[Api], Handler] = {
    ChatApi: chat_completions,
    CompletionsApi: completions,
    MessagesApi: messages,
    ResponsesApi: create_response,
    PoolingApi: pooling,
    SpeechToTextApi: transcriptions,
}


def handler_of(api: Api) -> Handler:
    """The handler for `api`'s requests; an endpoint the simulator cannot serve fails here, at
    start, so a benchmark never measures a 404."""
    for cls in type(api).__mro__:
        if cls in SERVED:
            return SERVED[cls]
    raise RuntimeError(
        f"the simulated replica serves no {api.name} ({api.path}): add its Api class to"
        " loadtest/sim/server.py SERVED"
    )


def serve_apis(app: web.Application) -> None:
    """A POST route for every path of every endpoint the gateway admits."""
    for api in APIS:
        for path in (api.path, *api.aliases):
            app.router.add_post(path, handler_of(api))


async def models(request: web.Request) -> web.Response:
    state = request.app[REPLICA]
    data = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "root": name,
            "parent": None,
            "max_model_len": state.profile.serving.max_model_len,
        }
        for name in state.model_names
    ]
    # vLLM's adapter card (vllm/entrypoints/openai/models/serving.py, show_available_models).
    data += [
        {"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": path,
         "parent": state.model_names[0], "max_model_len": None}
        for name, path in state.adapters.items()
    ]  # fmt: skip
    return web.Response(
        body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
    )


async def health(request: web.Request) -> web.Response:
    task = request.app[REPLICA].engine_task
    alive = task is not None and not task.done()
    return web.Response(status=200 if alive else 500)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REPLICA].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def kv_event_sources(request: web.Request) -> web.Response:
    """vLLM's publisher config per data-parallel rank; `{}` when it publishes nothing."""
    publisher = request.app[REPLICA].publisher
    sources = {} if publisher is None else {"0": publisher.source()}
    return web.Response(body=orjson.dumps(sources), content_type="application/json")


def _fault_report(state: ReplicaState) -> web.Response:
    report = {"faults": state.faults.model_dump(), "now_s": state.engine.now()}
    return web.Response(body=orjson.dumps(report), content_type="application/json")


async def get_faults(request: web.Request) -> web.Response:
    return _fault_report(request.app[REPLICA])


async def post_faults(request: web.Request) -> web.Response:
    state = request.app[REPLICA]
    try:
        faults = Faults.model_validate_json(await request.read())
    except ValidationError as exc:
        return bad_request(f"invalid fault set: {exc}")
    try:
        state.set_faults(faults)
    except ValueError as exc:
        return error_response(409, str(exc), "ConflictError")
    return _fault_report(state)


async def _run_engine(app: web.Application) -> AsyncIterator[None]:
    state = app[REPLICA]
    config = state.options.kv_events_config
    if config is not None and config.publishing:
        state.publisher = KVEventPublisher(config)
        state.engine.publish_kv_events(state.publisher)
    state.engine_task = asyncio.create_task(state.engine.run(), name="sim-engine")
    state.set_faults(state.options.faults)
    yield
    state.engine_task.cancel()
    await asyncio.gather(state.engine_task, return_exceptions=True)  # a crash was logged
    if state.publisher is not None:
        state.publisher.close()


def create_replica_app(profile: Profile, options: ReplicaOptions | None = None) -> web.Application:
    """The aiohttp app of one replica; its engine runs while the app does."""
    options = options or ReplicaOptions()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[REPLICA] = ReplicaState(profile, options)
    serve_apis(app)
    retrieve, cancel = responses.stored_handlers(lambda request: request.app[REPLICA].responses)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_get("/admin/faults", get_faults)
    app.router.add_post("/admin/faults", post_faults)
    app.cleanup_ctx.append(_run_engine)
    return app


class Replica:
    """A replica listening on a loopback port (see `start_replica`)."""

    def __init__(self, app: web.Application, runner: web.AppRunner, host: str) -> None:
        self.app = app
        self.state = app[REPLICA]
        self.host = host
        self.port = 0
        self._runner = runner
        self._site: web.TCPSite | None = None
        self._refusal: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine(self) -> Engine:
        return self.state.engine

    def set_faults(self, faults: Faults) -> None:
        """Replace the fault set at run time (what POST /admin/faults does)."""
        if self._refusal is not None and not faults.refuse_for_s:
            self._refusal.cancel()  # clearing the faults ends a refusal early
        self.state.set_faults(faults)

    async def _listen(self, port: int) -> None:
        self._site = web.TCPSite(self._runner, self.host, port, reuse_address=True)
        await self._site.start()
        self.port = self._site.port

    def _refuse(self, seconds: float) -> None:
        if self._refusal is not None:
            self._refusal.cancel()
        self._refusal = asyncio.create_task(self._refuse_for(seconds / self.engine.time_scale))

    async def _refuse_for(self, wall_s: float) -> None:
        if self._site is not None:
            await self._site.stop()  # stops listening; open connections go on
            self._site = None
        try:
            await asyncio.sleep(wall_s)
        finally:
            await self._listen(self.port)

    async def close(self) -> None:
        if self._refusal is not None:
            self._refusal.cancel()
            await asyncio.gather(self._refusal, return_exceptions=True)
        await self._runner.cleanup()


async def start_replica(
    profile: Profile,
    options: ReplicaOptions | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
) -> Replica:
    """Serve one replica on `host:port` (0: an ephemeral port); `await replica.close()` after."""
    options = options or ReplicaOptions()
    refuse_s = options.faults.refuse_for_s
    # The app applies the start-up faults, but a refusal must wait until there is a listener.
    app = create_replica_app(
        profile, replace(options, faults=options.faults.model_copy(update={"refuse_for_s": 0}))
    )
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2)
    await runner.setup()
    replica = Replica(app, runner, host)
    replica.state.refuser = replica._refuse
    try:
        await replica._listen(port)
    except BaseException:
        await runner.cleanup()
        raise
    if refuse_s:
        replica.state.faults = options.faults
        replica.state.fired("refuse")
        replica._refuse(refuse_s)
    return replica
