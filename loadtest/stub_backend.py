"""A stub OpenAI-compatible replica: answers at once (or after a set delay), streams real SSE.

It is the zero-delay backend of the overhead benchmark and the replica of the gateway's tests: it
speaks vLLM's wire format (chat and completions, `stream_options.include_usage` final chunk with
`choices: []`, with `continuous_usage_stats` the running usage on every chunk, `data: [DONE]`), takes OTLP/HTTP traces (`POST /v1/traces`, dropped), and records what the tests assert on — the bodies it received, how
many requests it ran at once, and how many connections its clients closed mid-answer.

    python -m loadtest.stub_backend --port 9000 [--delay 0.5] [--chunk-delay 0.01] [--no-record]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

DEFAULT_OUTPUT_TOKENS = 16


@dataclass
class StubConfig:
    delay_s: float = 0.0  # before the first token
    chunk_delay_s: float = 0.0  # between streamed tokens
    status: int = 200  # anything else answers with a vLLM-shaped error
    served_models: tuple[str, ...] = ()  # empty: any model
    record: bool = True  # keep every body and header for tests; benchmarks turn it off
    # usage.prompt_tokens to report. None reports none: the stub has no tokenizer, and the gateway
    # settles a tenant's tokens on a replica's count, so a guess would skew every window.
    prompt_tokens: int | None = None
    # A test's hold on the answers: each waits, counted as running, until it is set.
    gate: asyncio.Event | None = None


@dataclass
class StubStats:
    running: int = 0
    max_running: int = 0
    requests: int = 0
    completed: int = 0
    disconnects: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)


STATS = web.AppKey("stats", StubStats)
CONFIG = web.AppKey("config", StubConfig)


def _usage(prompt_tokens: int | None, completion_tokens: int) -> dict[str, int]:
    if prompt_tokens is None:
        return {"completion_tokens": completion_tokens, "total_tokens": completion_tokens}
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _chunk(kind: str, rid: str, model: str, index: int, token: str | None) -> dict[str, Any]:
    if kind == "chat":
        delta = {"content": token} if token is not None else {}
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta if index else {"role": "assistant", **delta},
            "logprobs": None,
            "finish_reason": None if token is not None else "length",
        }
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0,
            "text": token or "",
            "logprobs": None,
            "finish_reason": None if token is not None else "length",
        }
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


async def _answer(request: web.Request, kind: str) -> web.StreamResponse:
    stats, config = request.app[STATS], request.app[CONFIG]
    body = orjson.loads(await request.read())
    stats.requests += 1
    if config.record:
        stats.bodies.append(body)
        stats.headers.append({k.lower(): v for k, v in request.headers.items()})
    model = body.get("model", "")
    if config.served_models and model not in config.served_models:
        err = {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                         "param": "model", "code": 404}}  # fmt: skip
        return web.json_response(err, status=404)
    if config.status != 200:
        err = {"error": {"message": "stub failure", "type": "InternalServerError", "param": None,
                         "code": config.status}}  # fmt: skip
        return web.json_response(err, status=config.status)
    tokens = int(
        body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_OUTPUT_TOKENS
    )
    prompt_tokens = config.prompt_tokens
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{stats.requests}"
    stats.running += 1
    stats.max_running = max(stats.max_running, stats.running)
    try:
        if config.gate is not None:
            await config.gate.wait()
        if config.delay_s:
            await asyncio.sleep(config.delay_s)
        if not body.get("stream"):
            text = " tok" * tokens
            if kind == "chat":
                choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": "length"}  # fmt: skip
            else:
                choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
            result = {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                      "created": int(time.time()), "model": model, "choices": [choice],
                      "usage": _usage(prompt_tokens, tokens)}  # fmt: skip
            stats.completed += 1
            return web.Response(body=orjson.dumps(result), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        options = body.get("stream_options") or {}
        running = options.get("include_usage") and options.get("continuous_usage_stats")
        for index in range(tokens + 1):  # a token each, then the finish reason with none
            if 0 < index < tokens and config.chunk_delay_s:
                await asyncio.sleep(config.chunk_delay_s)
            chunk = _chunk(kind, rid, model, index, " tok" if index < tokens else None)
            if running:  # vLLM's `continuous_usage_stats`: the count so far on every chunk
                chunk["usage"] = _usage(prompt_tokens, min(index + 1, tokens))
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if options.get("include_usage"):
            final = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                     "created": int(time.time()), "model": model, "choices": [],
                     "usage": _usage(prompt_tokens, tokens)}  # fmt: skip
            await resp.write(b"data: " + orjson.dumps(final) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        stats.completed += 1
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        stats.disconnects += 1
        raise
    finally:
        stats.running -= 1


async def chat(request: web.Request) -> web.StreamResponse:
    return await _answer(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _answer(request, "completions")


async def health(request: web.Request) -> web.Response:
    return web.Response()


async def traces(request: web.Request) -> web.Response:
    """An OTLP/HTTP traces sink (a collector's answer, the spans dropped): the gateway's
    traces have somewhere to go in a benchmark."""
    await request.read()
    return web.Response(body=b"", content_type="application/x-protobuf")


def create_stub_app(config: StubConfig | None = None) -> web.Application:
    app = web.Application()
    app[STATS] = StubStats()
    app[CONFIG] = config or StubConfig()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/traces", traces)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--chunk-delay", type=float, default=0.0)
    parser.add_argument(
        "--no-record",
        action="store_true",
        help="do not keep request bodies (tests read them; over a benchmark they grow the heap)",
    )
    args = parser.parse_args()
    import uvloop

    config = StubConfig(
        delay_s=args.delay, chunk_delay_s=args.chunk_delay, record=not args.no_record
    )
    app = create_stub_app(config)
    uvloop.run(web._run_app(app, host=args.host, port=args.port, print=None, access_log=None,
                            handler_cancellation=True))  # fmt: skip


if __name__ == "__main__":
    main()
