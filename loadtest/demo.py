"""`make demo`: the gateway on policies/demo.yaml in front of simulated replicas, and a mixed load.

It builds a small real tokenizer (no download) where the demo policy points, starts one simulated
vLLM replica for every replica URL in the policy (a TPU v6e profile chosen by the pool's model),
starts `llm-gateway serve`, sends the load generator's `platform` mix in one open-loop stream —
the article's two workloads, classification (4,000 tokens in, 10 out) and generation (500 in,
1,000 out, streamed), with retrieval (512-token embedding requests) and an agent on Anthropic's
messages API (6-turn conversations, 150 tokens out a turn, and 2,000-in / 40-out calls) beside
them — and prints, per workload, how the gateway handled it. Bounded: a fixed arrival schedule,
a deadline, and every process and replica stopped at the end.

One clock: the fleet's. The replicas run `--time-scale` times faster than real time, so every time
and rate the demo reads or prints is in simulated seconds: `--rate` and `--duration`, the
latencies, and the policy's own times (demo.yaml states them as for a real fleet). The gateway
runs on the wall clock, so it gets a copy of the policy, `OUT/gateway-policy.yaml`, with every
`*_s` value divided by the time scale.

    python -m loadtest.demo [--policy policies/demo.yaml] [--port 18080] [--rate 1.5]
                            [--duration 200] [--time-scale 10] [--out loadtest/out/demo]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import yaml

from gateway.config.schema import COUNT_BY_CHARS
from loadtest import processes
from loadtest.loadgen import (
    Mark,
    SweepConfig,
    SweepResult,
    Target,
    load_workload,
    percentile,
    run_sweep,
    write_report,
)
from loadtest.loadgen.runner import RequestRecord
from loadtest.sim import ReplicaOptions, load_profile, start_replica
from loadtest.tiny_tokenizer import ensure

ROOT = Path(__file__).resolve().parent.parent
PROFILES = {
    "gemma-3-27b-it": "gemma-3-27b-tpu-v6e-2x2",
    "gemma-3-12b-it": "gemma-3-12b-tpu-v6e-2x2",
}
DEADLINE_S = 150  # wall clock
REFUSALS = {  # the client's error code: what the gateway did, "{wait}" the queue's max wait
    "queue_wait_too_long": "the gateway predicted a queue wait over {wait} and refused at once",
    "queue_timeout": "each waited the queue's max wait, {wait}, without a free slot",
    "queue_full": "the queue was at its max_depth on arrival",
}


def ensure_tokenizers(policy: dict[str, Any], base: Path) -> str | None:
    """Build the demo tokenizer where the policy expects it; return its directory (None: every
    model estimates)."""
    directories = {
        str((base / m["tokenizer"]).resolve())
        for m in policy["models"].values()
        if m.get("tokenizer", COUNT_BY_CHARS) != COUNT_BY_CHARS
    }
    for directory in directories:
        ensure(directory)
    return min(directories, default=None)


def scaled(node: Any, time_scale: float) -> Any:
    """The policy on the wall clock: every `*_s` value divided by the time scale."""
    if isinstance(node, dict):
        return {
            key: value / time_scale
            if key.endswith("_s") and isinstance(value, int | float) and not isinstance(value, bool)
            else scaled(value, time_scale)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [scaled(item, time_scale) for item in node]
    return node


def gateway_policy(policy: dict[str, Any], source: Path, time_scale: float, path: Path) -> Path:
    """Write the policy the gateway runs on; its relative paths (tokenizers, keys files) made
    absolute, since the copy lives elsewhere."""
    copy = scaled(policy, time_scale)
    for model in copy["models"].values():
        if model.get("tokenizer", COUNT_BY_CHARS) != COUNT_BY_CHARS:
            model["tokenizer"] = str((source.parent / model["tokenizer"]).resolve())
    for tenant in (copy.get("tenants") or {}).values():
        if tenant.get("keys_file"):
            tenant["keys_file"] = str((source.parent / tenant["keys_file"]).resolve())
    path.write_text(
        f"# Written by loadtest/demo.py from {source}: its *_s values divided by the time"
        f" scale {time_scale:g},\n# for a gateway on the wall clock. Edit the original.\n"
        + yaml.safe_dump(copy, sort_keys=False)
    )
    return path


async def start_replicas(
    policy: dict[str, Any],
    tokenizer: str | None,
    time_scale: float,
    stack: contextlib.AsyncExitStack,
) -> int:
    """The policy's replicas, each closed when `stack` closes (so a later start that fails
    leaves none behind); returns how many."""
    started = 0
    for pool in policy["pools"].values():
        profile = load_profile(PROFILES[pool["model"]])
        for url in pool["replicas"]:
            parts = urlsplit(url)
            assert parts.hostname == "127.0.0.1", "the demo serves replicas on loopback only"
            options = ReplicaOptions(time_scale=time_scale, tokenizer=tokenizer)
            replica = await start_replica(profile, options, port=parts.port or 80)
            stack.push_async_callback(replica.close)
            started += 1
    return started


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


@dataclass
class Outcome:
    """One workload of the mix as the client saw it and the gateway handled it, simulated s."""

    name: str
    records: list[RequestRecord]
    route: tuple[str, str] | None  # (class, pool) the gateway chose most often
    refusals: dict[tuple[int, str], list[float]]  # (status, error code): seconds each took

    def quantile(self, attr: str, p: float, time_scale: float) -> float | None:
        known = [
            v * time_scale for r in self.records if r.ok and (v := getattr(r, attr)) is not None
        ]
        return percentile(known, p) if known else None


def workloads(
    records: list[RequestRecord], access: list[dict[str, Any]], time_scale: float
) -> list[Outcome]:
    by_class: dict[str, list[RequestRecord]] = defaultdict(list)
    for rec in records:
        by_class[rec.cls].append(rec)
    # Exact prompts: the gateway's input count on an endpoint is the workload's ISL (a session
    # turn's, its whole history).
    name_of = {(rec.endpoint, rec.isl): rec.cls for rec in records}
    decided: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    refusals: dict[str, dict[tuple[int, str], list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in access:
        name = name_of.get((line["endpoint"], line["input_tokens"]), "-")
        decided[name][(line["class"] or "-", line["pool"] or "-")] += 1
        if line["status"] != 200:
            refused = (line["status"], line["reason"] or "-")
            refusals[name][refused].append(line["e2e_s"] * time_scale)
    return [
        Outcome(
            name,
            recs,
            route[0][0] if (route := decided[name].most_common(1)) else None,
            dict(refusals[name]),
        )
        for name, recs in by_class.items()
    ]


def table(found: list[Outcome], policy: dict[str, Any], time_scale: float) -> str:
    """Per workload: what the client saw and where the gateway sent it, in simulated seconds."""
    rows = [
        "| workload | requests | ok | refused (429) | class -> pool | cap x replicas"
        " | queue max wait | P50 E2E | P95 E2E | P50 TTFT | P95 TTFT |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for w in found:
        pool = policy["pools"].get(w.route[1]) if w.route else None
        cap = f"{pool['max_concurrency']} x {len(pool['replicas'])}" if pool else "-"
        wait = _s(pool["queue"]["max_wait_s"]) if pool else "-"
        route = f"{w.route[0]} -> {w.route[1]}" if w.route else "-"
        q = [_s(w.quantile(a, p, time_scale)) for a in ("e2e_s", "ttft_s") for p in (50, 95)]
        rows.append(
            f"| {w.name} | {len(w.records)} | {sum(r.ok for r in w.records)}"
            f" | {sum(r.status == 429 for r in w.records)} | {route} | {cap} | {wait}"
            f" | {' | '.join(q)} |"
        )
    return "\n".join(rows)


def story(found: list[Outcome], policy: dict[str, Any], time_scale: float) -> str:
    """What happened, from the counts: which workload flowed, which queued, what was refused and
    how (by the client's error code, from the gateway's access log)."""
    lines = []
    for w in found:
        pool = policy["pools"].get(w.route[1], {}) if w.route else {}
        wait = pool.get("queue", {}).get("max_wait_s")
        ok = sum(r.ok for r in w.records)
        ttft = w.quantile("ttft_s", 95, time_scale)
        line = f"{w.name}: {ok} of {len(w.records)} completed"
        if w.route:
            line += f" in pool {w.route[1]} (cap {pool.get('max_concurrency')} a replica)"
        if ttft is None:  # an embedding is one answer, not a stream
            line += f", P95 E2E {_s(w.quantile('e2e_s', 95, time_scale))}"
        else:
            line += f", P95 TTFT {_s(ttft)}"
        if wait is not None:
            line += f" (queue max wait {wait:g}s)"
        lines.append(line + ".")
        for (status, code), took in sorted(w.refusals.items(), key=lambda kv: -len(kv[1])):
            spread = f"{min(took):.2f}s" + (f"-{max(took):.2f}s" if max(took) > min(took) else "")
            what = REFUSALS.get(code, "refused").format(wait=_s(wait))
            lines.append(
                f"  {len(took)} refused with {status} {code}, {spread} after arriving: {what}."
            )
        if not w.refusals:
            lines.append("  None refused.")
    codes = {code for w in found for _, code in w.refusals}
    if "queue_wait_too_long" in codes:
        lines.append(
            "A queue_wait_too_long refusal comes at once, with the predicted wait as Retry-After:"
            " the client learns now what it would learn after waiting max_wait_s in the queue."
        )
    elif codes <= {"queue_timeout"}:
        lines.append("Nothing was refused before waiting its queue's max wait.")
    return "\n".join(lines)


def marks(found: list[Outcome], policy: dict[str, Any]) -> dict[str, Mark]:
    """The queue's max wait of each workload's pool: the policy's only latency bound."""
    out = {}
    for w in found:
        if w.route and (pool := policy["pools"].get(w.route[1])):
            wait = pool["queue"]["max_wait_s"]
            out[w.name] = Mark(f"{w.route[1]} queue max wait {wait:g}s", wait)
    return out


async def run(
    policy_path: Path, policy: dict[str, Any], tokenizer: str | None, args: argparse.Namespace
) -> SweepResult:
    """Start the fleet and the gateway, send the load, stop everything; the gateway's access log
    goes to `args.out / "access.jsonl"`, its own log to `args.out / "gateway.log"`."""
    async with contextlib.AsyncExitStack() as stack:
        replicas = await start_replicas(policy, tokenizer, args.time_scale, stack)
        url = await stack.enter_async_context(processes.gateway(policy_path, args.port, args.out))
        print(f"gateway up at {url}, {replicas} simulated replicas; sending {args.rate:g} req/s"
              f" of classification, generation, retrieval and agent traffic for"
              f" {args.duration:g}s ...", flush=True)  # fmt: skip
        config = SweepConfig(
            targets=(Target(url, "gemma-3", tokenizer),),
            workloads=(load_workload("platform"),),
            rates=(args.rate * args.time_scale,),  # the load generator sends on the wall clock
            duration_s=args.duration / args.time_scale,
            max_seconds_per_level=DEADLINE_S,
            time_scale=args.time_scale,
        )
        async with asyncio.timeout(DEADLINE_S + 30):
            return await run_sweep(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policy", type=Path, default=ROOT / "policies" / "demo.yaml")
    parser.add_argument("--port", type=int, default=18080, help="the gateway's port")
    parser.add_argument("--rate", type=float, default=1.5, help="arrivals per simulated second")
    parser.add_argument(
        "--duration", type=float, default=200.0, help="simulated seconds of arrivals"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=10.0,
        help="how much faster than real time the fleet runs",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "loadtest" / "out" / "demo")
    args = parser.parse_args(argv)
    policy = yaml.safe_load(args.policy.read_text())
    tokenizer = ensure_tokenizers(policy, args.policy.parent)
    args.out.mkdir(parents=True, exist_ok=True)
    copy = gateway_policy(policy, args.policy, args.time_scale, args.out / "gateway-policy.yaml")
    print(
        f"Every time and rate below is in simulated seconds: the replicas run {args.time_scale:g}x"
        f" faster than real time,\nand the gateway runs on {os.path.relpath(copy)},"
        f" {args.policy.name} with its times divided by {args.time_scale:g}.",
        flush=True,
    )
    result = asyncio.run(run(copy, policy, tokenizer, args))
    access_path = args.out / "access.jsonl"
    access = [orjson.loads(line) for line in access_path.read_bytes().splitlines()]
    records = result.series[0].levels[0][1].records
    found = workloads(records, access, args.time_scale)
    summary, said = table(found, policy, args.time_scale), story(found, policy, args.time_scale)
    write_report(result, args.out, marks(found, policy))
    (args.out / "demo.md").write_text(
        f"# Demo\n\nPolicy `{args.policy.name}`, {args.rate:g} req/s for {args.duration:g}s."
        f" Every time and rate is in simulated seconds (the replicas run {args.time_scale:g}x"
        f" faster than real time; the gateway ran on `gateway-policy.yaml`, the policy's times"
        f" divided by {args.time_scale:g}).\n\n{summary}\n\n```\n{said}\n```\n\n"
        "![requests over time](throughput.png)\n\n![latency](latency.png)\n"
    )
    print(f"\n{summary}\n\n{said}\n")
    print(f"Report: {os.path.relpath(args.out)}/demo.md (and report.md, results.json, CSV, plots);")
    print(
        f"access log: {os.path.relpath(access_path)}; gateway log: {os.path.relpath(args.out)}/gateway.log"
    )
    return 0 if any(r.ok for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
