"""One-connection latency of several targets measured side by side, in alternating blocks.

`bench-overhead` first measured the added p50 at one connection with wrk, one target for 5 s
after another. On this shared machine the speed of the whole box drifts by a third within
minutes, and the ratio it checks, (gateway - direct) / (pass-through - direct), is a quotient of
differences: in one run of five rounds it ranged from 0.80 to 2.32 for the same code. Here each
target gets a block of requests in turn (in a new random order every rotation), so all of them
see the same machine within a fraction of a second, and the p50s are taken over many rotations.

Blocks, not single requests: one request at a time to each target in turn evicts each one's
code from the CPU caches between its requests, which a client on one connection never does (the
gateway, with the most code, would pay most for it: 1.51 against 1.30 in blocks, the same code
and minutes apart). The first requests of each block are not counted, for the same reason.

    python -m loadtest.paired_latency --body body.json direct=9000 pass-through=9001 gateway=9002
    python -m loadtest.paired_latency --path /v1/embeddings --body embed.json --baseline direct \
        direct=9000 gateway=9002

Loopback only, one connection per target, bounded by `--rotations` and `--limit-s`. It prints
JSON: how it measured (`shape`), and per target its p50 and p95 in ms, the requests counted and
the errors. With `--baseline`, each other target's latency is also paired with the baseline's:
the k-th counted request of a target's block with the k-th of the baseline's block in the same
rotation, so each difference is taken within a fraction of a second; their median and p95 are
what the target adds (`loadtest.bench_endpoints`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.overhead.bodies import CHAT_PATH
from loadtest.overhead.fleet import HOST
from loadtest.overhead.ttfb import percentile, post_request, read_response

ROTATIONS, BLOCK, SKIP = 60, 50, 5
LIMIT_S = 60.0


async def measure(
    ports: dict[str, int],
    body: bytes,
    rotations: int = ROTATIONS,
    block: int = BLOCK,
    skip: int = SKIP,
    limit_s: float = LIMIT_S,
    path: str = CHAT_PATH,
    baseline: str | None = None,
    content_type: str = "application/json",
) -> dict[str, dict[str, Any]]:
    """Per target: p50 and p95 of the counted requests in ms, how many, and how many failed;
    with `baseline`, each other target's added latency (`added`)."""
    requests = {name: post_request(body, port, path, content_type) for name, port in ports.items()}
    streams = {name: await asyncio.open_connection(HOST, port) for name, port in ports.items()}
    # Counted slots in order, the same number per target per rotation; None where one failed.
    slots: dict[str, list[float | None]] = {name: [] for name in ports}
    errors = dict.fromkeys(ports, 0)
    stop_at = time.perf_counter() + limit_s
    order = list(ports)
    try:
        for _ in range(rotations):
            if time.perf_counter() > stop_at:
                break
            random.shuffle(order)
            for name in order:
                reader, writer = streams[name]
                for i in range(block):
                    started = time.perf_counter()
                    writer.write(requests[name])
                    async with asyncio.timeout(10):
                        status, _, _ = await read_response(reader, started)
                    took = time.perf_counter() - started
                    if status != 200:
                        errors[name] += 1
                    if i >= skip:
                        slots[name].append(took if status == 200 else None)
    finally:
        for _, writer in streams.values():
            writer.close()
    result = {}
    for name, taken in slots.items():
        times = sorted(t for t in taken if t is not None)
        result[name] = {
            "p50_ms": 1000 * statistics.median(times) if times else None,
            "p95_ms": 1000 * percentile(times, 95) if times else None,
            "requests": len(times),
            "errors": errors[name],
        }
        if baseline is not None and name != baseline:
            result[name]["added"] = added(taken, slots[baseline])
    return result


def added(target: list[float | None], baseline: list[float | None]) -> dict[str, Any]:
    """The paired differences target - baseline, slot by slot: median and p95 in ms, and how
    many pairs had both requests answered."""
    diffs = sorted(
        t - b for t, b in zip(target, baseline, strict=True) if t is not None and b is not None
    )
    return {
        "p50_ms": 1000 * statistics.median(diffs) if diffs else None,
        "p95_ms": 1000 * percentile(diffs, 95) if diffs else None,
        "pairs": len(diffs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--body", type=Path, required=True, help="the request body")
    parser.add_argument("--content-type", default="application/json", help="the body's")
    parser.add_argument("--rotations", type=int, default=ROTATIONS)
    parser.add_argument("--block", type=int, default=BLOCK)
    parser.add_argument("--skip", type=int, default=SKIP, help="not counted, in each block")
    parser.add_argument("--limit-s", type=float, default=LIMIT_S)
    parser.add_argument("--path", default=CHAT_PATH, help="the endpoint every request is posted to")
    parser.add_argument(
        "--baseline", help="a target's NAME: pair each other target's requests with its"
    )
    parser.add_argument("targets", nargs="+", metavar="NAME=PORT")
    args = parser.parse_args(argv)
    if not 0 <= args.skip < args.block or args.rotations < 1:
        parser.error("need --rotations >= 1 and 0 <= --skip < --block")
    ports = {}
    for target in args.targets:
        name, _, port = target.partition("=")
        if not port.isdigit():
            parser.error(f"{target!r}: expected NAME=PORT")
        ports[name] = int(port)
    if args.baseline is not None and args.baseline not in ports:
        parser.error(f"--baseline {args.baseline!r} is not one of the targets")
    import uvloop  # the cheapest loop: the client shares the two cores with what it measures

    result = uvloop.run(
        measure(
            ports, args.body.read_bytes(), args.rotations, args.block, args.skip, args.limit_s,
            args.path, args.baseline, args.content_type,
        )
    )  # fmt: skip
    shape = (
        f"{args.rotations} rotations of a block of {args.block} requests to each target in a new"
        f" random order, the first {args.skip} of each block not counted"
    )
    print(json.dumps({"shape": shape, "targets": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
