"""Instructions per short request: the gateway against the pass-through, counted, not timed.

Every timed ratio on this shared 2-core machine moves by 10-15% between rounds (CPU per request
at 64 connections; docs/benchmarks.md), which is more than most single changes to the short path
are worth. `valgrind --tool=callgrind` counts the instructions a process executes, and that count
does not depend on what else the machine is doing: the same code gives the same figure to well
under 1%. So this runs the pass-through and one gateway per tree under callgrind, with counting
off through start-up and a warm-up, on only for a fixed number of short chat requests (or, with
`--stream`, streamed ones) sent one after another on one keep-alive connection, and reports
instructions per request and the ratio to the pass-through's.

It is a proxy for CPU time, not CPU time: it does not see cache misses, system-call cost or
contention between threads, and one connection at a time pays the event loop's wake-up on every
request (both sides alike). Use it to steer and to compare trees; `bench-overhead` stays the
verdict in time.

    python -m loadtest.bench_instructions [--requests 1000] [--tree NAME=PATH ...] [--keep DIR]
                                          [--stream]

`--tree` (repeatable; default: this checkout as `gateway`) runs that checkout's `gateway`
package, as `loadtest.bench_ab` does. `--keep` keeps the callgrind files, for
`callgrind_annotate`. The stub replica runs natively; loopback only; the request count bounds
every loop and the children are stopped in a `finally`.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from loadtest.overhead.bodies import CHAT_PATH, STREAM_TOKENS, dumps, short_chat, stream_chat
from loadtest.overhead.fleet import (
    HOST,
    ROOT,
    Fleet,
    Service,
    build_tokenizer,
    log,
    start_backends,
    start_gateway,
    wait_started,
)
from loadtest.overhead.policy import write_policy

WARM_UP = 300  # requests before counting: connections open, caches and the estimator's window
# Callgrind runs Python ~5x slower with counting off (start-up: imports, the tokenizers).
READY_TIMEOUT_S = 600.0
_TOTALS = re.compile(rb"^totals:\s*(\d+)", re.M)


def callgrind(out_file: Path) -> list[str]:
    """Counting off from the start (`callgrind_control -i on` turns it on) and on every thread:
    the tokenizer pool's work is the gateway's too."""
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out_file}",
    ]


def send(port: int, body: str, requests: int) -> None:
    """`requests` chat requests, one after another on one connection; each must succeed."""
    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        for _ in range(requests):
            conn.request("POST", CHAT_PATH, body=body, headers=headers)
            resp = conn.getresponse()
            answer = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"port {port} answered {resp.status}: {answer[:300]!r}")
    finally:
        conn.close()


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def counted(service: Service, out_file: Path, work: Callable[[], object]) -> int:
    """Instructions `service` executes while `work` runs."""
    control(service.proc.pid, "--instr=on")
    work()
    control(service.proc.pid, "--instr=off")
    before = set(out_file.parent.glob(f"{out_file.name}.*"))
    control(service.proc.pid, "--dump")
    dumps = set(out_file.parent.glob(f"{out_file.name}.*")) - before
    if len(dumps) != 1:
        raise RuntimeError(f"{service.name}: callgrind wrote no new dump next to {out_file}")
    found = _TOTALS.search(dumps.pop().read_bytes())
    if found is None:
        raise RuntimeError(f"{service.name}: no totals in its dump")
    return int(found[1])


@dataclass(frozen=True)
class Count:
    per_request: float  # instructions per request, the idle rate taken out
    idle_share: float  # of the busy run's instructions, what the same time idle executed


def count(service: Service, out_file: Path, body: str, requests: int) -> Count:
    """Instructions per request of `service`, over `requests` after the warm-up.

    Timers run whether requests come or not (health checks, the loop-lag probe, the policy
    watch), and under callgrind a run takes seconds, so the busy count holds some of their work,
    by how long the run took: the same time idle is counted right after and taken out."""
    send(service.port, body, WARM_UP)
    started = time.monotonic()
    busy = counted(service, out_file, lambda: send(service.port, body, requests))
    idle = counted(service, out_file, partial(time.sleep, time.monotonic() - started))
    return Count((busy - idle) / requests, idle / busy)


def run(trees: dict[str, Path], requests: int, keep: Path | None, stream: bool) -> int:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        log("valgrind is not installed (apt-get install -y valgrind)")
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        workdir = keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        tokenizer = build_tokenizer(workdir, "loadtest.tiny_tokenizer")
        procs = Fleet(workdir)
        outs = {name: workdir / f"{name}.callgrind" for name in ("pass-through", *trees)}
        try:
            stub, passthrough = start_backends(procs, callgrind(outs["pass-through"]))
            policy = write_policy(workdir, tokenizer, stub.url, None, None)
            gateways = [
                start_gateway(procs, name, policy, tree, callgrind(outs[name]))
                for name, tree in trees.items()
            ]
            wait_started(stub, passthrough, gateways, READY_TIMEOUT_S)
            body = dumps(stream_chat() if stream else short_chat())
            per_request = {
                s.name: count(s, outs[s.name], body, requests) for s in (passthrough, *gateways)
            }
        finally:
            procs.stop()
        base = per_request["pass-through"].per_request
        kind = f"{STREAM_TOKENS}-chunk stream" if stream else "short chat"
        print(f"instructions per {kind} request, {requests} counted after {WARM_UP}:")
        for name, value in per_request.items():
            print(
                f"  {name}: {value.per_request:,.0f} ({value.per_request / base:.3f}x the"
                f" pass-through; idle work taken out: {value.idle_share:.1%})"
            )
        if keep is not None:
            print(f"callgrind files in {keep} (callgrind_annotate <file>)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000, help="requests counted (>= 1)")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a checkout whose gateway to count, under NAME (repeatable; default: this one)",
    )
    parser.add_argument("--keep", type=Path, help="keep the callgrind files in this directory")
    parser.add_argument(
        "--stream",
        action="store_true",
        help=f"a streamed chat of {STREAM_TOKENS} chunks instead of the short request",
    )
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    trees: dict[str, Path] = {}
    for spec in args.tree or [f"gateway={ROOT}"]:
        name, sep, path = spec.partition("=")
        if not sep or not name or name in ("direct", "pass-through") or name in trees:
            parser.error(f"--tree {spec!r}: expected a new NAME=PATH")
        trees[name] = Path(path).resolve()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # The children inherit it: the same dict layouts, hence the same work, run after run.
    os.environ["PYTHONHASHSEED"] = "0"
    return run(trees, args.requests, args.keep, args.stream)


if __name__ == "__main__":
    raise SystemExit(main())
