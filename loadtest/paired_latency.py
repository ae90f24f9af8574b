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

Loopback only, one connection per target, bounded by `--rotations` and `--limit-s`. It prints
JSON: how it measured (`shape`), and per target its p50 in ms, the requests counted and the
errors.
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

from loadtest.overhead.fleet import HOST
from loadtest.overhead.ttfb import chat_request, read_response

ROTATIONS, BLOCK, SKIP = 60, 50, 5
LIMIT_S = 60.0


async def measure(
    ports: dict[str, int],
    body: bytes,
    rotations: int = ROTATIONS,
    block: int = BLOCK,
    skip: int = SKIP,
    limit_s: float = LIMIT_S,
) -> dict[str, dict[str, Any]]:
    """Per target: seconds of each counted request, and how many failed."""
    requests = {name: chat_request(body, port) for name, port in ports.items()}
    streams = {name: await asyncio.open_connection(HOST, port) for name, port in ports.items()}
    times: dict[str, list[float]] = {name: [] for name in ports}
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
                    elif i >= skip:
                        times[name].append(took)
    finally:
        for _, writer in streams.values():
            writer.close()
    return {
        name: {
            "p50_ms": 1000 * statistics.median(times[name]) if times[name] else None,
            "requests": len(times[name]),
            "errors": errors[name],
        }
        for name in ports
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--body", type=Path, required=True, help="the request body, JSON")
    parser.add_argument("--rotations", type=int, default=ROTATIONS)
    parser.add_argument("--block", type=int, default=BLOCK)
    parser.add_argument("--skip", type=int, default=SKIP, help="not counted, in each block")
    parser.add_argument("--limit-s", type=float, default=LIMIT_S)
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
    import uvloop  # the cheapest loop: the client shares the two cores with what it measures

    result = uvloop.run(
        measure(ports, args.body.read_bytes(), args.rotations, args.block, args.skip, args.limit_s)
    )
    shape = (
        f"{args.rotations} rotations of a block of {args.block} requests to each target in a new"
        f" random order, the first {args.skip} of each block not counted"
    )
    print(json.dumps({"shape": shape, "targets": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
