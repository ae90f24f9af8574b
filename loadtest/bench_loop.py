"""How long a hostile replica or request holds the gateway's event loop (issue 35, promise L).

The gateway runs as `llm-gateway serve` does, in its own process (uvloop, its heap frozen once
the policy is loaded), with Qwen 3's real tokenizer (`loadtest/real_tokenizers.py`). A `/healthz`
ticker in this process asks every 10 ms; each figure is its worst answer time during one attack,
beside the same ticker's worst over a quiet second (the baseline). On 127.0.0.1 only, each attack
bounded:
- `usage`: the replica streams 8 writes of 256 KB of tiny events that all carry `"usage"`;
- `tools <endpoint>`: 9,000 minimal tools (~0.5 MB) on chat, Responses, Messages,
  count_tokens and `/tokenize` (the second such request: the first is `first`'s);
- `first`, `second`, `third`: the first jobs on the tokenizer threads after start (a chat that
  is parsed, rendered and encoded there, `_chat`), and `reload first`, `reload second` after a reload that builds new
  counters (the model's `max_model_len` changed);
- `kv event`: a `BlockStored` of ~350,000 one-token blocks within the 1 MiB event bound;
  `kv batch`: a 4 MiB batch of ~4 million one-byte events.

`--threads` measures what a tokenizer thread's job costs, in this process instead: the CPU of a
thread's first encode (42,000 characters of prose) and of its next, per real tokenizer and
library; and the longest the loop goes without a turn (a 1 ms ticker) while a thread renders
Qwen 3's template for 2,047 messages (Python, under the GIL) or encodes (outside it), at three
GIL switch intervals.

    python -m loadtest.bench_loop [--rounds 3] [--threads]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import orjson
import yaml
import zmq
import zmq.asyncio
from aiohttp import web

from loadtest import processes
from loadtest.real_tokenizers import directory

TICK_S = 0.01
TOOLS = 9000
USAGE_EVENT = b'data: {"usage":0}\n\n'
PROSE = "product rules prohibit weapons drugs review listing seller brand price "


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _replica(request: web.Request) -> web.StreamResponse:
    """A replica: a stream of tiny usage-bearing events, or a one-token answer."""
    body = await request.json()
    if body.get("stream"):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        run = USAGE_EVENT * (256 * 1024 // len(USAGE_EVENT))
        for _ in range(8):
            await resp.write(run)
        await resp.write(b"data: [DONE]\n\n")
        return resp
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return web.json_response(
        {"id": "x", "object": "chat.completion", "choices": [], "usage": usage}
    )


def _policy(tokenizer: Path, replica: str, kv_endpoint: str, max_model_len: int) -> dict[str, Any]:
    pick = {"scorers": {"precise_prefix": {"weight": 1, "endpoint": kv_endpoint, "retry_s": 0.1}}}
    return {
        "models": {"qwen": {"tokenizer": str(tokenizer), "max_model_len": max_model_len}},
        "pools": {
            "main": {"model": "qwen", "replicas": [replica], "max_concurrency": 8, "pick": pick}
        },
        "classes": [{"name": "any", "when": {}}],
        "routes": [{"match": {"model": "qwen"}, "pool": "main"}],
    }


def _tools(path: str) -> bytes:
    message = [{"role": "user", "content": "hi"}]
    if path == "/v1/responses":
        tools: list[Any] = [{"type": "function", "name": f"f{i}"} for i in range(TOOLS)]
        return orjson.dumps({"model": "qwen", "input": "hi", "tools": tools})
    if path.startswith("/v1/messages"):
        tools = [{"name": f"f{i}", "input_schema": {}} for i in range(TOOLS)]
        body = {"model": "qwen", "max_tokens": 16, "messages": message, "tools": tools}
        return orjson.dumps(body)
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(TOOLS)]
    return orjson.dumps({"model": "qwen", "messages": message, "tools": tools})


def _chat(tag: str) -> bytes:
    """A chat that takes every job the tokenizer threads do: a body over 32 KB (parsed there),
    300 messages (rendered there), 40,000 characters (encoded there)."""
    roles = ("user", "assistant")
    turns = [{"role": roles[i % 2], "content": f"{tag} {PROSE * 2}"} for i in range(299)]
    turns.append({"role": "user", "content": PROSE * 300})
    return orjson.dumps({"model": "qwen", "messages": turns, "max_tokens": 1})


class Ticker:
    """Asks `/healthz` every `TICK_S`; `worst` is the slowest answer (less the sleep) since the
    last `reset`."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url, self.worst = http, url, 0.0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(TICK_S)
            async with self.http.get(f"{self.url}/healthz") as resp:
                await resp.read()
            self.worst = max(self.worst, time.perf_counter() - started - TICK_S)

    async def during(self, attack: Callable[[], Awaitable[object]]) -> float:
        await asyncio.sleep(0.1)
        self.worst = 0.0
        await attack()
        await asyncio.sleep(2 * TICK_S)  # a hold at the very end shows in the next answer
        return self.worst


async def _post(http: aiohttp.ClientSession, url: str, raw: bytes) -> None:
    headers = {"Content-Type": "application/json"}
    async with http.post(url, data=raw, headers=headers) as resp:
        await resp.read()


async def _kv_counted(http: aiohttp.ClientSession, url: str, kinds: tuple[str, ...]) -> float:
    total = 0.0
    async with http.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("llm_kv_events_total") and any(f'"{k}"' in line for k in kinds):
                total += float(line.split()[-1])
    return total


async def _kv(http: aiohttp.ClientSession, url: str, pub: Any, seq: list[int], frames: bytes,
              kinds: tuple[str, ...]) -> None:  # fmt: skip
    """Publish one batch and wait until the gateway counted it as one of `kinds`."""
    before = await _kv_counted(http, url, kinds)
    await pub.send_multipart([b"", seq[0].to_bytes(8, "big"), frames], copy=False)
    seq[0] += 1
    async with asyncio.timeout(30):
        while await _kv_counted(http, url, kinds) <= before:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.05)


async def _round(tmp: Path, replica: str, results: dict[str, list[float]]) -> None:
    tokenizer = directory("qwen3")
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    kv_port = _free_port()
    pub.bind(f"tcp://127.0.0.1:{kv_port}")
    policy_path = tmp / "policy.yaml"
    policy = _policy(tokenizer, replica, f"tcp://127.0.0.1:{kv_port}", 262_144)
    policy_path.write_text(yaml.safe_dump(policy))
    port = _free_port()
    try:
        async with (
            processes.gateway(policy_path, port, tmp) as url,
            aiohttp.ClientSession() as http,
        ):
            ticker = Ticker(http, url)

            def note(name: str, value: float) -> None:
                results.setdefault(name, []).append(value)

            note("baseline", await ticker.during(lambda: asyncio.sleep(1)))
            completions = f"{url}/v1/completions"
            chats = f"{url}/v1/chat/completions"
            for n, name in enumerate(("first", "second", "third")):
                note(name, await ticker.during(partial(_post, http, chats, _chat(str(n)))))
            for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages",
                         "/v1/messages/count_tokens", "/tokenize"):  # fmt: skip
                attack = partial(_post, http, url + path, _tools(path))
                note(f"tools {path}", await ticker.during(attack))
            stream = orjson.dumps({"model": "qwen", "prompt": "hi", "stream": True})
            note("usage", await ticker.during(lambda: _post(http, completions, stream)))
            # A reload that builds the model's counters again.
            policy["models"]["qwen"]["max_model_len"] = 131_072
            policy_path.write_text(yaml.safe_dump(policy))
            os.kill(await _pid(port), signal.SIGHUP)
            await _until_model_len(http, url, 131_072)
            for n, name in enumerate(("reload first", "reload second")):
                note(name, await ticker.during(partial(_post, http, chats, _chat(f"r{n}"))))
            # KV-cache events: the pool's feed starts with its first request.
            seq = [0]
            await _post(http, completions, orjson.dumps({"model": "qwen", "prompt": "hi"}))
            async with asyncio.timeout(30):
                while not await _heard(http, url, pub, seq):  # noqa: ASYNC110 - another process
                    await asyncio.sleep(0.1)
            n = (1 << 20) // 3 - 400
            event = {"type": "BlockStored", "block_hashes": [1] * n, "parent_block_hash": None,
                     "token_ids": [1] * n, "block_size": 1}  # fmt: skip
            frames = msgspec.msgpack.encode([time.time(), [event], 0])
            kinds = ("BlockStored", "oversize")
            note("kv event", await ticker.during(lambda: _kv(http, url, pub, seq, frames, kinds)))
            frames = msgspec.msgpack.encode([time.time(), [0] * ((4 << 20) - 64), 0])
            kinds = ("unknown", "oversize_batch")
            note("kv batch", await ticker.during(lambda: _kv(http, url, pub, seq, frames, kinds)))
            ticker.task.cancel()
    finally:
        context.destroy(linger=0)


async def _heard(http: aiohttp.ClientSession, url: str, pub: Any, seq: list[int]) -> bool:
    """Whether the feed follows the publisher: an empty batch sent is counted as nothing, so a
    `BlockRemoved` of nothing is sent and looked for."""
    removed = {"type": "BlockRemoved", "block_hashes": [], "medium": "GPU"}
    before = await _kv_counted(http, url, ("BlockRemoved",))
    await pub.send_multipart(
        [b"", seq[0].to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [removed], 0])]
    )
    seq[0] += 1
    await asyncio.sleep(0.2)
    return await _kv_counted(http, url, ("BlockRemoved",)) > before


async def _pid(port: int) -> int:
    """The gateway's process id, by the port it listens on (ours, just started)."""
    proc = await asyncio.create_subprocess_exec(
        "ss", "-Hltnp", f"sport = :{port}", stdout=asyncio.subprocess.PIPE
    )
    out = (await proc.communicate())[0].decode()
    return int(out.split("pid=")[1].split(",")[0])


async def _until_model_len(http: aiohttp.ClientSession, url: str, length: int) -> None:
    async with asyncio.timeout(60):
        while True:
            async with http.get(f"{url}/v1/models") as resp:
                cards = (await resp.json())["data"]
            if any(card.get("max_model_len") == length for card in cards):
                return
            await asyncio.sleep(0.1)


def _first_encodes() -> None:
    from gateway.tokenizer.counters import HFCounter

    text = PROSE * 600
    for name in ("gemma3", "llama3", "qwen3"):
        for backend in ("fastokens", "tokenizers"):
            counter = HFCounter.load(str(directory(name)), backend=backend)  # type: ignore[arg-type]
            spent: list[float] = []

            def encode(tag: str, counter: Any = counter, spent: list[float] = spent) -> None:
                started = time.thread_time()
                counter.encoder.counts([text + tag], False)
                spent.append(time.thread_time() - started)

            worker = threading.Thread(target=lambda: (encode("a"), encode("b")))
            worker.start()
            worker.join()
            first, then = (f"{s * 1000:.1f}" for s in spent)
            print(
                f"{name} {counter.backend}: a new thread's first encode {first} ms CPU, next {then}"
            )


async def _gil_holds() -> None:
    from gateway.tokenizer.counters import HFCounter
    from gateway.tokenizer.threads import CountingThreads
    from tests.conftest import longest_loop_gap

    threads = CountingThreads(2, "tokenize")
    counter = HFCounter.load(str(directory("qwen3")), threads=threads)
    roles = ("user", "assistant")
    chat = {"messages": [{"role": roles[i % 2], "content": f"turn {i}"} for i in range(2047)]}
    text = PROSE * 600
    gc.collect()
    gc.freeze()  # as `serve` does
    try:
        for interval in (0.005, 0.002, 0.001):
            sys.setswitchinterval(interval)
            renders, encodes = [], []
            for n in range(5):
                work = threads.run(counter.template.render, chat)
                renders.append((await longest_loop_gap(work, tick_s=0.001))[1])
                work = threads.run(counter.encoder.counts, [text + str(n)], False)
                encodes.append((await longest_loop_gap(work, tick_s=0.001))[1])
            shown = [
                ", ".join(f"{g * 1000:.1f}" for g in sorted(gaps)) for gaps in (renders, encodes)
            ]
            print(f"switch interval {interval * 1000:g} ms: loop held while a thread renders"
                  f" {shown[0]} ms; encodes {shown[1]} ms")  # fmt: skip
    finally:
        threads.shutdown()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", action="store_true", help="the tokenizer threads' costs")
    args = parser.parse_args()
    if args.threads:
        _first_encodes()
        await _gil_holds()
        return
    app = web.Application()
    app.router.add_post("/{tail:.*}", _replica)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    replica = f"http://127.0.0.1:{runner.addresses[0][1]}"
    results: dict[str, list[float]] = {}
    try:
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                await _round(Path(tmp), replica, results)
    finally:
        await runner.cleanup()
    for name, values in results.items():
        shown = ", ".join(f"{v * 1000:.0f}" for v in values)
        print(f"{name:32} worst /healthz delay, ms: {shown}")


if __name__ == "__main__":
    asyncio.run(main())
