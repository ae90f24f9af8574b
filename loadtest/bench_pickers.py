"""Pickers side by side: the same open-loop workload, the same seed and arrivals, sent through
the gateway to a fresh fleet of simulated replicas once per picker.

    python -m loadtest.bench_pickers --workload rules-256x3000 --rate 60 --duration 60 \
        [--pickers least-inflight,round-robin,scorers,precise] [--replicas 4] [--time-scale 1] \
        [--profile gemma-3-12b-tpu-v6e-2x2] [--max-concurrency 32] [--tokenizer DIR|tiny]

Each picker gets its own simulator process (4 replicas on loopback, prefix caching on, caches
cold) and its own gateway process, so nothing one run cached helps the next. Before and after
each run the replicas' /metrics are read: prefix-cache queries and hits (vLLM's
`vllm:prefix_cache_queries` / `_hits`), prompt tokens computed, requests finished per replica;
while it runs, every 0.5 s, each replica's `vllm:num_requests_running` and the gateway's
`llm_inflight_requests` per replica are sampled for the load spread (most minus least loaded
replica: mean / max over the samples). Prints a Markdown table (docs/capacity.md).

`precise` (the `precise_prefix` scorer) follows the replicas' KV-cache events, which the
simulator publishes with `--kv-events-config` on ipc endpoints in a temporary directory, and
needs token ids on every side: `--tokenizer` (a tokenizer directory, or `tiny` for the tests'
byte-level BPE, built on the spot) is then given to the load generator, the simulator and the
gateway alike, for every picker of the run, so they stay comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest.loadgen.compare import CompareConfig, run_compare
from loadtest.loadgen.sweep import Target
from loadtest.loadgen.workloads import load_workload
from loadtest.tiny_tokenizer import build as build_tokenizer

HOST = "127.0.0.1"
SCORERS = {"scorers": {"prefix": 3, "queue": 1, "kv_cache": 1}}
PRECISE = {"scorers": {"precise_prefix": 3, "queue": 1, "kv_cache": 1}}
PICKERS: dict[str, dict[str, Any]] = {
    "least-inflight": {},
    "round-robin": {"plugins": {"picker": {"type": "round-robin"}}},
    "scorers": {"pick": SCORERS},
    "precise": {"pick": PRECISE},
}
COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "sim_prefill_tokens_computed_total",
    "vllm:request_success_total",
    "sim_clock_slip_seconds_total",
)


def free_ports(count: int) -> list[int]:
    """`count` consecutive free loopback ports (the simulator serves replicas on P..P+N-1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((HOST, 0))
            base = int(s.getsockname()[1])
        ports = list(range(base, base + count))
        try:
            for port in ports[1:]:
                with socket.socket() as s:
                    s.bind((HOST, port))
        except OSError:
            continue
        return ports
    raise RuntimeError("no block of free ports")


def policy(
    model: str, urls: list[str], picker: dict[str, Any], cap: int, tokenizer: str | None
) -> dict[str, Any]:
    pool: dict[str, Any] = {
        "model": model,
        "replicas": urls,
        "max_concurrency": cap,
        "queue": {"max_depth": 100_000, "max_wait_s": 3600, "fail_fast": False},
        "timeouts": {"total_s": 3600},
        **({"pick": picker["pick"]} if "pick" in picker else {}),
    }
    return {
        "models": {
            model: {
                "tokenizer": tokenizer or "estimate",
                "chars_per_token": 4,
                "max_model_len": 128000,
            }
        },
        "pools": {"fleet": pool},
        "classes": [{"name": "any", "when": {}}],
        "routes": [{"match": {"model": model}, "pool": "fleet"}],
        "server": {"access_log": False},
        **({"plugins": picker["plugins"]} if "plugins" in picker else {}),
    }


async def line_matching(stream: asyncio.StreamReader, pattern: str, within_s: float) -> str:
    async with asyncio.timeout(within_s):
        while True:
            line = (await stream.readline()).decode()
            if not line:
                raise RuntimeError(f"process exited before printing {pattern!r}")
            if re.search(pattern, line):
                return line


@contextlib.asynccontextmanager
async def process(*argv: str) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )  # the simulator's stderr is left in the pipe: it logs little, and only at start
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS or name == "vllm:num_requests_running":
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


@dataclass
class Spread:
    samples: int = 0
    max_gap: float = 0.0
    gap_sum: float = 0.0

    def add(self, running: list[float]) -> None:
        if max(running) == 0:
            return
        gap = max(running) - min(running)
        self.samples += 1
        self.gap_sum += gap
        self.max_gap = max(self.max_gap, gap)

    def describe(self) -> str:
        """Mean / max of (most - least loaded replica) over the samples with any load."""
        mean = self.gap_sum / self.samples if self.samples else 0.0
        return f"{mean:.1f} / {self.max_gap:.0f}"


async def gateway_inflight(http: aiohttp.ClientSession, gateway: str) -> list[float]:
    """`llm_inflight_requests` per replica, as the gateway counts them."""
    async with http.get(f"{gateway}/metrics") as resp:
        text = await resp.text()
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llm_inflight_requests{")
    ]


async def sample_spread(
    http: aiohttp.ClientSession, urls: list[str], gateway: str, spreads: tuple[Spread, Spread]
) -> None:
    """Every 0.5 s: the replicas' own running counts, and the gateway's in flight."""
    while True:
        readings = await asyncio.gather(*(scrape(http, u) for u in urls))
        spreads[0].add([r.get("vllm:num_requests_running", 0.0) for r in readings])
        spreads[1].add(await gateway_inflight(http, gateway))
        await asyncio.sleep(0.5)


async def run_one(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    ports = free_ports(args.replicas)
    urls = [f"http://{HOST}:{p}" for p in ports]
    sim = ("-m", "loadtest.cli", "simulate", "--profile", args.profile,
           "--replicas", str(args.replicas), "--base-port", str(ports[0]), "--host", HOST,
           "--time-scale", str(args.time_scale), "--stream-interval-ms", "200")  # fmt: skip
    if args.tokenizer:
        events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{workdir}/kv-{name}"}
        sim += ("--tokenizer", args.tokenizer, "--kv-events-config", json.dumps(events))
    path = workdir / f"{name}.yaml"
    picked = PICKERS[name]
    if picked is PICKERS["precise"]:  # the simulator's ipc endpoints, the policy's to allow
        weight = PRECISE["scorers"]["precise_prefix"]
        scorer = {"weight": weight, "ipc_endpoints": [f"ipc://{workdir}/kv-{name}*"]}
        picked = {"pick": {"scorers": {**PRECISE["scorers"], "precise_prefix": scorer}}}
    picker = policy(args.model, urls, picked, args.max_concurrency, args.tokenizer)
    path.write_text(yaml.safe_dump(picker))
    async with process(*sim) as sim_proc:
        assert sim_proc.stdout is not None
        await line_matching(sim_proc.stdout, re.escape(urls[-1]), 60)
        async with process("-m", "gateway", "serve", "--policy", str(path), "--host", HOST,
                           "--port", "0") as gw_proc:  # fmt: skip
            assert gw_proc.stderr is not None
            found = await line_matching(gw_proc.stderr, r"listening on http://", 60)
            gateway = re.search(r"(http://\S+)", found).group(1)  # type: ignore[union-attr]
            drain = asyncio.create_task(gw_proc.stderr.read())
            async with aiohttp.ClientSession() as http:
                before = await asyncio.gather(*(scrape(http, u) for u in urls))
                spreads = (Spread(), Spread())
                sampler = asyncio.create_task(sample_spread(http, urls, gateway, spreads))
                config = CompareConfig(
                    targets=((name, Target(gateway, args.model, args.tokenizer)),),
                    rate=args.rate,
                    duration_s=args.duration,
                    workload=load_workload(args.workload),
                    max_seconds=args.max_seconds,
                    time_scale=args.time_scale,
                    seed=args.seed,
                )
                try:
                    result = await run_compare(config)
                finally:
                    sampler.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await sampler
                after = await asyncio.gather(*(scrape(http, u) for u in urls))
            gw_proc.terminate()
            await drain
    delta = [
        {k: a.get(k, 0.0) - b.get(k, 0.0) for k in COUNTERS}
        for a, b in zip(after, before, strict=True)
    ]
    total = {k: sum(d[k] for d in delta) for k in COUNTERS}
    outcome = result.outcomes()[name][0]
    return {
        "picker": name,
        "stats": outcome.stats,
        "hit_rate": total["vllm:prefix_cache_hits_total"]
        / max(1.0, total["vllm:prefix_cache_queries_total"]),
        "prefill": total["sim_prefill_tokens_computed_total"],
        "prompt": total["vllm:prompt_tokens_total"],
        "per_replica": [d["vllm:request_success_total"] for d in delta],
        "spreads": spreads,
        "slip": total["sim_clock_slip_seconds_total"],
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Rates and latencies are in simulated seconds: the load generator scales them."""
    out = [
        "| picker | sent | completed | req/s | prefix hit rate | prefill tokens computed |"
        " P95 TTFT s | P95 E2E s | requests per replica | spread: running | spread: in flight |"
        " clock slip s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        s = r["stats"]
        running, inflight = (sp.describe() for sp in r["spreads"])
        ttft = s.ttft.p95 if s.ttft.p95 is not None else float("nan")
        e2e = s.e2e.p95 if s.e2e.p95 is not None else float("nan")
        out.append(
            f"| {r['picker']} | {s.sent} | {s.completed} | {s.rps:.2f} |"
            f" {r['hit_rate']:.1%} | {r['prefill']:,.0f} | {ttft:.2f} | {e2e:.2f} |"
            f" {' / '.join(f'{n:.0f}' for n in r['per_replica'])} | {running} | {inflight} |"
            f" {r['slip']:.1f} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True, help="a workload name or YAML file (loadgen.md)")
    p.add_argument("--rate", type=float, required=True, help="arrivals per wall second")
    p.add_argument("--duration", type=float, required=True, help="wall seconds of arrivals")
    p.add_argument(
        "--pickers",
        help=f"of {', '.join(PICKERS)}; default: all, but precise only with --tokenizer",
    )
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--profile", default="gemma-3-12b-tpu-v6e-2x2")
    p.add_argument("--model", default="gemma-3-12b-it")
    p.add_argument("--max-concurrency", type=int, default=32, help="per replica, every picker")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="simulated s per wall s (below 1: the fleet runs slower than the wall clock, for"
        " CPU headroom); the table is in simulated time",
    )
    p.add_argument("--max-seconds", type=float, default=600.0, help="per run, wall")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--tokenizer",
        help="a tokenizer directory, or `tiny`, for every side (needed by `precise`);"
        " default: 4 characters a token",
    )
    args = p.parse_args(argv)
    if args.pickers is None:
        args.pickers = ",".join(n for n in PICKERS if args.tokenizer or n != "precise")
    if "precise" in args.pickers.split(",") and not args.tokenizer:
        p.error("the precise picker needs token ids: give --tokenizer (a directory, or tiny)")

    async def go() -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory() as tmp:
            if args.tokenizer == "tiny":
                args.tokenizer = str(build_tokenizer(Path(tmp) / "tiny-tokenizer"))
            return [await run_one(n, args, Path(tmp)) for n in args.pickers.split(",")]

    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    rows = asyncio.run(go())
    print(
        f"\n{args.workload}, {args.rate:g} arrivals/s for {args.duration:g} s (time scale {args.time_scale:g}), seed {args.seed}\n"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
