"""Two versions of the gateway side by side: which one costs less on the short request?

`bench-overhead` compares the gateway with a pass-through; run twice, for two commits, its ratios
move more between runs than between most commits (docs/benchmarks.md). This runs both versions at
once, beside the stub replica and the pass-through, and measures them in turn in every round,
which goes first alternating, so each round is a fair pair; it prints each round and the
medians. At one connection the added p50 comes from `loadtest.paired_latency`: direct, the
pass-through and both gateways side by side in alternating blocks.

    git worktree add /tmp/base <commit>
    python -m loadtest.bench_ab --base /tmp/base --candidate . [--rounds 5] [--traced RATIO]

`--state redis` runs both with their slots and a tenant's windows in one local redis-server
(`gateways: 3`), every request carrying the tenant's key: what shared state costs per request,
and whether a change to it made it cheaper.

`--traced 1` gives the candidate's policy a `tracing` section sampling every request (RATIO of
them), exported to the stub (an OTLP/HTTP sink): with the same tree on both sides, what tracing
costs.

Identical code on both sides agreed within 1% at one connection over 4 rounds, yet one change
worth ~1 µs measured 4% better in one run and 4% worse in two (docs/benchmarks.md): rerun with
the sides swapped before believing a small difference.

Each tree's gateway runs from that tree (`python -m gateway serve` with it as the working
directory) with the same policy (bench-overhead's). Loopback only; every load run is bounded by
`--duration`; the children are stopped in a `finally`. The noise floor at 64 connections (CPU
per request, wrk): the same code against itself differed by up to 15% in medians of 3 rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from loadtest.overhead.bodies import dumps, short_chat
from loadtest.overhead.fleet import (
    Fleet,
    build_tokenizer,
    start_backends,
    start_gateway,
    start_redis,
    wait_started,
)
from loadtest.overhead.paired import measure_paired
from loadtest.overhead.policy import write_policy
from loadtest.overhead.wrk import measure, run_wrk, static_lua

TENANT_KEY = "sk-bench-ab-tenant"  # loopback only, hashed in the policy


def compare(
    trees: dict[str, Path],
    rounds: int,
    connections: list[int],
    duration: int,
    traced: float | None,
    shared: bool = False,
) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        workdir = Path(tmp)
        tokenizer = build_tokenizer(workdir, "loadtest.tiny_tokenizer")
        procs = Fleet(workdir)
        try:
            stub, passthrough = start_backends(procs)
            redis_url = start_redis(procs) if shared else None
            key = TENANT_KEY if shared else None
            policy = write_policy(workdir, tokenizer, stub.url, redis_url, None, tenant_key=key)
            policies = dict.fromkeys(trees, policy)
            if traced is not None:  # the stub is the traces' sink
                sink = f"{stub.url}/v1/traces"
                policies["candidate"] = write_policy(
                    workdir,
                    tokenizer,
                    stub.url,
                    redis_url,
                    None,
                    "traced.yaml",
                    traces_to=(sink, traced),
                    tenant_key=key,
                )
            sides = {
                name: start_gateway(procs, name, policies[name], tree)
                for name, tree in trees.items()
            }
            wait_started(stub, passthrough, list(sides.values()))
            script, body = workdir / "short.lua", workdir / "short.json"
            auth = {"Authorization": f"Bearer {TENANT_KEY}"} if shared else None
            script.write_text(static_lua(dumps(short_chat()), auth))
            body.write_text(dumps(short_chat()))
            services = [stub, passthrough, *sides.values()]
            for c in connections:  # warm up: connections, caches, the estimator's window
                for service in services:
                    run_wrk(service.url, script, c, 1)
            ratios: dict[tuple[int, str], list[tuple[float, float, float | None]]] = {}
            for n in range(rounds):
                for c in connections:
                    # The order alternates: a run measured right after another at full load
                    # was slower than the same code measured first (docs/benchmarks.md).
                    order = list(sides.values())[:: -1 if n % 2 else 1]
                    runs = {
                        s.name: measure("a", s, services, script, c, duration)
                        for s in ([stub] if c == 1 else []) + [passthrough, *order]
                    }
                    pt, line = runs["pass-through"], [f"round {n + 1} c={c}"]
                    # The latency at one connection: all of them side by side, in blocks.
                    paired = (
                        measure_paired(
                            {"direct": stub, "pass-through": passthrough, **sides}, services, body
                        )
                        if c == 1 and not shared  # its client sends no key
                        else None
                    )
                    for name in sides:
                        gw = runs[name]
                        cpu = (gw.cpu_ms_per_request or 0) / (pt.cpu_ms_per_request or 1)
                        added = paired.added(name) if paired is not None else None
                        ratios.setdefault((c, name), []).append((gw.rps / pt.rps, cpu, added))
                        line.append(
                            f"{name}: req/s {gw.rps / pt.rps:.3f}x, CPU {cpu:.3f}x"
                            + ("" if added is None else f", added p50 {added:.3f}x")
                            + (f", {gw.errors} FAILED" if gw.errors else "")
                        )
                    other = max(
                        [r.other_cores for r in runs.values()]
                        + ([paired.other_cores] if paired is not None else [])
                    )
                    print(" | ".join(line) + f" | other CPU {other:.2f}", flush=True)
            print(f"\nmedians of {rounds} rounds, against the pass-through of the same round:")
            for (c, name), values in sorted(ratios.items()):
                added_values = [a for _, _, a in values if a is not None]
                added_text = (
                    f", added p50 {statistics.median(added_values):.3f}x" if added_values else ""
                )
                print(
                    f"c={c} {name}: req/s {statistics.median(v[0] for v in values):.3f}x,"
                    f" CPU {statistics.median(v[1] for v in values):.3f}x{added_text}"
                )
        finally:
            procs.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, required=True, help="a checkout of the gateway")
    parser.add_argument("--candidate", type=Path, required=True, help="another checkout")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (>= 1)")
    parser.add_argument("--connections", default="1,64", help="e.g. 1,64")
    parser.add_argument("--duration", type=int, default=4, help="seconds per run (>= 1)")
    parser.add_argument(
        "--state",
        choices=["memory", "redis"],
        default="memory",
        help="redis: slots and a tenant's windows in a local redis-server, every request with the"
        " tenant's key, as gateways sharing state run (one connection: no paired latency)",
    )
    parser.add_argument(
        "--traced",
        type=float,
        metavar="RATIO",
        help="the candidate traces this share of requests (OTLP/HTTP, to the stub): its cost",
    )
    args = parser.parse_args(argv)
    connections = [int(c) for c in args.connections.split(",")]
    if args.rounds < 1 or args.duration < 1 or min(connections) < 1:
        parser.error("--rounds, --duration and each connection count must be at least 1")
    trees = {"base": args.base.resolve(), "candidate": args.candidate.resolve()}
    for name, tree in trees.items():
        if not (tree / "gateway" / "__main__.py").is_file():
            parser.error(f"--{name} {tree} holds no gateway/ package")
    shared = args.state == "redis"
    return compare(trees, args.rounds, connections, args.duration, args.traced, shared)


if __name__ == "__main__":
    raise SystemExit(main())
