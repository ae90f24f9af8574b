"""What the running usage costs the stream relay, per event (issue 35, item 3).

The gateway asks vLLM for `continuous_usage_stats` on a one-sequence chat or completions stream,
so every chunk carries its running usage (what a client that leaves is settled on), and strips
it when the client did not ask. This times the relay's work on a run of whole events
(gateway/request/forward.py `_relayed`: account, drop the final usage chunk, strip), on vLLM's bytes as
the simulator writes them, in this process:
- `before`: the chunks without usage, as they came when the gateway asked `include_usage` only;
- `stripped`: with the running usage, stripped (a client that did not ask for it);
- `kept`: with the running usage, kept (a client that asked for it);
each at 1 event a run (a replica's stream interval: one chunk a read) and 16 (a read that
caught up), best of `--repeat` timings of `--events` events; and a hostile replica's 256 KB
run of unterminated usage keys against 256 KB of plain chunks.

    python -m loadtest.bench_relay [--events 20000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import time

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.api import CHAT
from gateway.context.ctx import Ctx
from gateway.request.forward import _relayed


def _chunk(tokens: int | None) -> bytes:
    """One chat chunk of one token as vLLM writes it; `tokens`: its running count, if asked."""
    head = (
        b'data: {"id":"chatcmpl-9f2c","object":"chat.completion.chunk","created":1765000000,'
        b'"model":"tiny","choices":[{"index":0,"delta":{"content":" tok"},"logprobs":null,'
        b'"finish_reason":null}]'
    )
    if tokens is None:
        return head + b"}\n\n"
    usage = {"prompt_tokens": 120, "total_tokens": 120 + tokens, "completion_tokens": tokens,
             "completion_tokens_details": None}  # fmt: skip
    return head + b',"usage":' + orjson.dumps(usage) + b"}\n\n"


def _ctx() -> Ctx:
    ctx = Ctx(request_id="r", api=CHAT, path="/v1/chat/completions",
              headers=CIMultiDictProxy(CIMultiDict()), arrived=0.0, stream=True)  # fmt: skip
    ctx.max_output = 1 << 30
    return ctx


def _time(runs: list[bytes], strip: bool, repeat: int) -> float:
    """Best seconds of `repeat` passes of the relay's work over `runs`, one stream each."""
    best = float("inf")
    for _ in range(repeat):
        ctx = _ctx()
        started = time.perf_counter()
        for run in runs:
            _relayed(ctx, run, True, strip)
        best = min(best, time.perf_counter() - started)
    return best


def _runs(events: int, per_run: int, running: bool) -> list[bytes]:
    chunks = [_chunk(i + 1 if running else None) for i in range(events)]
    return [b"".join(chunks[i : i + per_run]) for i in range(0, events, per_run)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    print(
        "| events a run | before ns/event | stripped ns/event | kept ns/event | stripped/before |"
    )
    print("|---:|---:|---:|---:|---:|")
    for per_run in (1, 16):
        plain = _runs(args.events, per_run, running=False)
        counted = _runs(args.events, per_run, running=True)
        before = _time(plain, False, args.repeat) / args.events * 1e9
        stripped = _time(counted, True, args.repeat) / args.events * 1e9
        kept = _time(counted, False, args.repeat) / args.events * 1e9
        print(
            f"| {per_run} | {before:.0f} | {stripped:.0f} | {kept:.0f} | {stripped / before:.2f} |"
        )
    size = 256 * 1024
    plain_run = (_chunk(None) * (size // len(_chunk(None)) + 1))[:size]
    plain_run = plain_run[: plain_run.rfind(b"\n\n") + 2]
    key = b'data: {"choices":[{"index":0}],"usage":{' + b"1" * 200 + b"\n\n"
    hostile = key * (size // len(key))
    reps = max(args.repeat, 20)
    plain_s = _time([plain_run], True, reps)
    hostile_s = _time([hostile], True, reps)
    print(
        f"\n256 KB run, stripped: plain chunks {plain_s * 1e3:.2f} ms, unterminated usage keys"
        f" {hostile_s * 1e3:.2f} ms ({hostile_s / plain_s:.1f}x)"
    )


if __name__ == "__main__":
    main()
