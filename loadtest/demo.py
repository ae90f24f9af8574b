"""`make demo`: the gateway on policies/demo.yaml in front of local replicas, and a short mixed load.

It starts three stub replicas on the loopback ports the demo policy names, starts
`llm-gateway serve` on 127.0.0.1:18080, then sends the article's two workloads at once —
classification (~4,000 tokens in, 10 out) and generation (~500 in, 1,000 out, streamed) — and
prints how each was handled: class, pool, queue wait, time to first token, end-to-end latency.
Bounded: a fixed number of requests, a deadline, every process stopped at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from loadtest.stub_backend import StubConfig, create_stub_app

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "policies" / "demo.yaml"
GATEWAY = "http://127.0.0.1:18080"
CLASSIFY_REPLICAS = (18101, 18102)
GENERATE_REPLICAS = (18111,)
DEADLINE_S = 90

RULES = "Product rules: no weapons, no drugs, no counterfeit brands, no medical claims. " * 200


def classification(i: int) -> dict[str, Any]:
    return {
        "model": "gemma-3",
        "messages": [
            {"role": "system", "content": RULES},  # ~3,000 tokens, the same in every request
            {
                "role": "user",
                "content": f"Listing {i}: " + "lithium battery toy for children. " * 110,
            },
        ],
        "max_tokens": 10,
    }


def generation(i: int) -> dict[str, Any]:
    return {
        "model": "gemma-3",
        "messages": [{"role": "user", "content": f"Analyse policy {i}: " + "seller rules " * 150}],
        "max_tokens": 1000,
        "stream": True,
    }


async def start_replicas() -> list[web.AppRunner]:
    runners = []
    replicas = [(port, StubConfig(delay_s=0.15)) for port in CLASSIFY_REPLICAS] + [
        (port, StubConfig(delay_s=0.05, chunk_delay_s=0.002)) for port in GENERATE_REPLICAS
    ]
    for port, config in replicas:
        runner = web.AppRunner(create_stub_app(config), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    return runners


async def wait_ready(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> None:
    async with asyncio.timeout(60):
        while proc.returncode is None:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{GATEWAY}/readyz") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError("the gateway did not start; see its log above")


async def send(http: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    first = None
    async with http.post(f"{GATEWAY}/v1/chat/completions", json=body) as resp:
        async for _ in resp.content.iter_any():
            first = first or time.perf_counter()
        return {"status": resp.status, "e2e": time.perf_counter() - started,
                "ttft": (first or time.perf_counter()) - started, "id": resp.headers.get("x-request-id")}  # fmt: skip


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def report(results: dict[str, list[dict[str, Any]]], access: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'workload':<16}{'n':>4}{'ok':>5}  {'class':<14}{'pool':<14}{'in tok':>8}{'out tok':>8}"
          f"{'wait p95':>10}{'TTFT p50':>10}{'E2E p50':>9}{'E2E p95':>9}")  # fmt: skip
    for name, rows in results.items():
        logs = [access[r["id"]] for r in rows if r["id"] in access]
        ok = sum(r["status"] == 200 for r in rows)
        waits = [x["queue_wait_s"] or 0.0 for x in logs] or [0.0]
        e2e = [r["e2e"] for r in rows]
        print(
            f"{name:<16}{len(rows):>4}{ok:>5}  {logs[0]['class']:<14}{logs[0]['pool']:<14}"
            f"{statistics.median(x['input_tokens'] for x in logs):>8.0f}"
            f"{statistics.median(x['output_tokens'] or 0 for x in logs):>8.0f}"
            f"{p(waits, 95):>9.2f}s{statistics.median(r['ttft'] for r in rows):>9.2f}s"
            f"{statistics.median(e2e):>8.2f}s{p(e2e, 95):>8.2f}s"
        )


async def main() -> int:
    out = ROOT / "loadtest" / "out"
    out.mkdir(parents=True, exist_ok=True)
    access_path = out / "demo-access.jsonl"
    runners = await start_replicas()
    log = access_path.open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--policy", str(POLICY), "--port", "18080",
        stdout=log, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as http:
            await wait_ready(http, proc)
            print(f"gateway up at {GATEWAY} (policy {POLICY.relative_to(ROOT)}); sending load ...")
            async with asyncio.timeout(DEADLINE_S):
                cls = [send(http, classification(i)) for i in range(64)]
                gen = [send(http, generation(i)) for i in range(16)]
                done = await asyncio.gather(*cls, *gen)
            results = {"classification": list(done[:64]), "generation": list(done[64:])}
            async with http.get(f"{GATEWAY}/metrics") as resp:
                metrics = await resp.text()
    finally:
        proc.terminate()
        await proc.wait()
        log.close()
        for runner in runners:
            await runner.cleanup()
    access = {x["request_id"]: x for x in map(orjson.loads, access_path.read_bytes().splitlines())}
    report(results, access)
    print("\nFrom /metrics:")
    for line in metrics.splitlines():
        if line.startswith(
            ("llm_queue_wait_seconds_count", "llm_requests_total", "llm_pool_capacity")
        ):
            print("  " + line)
    print(f"\nAccess log: {access_path.relative_to(ROOT)}")
    print("Classification never waits behind generation: each workload has its own pool and cap.")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
