"""(c): time to the first body byte of a streamed answer, which wrk cannot see.

`measure_ttfb` runs the client as its own process (`python -m loadtest.bench_overhead
--ttfb-client PORT`, internal), so its CPU is the child's and not the benchmark's; the client is a
small asyncio raw-socket loop on uvloop, bounded in time and in requests. `read_response` and
`post_request` serve `loadtest.paired_latency` as well.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.overhead.bodies import CHAT_PATH, STREAM_TOKENS
from loadtest.overhead.fleet import HOST, ROOT, CpuMeter, Service

TTFB_CONNECTIONS = 16
MAX_TTFB_REQUESTS = 200_000  # per run: a hard bound beside the time limit


@dataclass
class TtfbResult:
    target: str
    p50_ms: float
    p99_ms: float
    total_p50_ms: float
    rps: float
    requests: int
    errors: int
    cpu_ms_per_request: float | None
    other_cores: float


def measure_ttfb(
    target: Service, services: Sequence[Service], body_file: Path, duration: int
) -> TtfbResult:
    argv = [sys.executable, "-m", "loadtest.bench_overhead", "--ttfb-client", str(target.port)]
    with CpuMeter(target, services) as cpu:
        out = subprocess.run(
            [*argv, "--ttfb-body", str(body_file), "--duration", str(duration)],
            cwd=ROOT, capture_output=True, text=True, timeout=duration + 60, check=False,
        )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"TTFB client failed on {target.name}: {out.stderr[-2000:]}")
    data = json.loads(out.stdout)
    served = data["requests"] + data["warmup_requests"]  # the target served the warm-up too
    return TtfbResult(
        target=target.name,
        p50_ms=data["p50_ms"],
        p99_ms=data["p99_ms"],
        total_p50_ms=data["total_p50_ms"],
        rps=data["rps"],
        requests=data["requests"],
        errors=data["errors"],
        cpu_ms_per_request=1000 * cpu.target_s / served if served else None,
        other_cores=cpu.other_cores,
    )


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of a sorted sequence."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


async def read_response(reader: asyncio.StreamReader, started: float) -> tuple[int, float, bytes]:
    """Read one HTTP/1.1 response; return status, seconds to its first body byte, and the body."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    lowered = head.lower()
    first: float | None = None
    body = bytearray()
    if b"transfer-encoding: chunked" in lowered:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers are sent here
                break
            chunk = await reader.readexactly(size + 2)
            if first is None:
                first = time.perf_counter()
            body += chunk[:-2]
    else:
        found = re.search(rb"content-length:\s*(\d+)", lowered)
        length = int(found.group(1)) if found else 0
        while len(body) < length:
            data = await reader.read(length - len(body))
            if not data:
                raise ConnectionError("connection closed mid-body")
            if first is None:
                first = time.perf_counter()
            body += data
    return status, (first or time.perf_counter()) - started, bytes(body)


async def _ttfb_connection(
    port: int, request: bytes, measure_from: float, stop_at: float, out: dict[str, list[float]]
) -> None:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        while time.perf_counter() < stop_at and sum(map(len, out.values())) < MAX_TTFB_REQUESTS:
            started = time.perf_counter()
            writer.write(request)
            async with asyncio.timeout(10):
                status, ttfb, body = await read_response(reader, started)
            total = time.perf_counter() - started
            if started < measure_from:
                out["warmup"].append(1.0)
                continue
            complete = body.rstrip().endswith(b"data: [DONE]")
            if status != 200 or not complete or body.count(b"data: ") < STREAM_TOKENS:
                out["errors"].append(1.0)
                continue
            out["ttfb"].append(ttfb)
            out["total"].append(total)
    finally:
        writer.close()


def post_request(
    body: bytes, port: int, path: str = CHAT_PATH, content_type: str = "application/json"
) -> bytes:
    """A whole HTTP/1.1 POST of `body` to `path`, as the raw-socket clients send it."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _ttfb_main(port: int, body: bytes, duration: float, connections: int) -> dict[str, Any]:
    request = post_request(body, port)
    out: dict[str, list[float]] = {"ttfb": [], "total": [], "errors": [], "warmup": []}
    now = time.perf_counter()
    measure_from, stop_at = now + 1.0, now + 1.0 + duration
    await asyncio.gather(
        *(_ttfb_connection(port, request, measure_from, stop_at, out) for _ in range(connections))
    )
    ttfb, total = sorted(out["ttfb"]), sorted(out["total"])
    return {
        "p50_ms": 1000 * percentile(ttfb, 50),
        "p99_ms": 1000 * percentile(ttfb, 99),
        "total_p50_ms": 1000 * percentile(total, 50),
        "rps": len(ttfb) / duration,
        "requests": len(ttfb),
        "errors": len(out["errors"]),
        "warmup_requests": len(out["warmup"]),
    }


def ttfb_client(port: int, body_file: Path, duration: float) -> int:
    import uvloop  # the cheapest loop: the client shares the two cores with what it measures

    result = uvloop.run(_ttfb_main(port, body_file.read_bytes(), duration, TTFB_CONNECTIONS))
    print(json.dumps(result))
    return 0
