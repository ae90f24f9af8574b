"""The gateway's overhead in front of real vLLM (CPU build): tokens/s and TTFT, direct against
through the gateway, in the same run.

One vLLM server serves the tiny model (`loadtest.tiny_llama`), the gateway runs as its own process
(`python -m gateway serve`) with that vLLM as its only replica and caps that never queue. A streaming
chat load (about 100 input tokens, `max_tokens` output with `ignore_eos`, so every request makes the
same number of tokens) runs at each concurrency against both targets in alternating rounds, so a
drift of the machine during the run hits both alike. TTFT is the time from sending the request to
the first content chunk; tokens/s is the completion tokens of all requests of a round over its wall
time. The load generator is an asyncio client in this process; vLLM, the gateway and it share the
machine's two cores, as they would on one host.

    $VLLM_PYTHON ... (see `make bench-vllm`)
    .venv/bin/python -m loadtest.bench_vllm --vllm-python PY --model-dir DIR [--out FILE]

Everything is on 127.0.0.1; every round is bounded in requests and in time; vLLM and the gateway
are stopped in a `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from loadtest.overhead.fleet import Fleet, wait_ready
from loadtest.tiny_tokenizer import WORDS
from loadtest.vllm_server import MAX_MODEL_LEN, SERVED_NAME, free_port, serve_vllm

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "loadtest" / "out" / "bench-vllm.md"
LEVELS = ((1, 16), (8, 64))  # (concurrency, requests per round)
ROUNDS = 5
MAX_TOKENS = 128
ROUND_TIMEOUT_S = 120.0


@dataclass
class Round:
    target: str
    concurrency: int
    ttft_s: list[float]
    tokens: int
    wall_s: float


def prompt(i: int) -> str:
    """About 100 tokens, different per request, so no prefix cache makes one target faster."""
    words = [WORDS[(i * 7 + k * 13) % len(WORDS)] for k in range(90)]
    return f"request {i}: " + " ".join(words)


async def one(http: aiohttp.ClientSession, url: str, i: int) -> tuple[float, int]:
    """Stream one chat request; return its TTFT and completion tokens."""
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    ttft, tokens = None, 0
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - sent
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    assert ttft is not None and tokens == MAX_TOKENS
    return ttft, tokens


async def run_round(
    http: aiohttp.ClientSession, target: str, url: str, concurrency: int, requests: int, base: int
) -> Round:
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int) -> tuple[float, int]:
        async with gate:
            return await one(http, url, base + i)

    start = time.perf_counter()
    async with asyncio.timeout(ROUND_TIMEOUT_S):
        results = await asyncio.gather(*(gated(i) for i in range(requests)))
    wall = time.perf_counter() - start
    return Round(target, concurrency, [r[0] for r in results], sum(r[1] for r in results), wall)


def write_policy(workdir: Path, model_dir: Path, replica: str) -> Path:
    policy = {
        "models": {SERVED_NAME: {"tokenizer": str(model_dir), "max_model_len": MAX_MODEL_LEN}},
        "pools": {
            "vllm": {
                "model": SERVED_NAME,
                "replicas": [replica],
                "max_concurrency": 1000,
                "queue": {"max_depth": 1024, "max_wait_s": 30},
            }
        },
        "classes": [{"name": "any", "when": {}}],
        "routes": [{"match": {"model": SERVED_NAME}, "pool": "vllm"}],
        "server": {"access_log": True, "drain_grace_s": 2},
    }
    path = workdir / "policy.yaml"
    path.write_text(json.dumps(policy, indent=2))  # JSON is YAML
    return path


async def measure(urls: dict[str, str]) -> list[Round]:
    rounds: list[Round] = []
    base = 0
    async with aiohttp.ClientSession() as http:
        for target, url in urls.items():  # warm-up: both paths, every connection opened once
            await run_round(http, target, url, 8, 8, base)
            base += 8
        for concurrency, requests in LEVELS:
            for r in range(ROUNDS):
                order = list(urls.items()) if r % 2 == 0 else list(urls.items())[::-1]
                for target, url in order:
                    rounds.append(await run_round(http, target, url, concurrency, requests, base))
                    base += requests
    return rounds


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def report(rounds: list[Round]) -> str:
    lines = [
        f"Real vLLM (CPU) overhead, {datetime.date.today().isoformat()}: streaming chat, "
        f"~100 input tokens, {MAX_TOKENS} output tokens (ignore_eos), {ROUNDS} alternating rounds "
        "per target and concurrency.",
        "",
        "| concurrency | target | requests | tokens/s | TTFT p50 ms | TTFT p95 ms |",
        "|---|---|---|---|---|---|",
    ]
    summary: dict[tuple[int, str], tuple[float, float]] = {}
    for concurrency, _ in LEVELS:
        for target in ("direct", "gateway"):
            mine = [r for r in rounds if r.concurrency == concurrency and r.target == target]
            ttft = [t for r in mine for t in r.ttft_s]
            rate = sum(r.tokens for r in mine) / sum(r.wall_s for r in mine)
            p50 = statistics.median(ttft) * 1000
            summary[concurrency, target] = (rate, p50)
            lines.append(
                f"| {concurrency} | {target} | {len(ttft)} | {rate:,.0f} | {p50:.1f} | "
                f"{p(ttft, 95) * 1000:.1f} |"
            )
    lines += ["", "Per round, in the order run (TTFT p50 ms / tokens/s):", ""]
    for concurrency, _ in LEVELS:
        runs = [r for r in rounds if r.concurrency == concurrency]
        cells = [
            f"{r.target} {statistics.median(r.ttft_s) * 1000:.0f} / {r.tokens / r.wall_s:,.0f}"
            for r in runs
        ]
        lines.append(f"- concurrency {concurrency}: " + ", ".join(cells))
    lines += ["", "| concurrency | gateway / direct tokens/s | gateway - direct TTFT p50 ms |"]
    lines.append("|---|---|---|")
    for concurrency, _ in LEVELS:
        (rate_d, ttft_d), (rate_g, ttft_g) = (
            summary[concurrency, "direct"],
            summary[concurrency, "gateway"],
        )
        lines.append(f"| {concurrency} | {rate_g / rate_d:.3f} | {ttft_g - ttft_d:+.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="python of vLLM's environment")
    parser.add_argument(
        "--model-dir", type=Path, required=True, help="loadtest.tiny_llama's output"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        workdir = Path(tmp)
        model_dir = args.model_dir.resolve()
        with serve_vllm(args.vllm_python, model_dir, workdir / "vllm.log") as vllm:
            fleet = Fleet(workdir)
            try:
                port = free_port()
                policy = write_policy(workdir, model_dir, vllm.url)
                argv_gw = [sys.executable, "-m", "gateway", "serve", "--policy", str(policy)]
                gateway = fleet.start(
                    "gateway", [*argv_gw, "--host", "127.0.0.1", "--port", str(port)], port
                )
                wait_ready(gateway, "/readyz")
                rounds = asyncio.run(measure({"direct": vllm.url, "gateway": gateway.url}))
            finally:
                fleet.stop()
    text = report(rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
