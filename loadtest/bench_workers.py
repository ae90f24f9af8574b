"""A pod with 2 cores vs 1: `serve --workers 2` against one gateway process, in one run.

Gemma 3 classification (bench_overhead's (d) bodies: unique ~4,000-token prose chats, max_tokens
10, real tokenizer) at 16 connections from wrk, which reads prepared bodies and so costs next to
nothing, to three targets started at once in front of one zero-delay stub, all sharing state
through one local Redis (as `--workers 2` must; the single process pays the same state path):

- `1 core`: `serve` pinned to CPU 0 with `taskset` (its tokenizer threads: 1, the CPUs it sees);
- `1 process`: `serve` on every CPU with as many tokenizer threads (today's pod);
- `2 workers`: `serve --workers 2` on every CPU (each worker: 1 tokenizer thread).

The targets run back to back in each of `--rounds` rounds, and each round's ratio is its own pair;
the verdict is the median. On a 2-core machine the stub, wrk and anything else running share the
cores with the 2-worker pod, so its figure is a floor: a pod's own 2 cores are the gateway's.

    python -m loadtest.bench_workers [--duration 10] [--rounds 3] [--seed N] [--connections 16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest import real_tokenizers
from loadtest.bench_routers import find_nginx, start_nginx_stub
from loadtest.overhead.counting import COUNTED, write_bodies
from loadtest.overhead.fleet import (
    HOST,
    Fleet,
    Service,
    build_tokenizer,
    free_port,
    log,
    start_backends,
    start_redis,
    wait_ready,
)
from loadtest.overhead.policy import write_policy
from loadtest.overhead.wrk import bodies_lua, measure

GEMMA = COUNTED[0]
BODIES = 6000
ONE_CORE = ["taskset", "-c", "0"]  # CPU 0 only: one core, one tokenizer thread


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants: a pod's parent and its workers."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        for child in children:
            found += _tree(int(child))
    return found


def _field(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


def _stat_cpu(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


def _cpu(pids: list[int]) -> float:
    return sum(_stat_cpu(Path(f"/proc/{pid}/stat")) for pid in pids)


def _switches(pids: list[int]) -> int:
    """Context switches of every thread of `pids`: a loop that wakes for less work switches more
    a request."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[1])
    return total


def _redis_calls(url: str) -> int:
    """Every command Redis has served: the state path's round trips are its calls."""
    import redis

    with redis.Redis.from_url(url) as client:
        stats = client.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


def _start(procs: Fleet, name: str, policy: Path, argv: list[str], wrap: list[str]) -> Service:
    port = free_port()
    cmd = [*wrap, sys.executable, "-m", "gateway", "serve", "--policy", str(policy)]
    return procs.start(name, [*cmd, "--host", HOST, "--port", str(port), *argv], port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per measured run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--stub", choices=("python", "nginx"), default="python",
        help="the replica: the Python stub, or nginx answering a fixed completion (next to no CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--pinned-pod", action="store_true",
        help="a fourth target: `serve --workers 2` pinned to CPU 0, what workers cost on one core",
    )  # fmt: skip
    parser.add_argument(
        "--connections", type=int, default=16,
        help="wrk's connections: fewer leave the loops idle between requests",
    )  # fmt: skip
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    log(f"seed {seed}")
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        workdir = Path(tmp)
        procs = Fleet(workdir)
        try:
            tokenizer = build_tokenizer(workdir, "loadtest.tiny_tokenizer")
            redis_url = start_redis(procs)
            if args.stub == "nginx":
                nginx = find_nginx()
                if nginx is None:
                    parser.error("--stub nginx: no nginx on PATH or in /usr/sbin")
                stub = start_nginx_stub(procs, nginx, GEMMA.model, 10)
            else:
                stub, _ = start_backends(procs)
            counted = {GEMMA.model: real_tokenizers.directory(GEMMA.key)}
            policies = {}
            names = ["one", "pod", *(["pinned"] if args.pinned_pod else [])]
            for name in names:
                metrics = None if name == "one" else free_port()
                path = write_policy(workdir, tokenizer, stub.url, redis_url, None, f"{name}.yaml",
                                    counted)  # fmt: skip
                policy = json.loads(path.read_text())
                policy["state"]["gateways"] = 1
                if metrics is not None:
                    policy["server"]["metrics_port"] = metrics
                path.write_text(json.dumps(policy))
                policies[name] = path
            targets = [
                _start(procs, "1 core", policies["one"], [], ONE_CORE),
                _start(procs, "1 process", policies["one"], [], []),
                _start(procs, "2 workers", policies["pod"], ["--workers", "2"], []),
            ]
            if args.pinned_pod:
                targets.append(_start(procs, "2 workers, 1 core", policies["pinned"],
                                      ["--workers", "2"], ONE_CORE))  # fmt: skip
            wait_ready(stub, "/health")
            for target in targets:
                wait_ready(target, "/readyz")
            time.sleep(3)  # the second worker of the pod too
            bodies = workdir / "bodies.jsonl"
            write_bodies(bodies, GEMMA, 4.5, BODIES, random.Random(seed))
            script = workdir / "bodies.lua"
            script.write_text(bodies_lua(bodies))
            for target in targets:  # warm-up: connections, caches, the allocator
                measure("warm", target, [target], script, 16, 2)
            rows = []
            for rnd in range(args.rounds):
                for target in targets:
                    pids = _tree(target.proc.pid)
                    loops = [Path(f"/proc/{p}/task/{p}/stat") for p in pids[-1:]]
                    before, started = _cpu(pids), time.perf_counter()
                    parent_before = _cpu(pids[:1])
                    loop_before = sum(_stat_cpu(x) for x in loops)
                    switches_before, calls_before = _switches(pids), _redis_calls(redis_url)
                    run = measure(
                        "d", target, [target, stub], script, args.connections, args.duration
                    )
                    wall = time.perf_counter() - started
                    cores = (_cpu(pids) - before) / wall
                    # CpuMeter counts the target's own process: a pod's workers are "other" there
                    workers = cores - (_cpu(pids[:1]) - parent_before) / wall
                    other = max(0.0, run.other_cores - workers)
                    loop = (sum(_stat_cpu(x) for x in loops) - loop_before) / wall
                    n = max(1, run.requests)
                    per = (
                        1000 * cores * wall / n,
                        (_switches(pids) - switches_before) / n,
                        (_redis_calls(redis_url) - calls_before) / n,
                    )
                    rows.append((rnd, target.name, run.rps, cores, loop, *per, other, run.errors))
                    log(f"round {rnd} {target.name}: {run.rps:.1f} req/s, {cores:.2f} cores"
                        f" ({loop:.2f} on one loop thread), {per[0]:.2f} ms CPU,"
                        f" {per[1]:.1f} switches, {per[2]:.2f} Redis calls a request,"
                        f" other {other:.2f}, errors {run.errors}")  # fmt: skip
            rss = {
                t.name: [round(_field(p, "VmRSS") / 1024) for p in _tree(t.proc.pid)]
                for t in targets
            }
        finally:
            procs.stop()
    print(
        f"seed {seed}; {args.rounds} rounds of {args.duration} s at {args.connections} connections\n"
    )
    print(
        "| round | target | req/s | gateway cores | a loop thread's cores | CPU ms a request"
        " | context switches a request | Redis calls a request | other cores | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rnd, name, rps, cores, loop, cpu, switches, calls, other, errors in rows:
        print(f"| {rnd} | {name} | {rps:.1f} | {cores:.2f} | {loop:.2f} | {cpu:.2f}"
              f" | {switches:.1f} | {calls:.2f} | {other:.2f} | {errors} |")  # fmt: skip
    by = {(r[0], r[1]): r[2] for r in rows}
    pairs = [("2 workers", "1 core"), ("2 workers", "1 process")]
    if args.pinned_pod:
        pairs.append(("2 workers, 1 core", "1 core"))
    for pod, base in pairs:
        ratios = [by[(r, pod)] / by[(r, base)] for r in range(args.rounds)]
        print(f"\n{pod} / {base}: rounds {[round(x, 2) for x in ratios]},"
              f" median {statistics.median(ratios):.2f}x")  # fmt: skip
    print(f"\nresident MB per process (parent first): {rss}")
    subprocess.run(["nproc"], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
