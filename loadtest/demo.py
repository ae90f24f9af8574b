"""`make demo`: the gateway on policies/demo.yaml in front of simulated replicas, and a mixed load.

It builds a small real tokenizer (no download) where the demo policy points, starts one simulated
vLLM replica for every replica URL in the policy (a TPU v6e profile chosen by the pool's model),
starts `llm-gateway serve`, sends the article's two workloads mixed in one open-loop stream —
classification (4,000 tokens in, 10 out) and generation (500 in, 1,000 out, streamed) — and
prints, per workload, how the gateway handled it. Bounded: a fixed arrival schedule, a deadline,
and every process and replica stopped at the end.

    python -m loadtest.demo [--policy policies/demo.yaml] [--port 18080] [--rate 12] [--duration 20]
                            [--time-scale 10] [--out loadtest/out/demo]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import yaml

from loadtest.loadgen import (
    SweepConfig,
    SweepResult,
    Target,
    load_workload,
    percentile,
    run_sweep,
    write_report,
)
from loadtest.loadgen.runner import RequestRecord
from loadtest.sim import Replica, ReplicaOptions, load_profile, start_replica
from loadtest.tiny_tokenizer import build

ROOT = Path(__file__).resolve().parent.parent
PROFILES = {
    "gemma-3-27b-it": "gemma-3-27b-tpu-v6e-2x2",
    "gemma-3-12b-it": "gemma-3-12b-tpu-v6e-2x2",
}
DEADLINE_S = 150


def ensure_tokenizers(policy: dict[str, Any], base: Path) -> str:
    """Build the demo tokenizer where the policy expects it; return its directory."""
    directories = {str((base / m["tokenizer"]).resolve()) for m in policy["models"].values()}
    for directory in directories:
        if not (Path(directory) / "tokenizer.json").exists():
            print(f"building the demo tokenizer in {os.path.relpath(directory)} ...", flush=True)
            build(directory)
    return sorted(directories)[0]


async def start_replicas(
    policy: dict[str, Any], tokenizer: str, time_scale: float
) -> list[Replica]:
    replicas = []
    for pool in policy["pools"].values():
        profile = load_profile(PROFILES[pool["model"]])
        for url in pool["replicas"]:
            parts = urlsplit(url)
            assert parts.hostname == "127.0.0.1", "the demo serves replicas on loopback only"
            options = ReplicaOptions(time_scale=time_scale, tokenizer=tokenizer)
            replicas.append(await start_replica(profile, options, port=parts.port or 80))
    return replicas


async def wait_ready(url: str, proc: asyncio.subprocess.Process) -> None:
    async with aiohttp.ClientSession() as http, asyncio.timeout(60):
        while proc.returncode is None:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/readyz") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError("the gateway did not start; see its log above")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def table(records: list[RequestRecord], access: list[dict[str, Any]], time_scale: float) -> str:
    """Per workload: what the client saw (simulated seconds) and where the gateway sent it."""
    decided: dict[int, Counter[tuple[str, str]]] = defaultdict(Counter)
    for line in access:  # exact prompts: the gateway's input count is the workload's ISL
        decided[line["input_tokens"]][(line["class"] or "-", line["pool"] or "-")] += 1
    rows = [
        "| workload | requests | ok | rejected (429) | class -> pool | P50 E2E | P95 E2E | P50 TTFT | P95 TTFT |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    by_class: dict[str, list[RequestRecord]] = defaultdict(list)
    for rec in records:
        by_class[rec.cls].append(rec)
    for name, recs in by_class.items():
        ok = [r for r in recs if r.ok]

        def q(values: list[float | None], p: float) -> float | None:
            known = [v * time_scale for v in values if v is not None]
            return percentile(known, p) if known else None

        e2e, ttft = [r.e2e_s for r in ok], [r.ttft_s for r in ok]
        where = decided.get(recs[0].isl, Counter()).most_common(1)
        route = f"{where[0][0][0]} -> {where[0][0][1]}" if where else "-"
        rows.append(
            f"| {name} | {len(recs)} | {len(ok)} | {sum(r.status == 429 for r in recs)} | {route}"
            f" | {_s(q(e2e, 50))} | {_s(q(e2e, 95))} | {_s(q(ttft, 50))} | {_s(q(ttft, 95))} |"
        )
    return "\n".join(rows)


async def run(
    policy_path: Path, policy: dict[str, Any], tokenizer: str, args: argparse.Namespace
) -> SweepResult:
    """Start the fleet and the gateway, send the load, stop everything; the gateway's access log
    goes to `args.out / "access.jsonl"`."""
    url = f"http://127.0.0.1:{args.port}"
    replicas = await start_replicas(policy, tokenizer, args.time_scale)
    with (args.out / "access.jsonl").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--policy", str(policy_path),
            "--port", str(args.port), stdout=log,
        )  # fmt: skip
        try:
            await wait_ready(url, proc)
            print(f"gateway up at {url}, {len(replicas)} simulated replicas (time scale"
                  f" {args.time_scale:g}); sending {args.rate:g} req/s of mixed traffic for"
                  f" {args.duration:g}s ...", flush=True)  # fmt: skip
            config = SweepConfig(
                targets=(Target(url, "gemma-3", tokenizer),),
                workloads=(load_workload("mixed"),),
                rates=(args.rate,),
                duration_s=args.duration,
                max_seconds_per_level=DEADLINE_S,
                time_scale=args.time_scale,
            )
            async with asyncio.timeout(DEADLINE_S + 30):
                return await run_sweep(config)
        finally:
            proc.terminate()
            await proc.wait()
            for replica in replicas:
                await replica.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policy", type=Path, default=ROOT / "policies" / "demo.yaml")
    parser.add_argument("--port", type=int, default=18080, help="the gateway's port")
    parser.add_argument("--rate", type=float, default=12.0, help="arrivals per wall-clock second")
    parser.add_argument(
        "--duration", type=float, default=20.0, help="wall-clock seconds of arrivals"
    )
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=ROOT / "loadtest" / "out" / "demo")
    args = parser.parse_args(argv)
    policy = yaml.safe_load(args.policy.read_text())
    tokenizer = ensure_tokenizers(policy, args.policy.parent)
    args.out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args.policy, policy, tokenizer, args))
    access_path = args.out / "access.jsonl"
    access = [orjson.loads(line) for line in access_path.read_bytes().splitlines()]
    records = result.series[0].levels[0][1].records
    summary = table(records, access, args.time_scale)
    write_report(result, args.out)
    (args.out / "demo.md").write_text(
        f"# Demo\n\nPolicy `{args.policy.name}`, {args.rate:g} req/s for {args.duration:g}s wall"
        f" clock, time scale {args.time_scale:g} (latencies in simulated seconds).\n\n{summary}\n"
    )
    print(f"\n{summary}\n")
    print("Classification flows through its own pool; generation waits behind its low cap, and")
    print("what waits longer than its queue allows is refused with a retryable 429, not piled up.")
    print(f"Report: {os.path.relpath(args.out)}/demo.md (and report.md, results.json, plots);")
    print(f"access log: {os.path.relpath(access_path)}")
    return 0 if any(r.ok for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
