"""What the gateway adds to each endpoint's latency, against the same replica directly, side by side.

`bench-overhead` measures the gateway on chat only, against a stub that answers nothing else. Here
one simulated vLLM replica (`loadtest.sim`, which serves every endpoint the gateway admits) is the
baseline, and for each endpoint the same small request goes to it directly and through the
gateway in alternating blocks (`loadtest.paired_latency --baseline direct`): the k-th request of
the gateway's block is paired with the k-th of the replica's in the same rotation, so each
difference is taken on the same machine within a fraction of a second, however much the shared
machine's speed drifts between endpoints. The result per endpoint is the median and p95 of those
differences and the ratio of the two p50s; the absolute times only give them a scale, and the
ratio depends on how fast the replica answers (`--time-scale`: the simulated replica runs that
many times faster than a real TPU v6e, so its own latency is small beside the gateway's).

The gateway runs as `bench-overhead`'s does: its own process, the tiny real tokenizer
(`loadtest.tiny_tokenizer`, exact counting, also the replica's), one pool whose cap never
queues, access log on (to /dev/null). Before measuring, one request per endpoint must answer
200 from both targets, the gateway's with its `x-request-id`.

    python -m loadtest.bench_endpoints [--rotations 30] [--block 20] [--skip 3]
                                       [--time-scale 1000] [--out loadtest/out/endpoints.md]

The endpoints are the gateway's registry (`gateway.api.APIS`), each request its endpoint's
`Api.example`, in its own content type (a multipart upload for audio), so an endpoint the gateway
admits is measured as soon as it is registered (`tests/loadtest/test_bench_endpoints.py`). It prints the Markdown
table and writes it to `--out`, the rows as JSON beside it (`.json`); it exits 1 if any request
failed, 0 otherwise: it is a measurement, not a test. Loopback only; every child runs in its own
process group, stopped in a `finally`; each endpoint's run is bounded by `--rotations` and
`--limit-s`.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gateway.api import APIS, Api
from loadtest.overhead.bodies import MODEL
from loadtest.overhead.fleet import (
    HOST,
    ROOT,
    CpuMeter,
    Fleet,
    Service,
    build_tokenizer,
    free_port,
    http_request,
    log,
    start_gateway,
    wait_ready,
)
from loadtest.overhead.policy import write_policy

PROFILE = "gemma-3-12b-tpu-v6e-2x2"
DEFAULT_OUT = ROOT / "loadtest" / "out" / "endpoints.md"


@dataclass
class Row:
    """One endpoint: each target's p50 and p95, and what the gateway adds, paired request by
    request with the replica's; ms."""

    endpoint: str
    path: str
    pairs: int
    direct_p50_ms: float
    gateway_p50_ms: float
    direct_p95_ms: float
    gateway_p95_ms: float
    added_p50_ms: float
    added_p95_ms: float
    ratio: float  # gateway p50 / direct p50
    errors: int
    other_cores: float


def start_replica(procs: Fleet, tokenizer: Path, time_scale: float) -> Service:
    """The simulated replica, serving `MODEL` and counting with the gateway's tokenizer."""
    port = free_port()
    argv = [
        sys.executable, "-m", "loadtest.sim.cli", "--profile", PROFILE, "--base-port", str(port),
        "--host", HOST, "--time-scale", str(time_scale), "--tokenizer", str(tokenizer),
        "--served-model-name", MODEL,
    ]  # fmt: skip
    return procs.start("direct", argv, port)


def check(name: str, port: int, path: str, body: bytes, content_type: str) -> None:
    """One request must succeed: a benchmark of fast 4xx answers is worthless."""
    status, headers, data = http_request(port, "POST", path, body, content_type=content_type)
    if status != 200:
        raise RuntimeError(f"{name}: {path} answered {status}: {data[:300]!r}")
    if name == "gateway" and "x-request-id" not in headers:
        raise RuntimeError("gateway: no x-request-id header: is this really the gateway?")


def measure(
    api: Api, direct: Service, gateway: Service, workdir: Path, args: argparse.Namespace
) -> Row:
    """One `loadtest.paired_latency` run in a child (its CPU is not "other CPU")."""
    endpoint, path = api.name, api.path
    body, content_type = api.example(MODEL)
    check("direct", direct.port, path, body, content_type)
    check("gateway", gateway.port, path, body, content_type)
    body_file = workdir / f"{endpoint}.body"
    body_file.write_bytes(body)
    argv = [sys.executable, "-m", "loadtest.paired_latency", "--body", str(body_file)]
    argv += ["--content-type", content_type]
    argv += ["--path", path, "--baseline", "direct", "--rotations", str(args.rotations)]
    argv += ["--block", str(args.block), "--skip", str(args.skip), "--limit-s", str(args.limit_s)]
    argv += [f"direct={direct.port}", f"gateway={gateway.port}"]
    with CpuMeter(gateway, [direct, gateway]) as cpu:
        out = subprocess.run(
            argv, cwd=ROOT, capture_output=True, text=True, timeout=args.limit_s + 60, check=False
        )
    if out.returncode != 0:
        raise RuntimeError(f"paired latency client failed on {endpoint}: {out.stderr[-2000:]}")
    d, g = (json.loads(out.stdout)["targets"][t] for t in ("direct", "gateway"))
    return Row(
        endpoint, path, g["added"]["pairs"], d["p50_ms"], g["p50_ms"], d["p95_ms"], g["p95_ms"],
        g["added"]["p50_ms"], g["added"]["p95_ms"], g["p50_ms"] / d["p50_ms"],
        d["errors"] + g["errors"], cpu.other_cores,
    )  # fmt: skip


def table(rows: list[Row]) -> str:
    lines = [
        "| endpoint | path | pairs | direct p50 / p95 ms | gateway p50 / p95 ms"
        " | added p50 ms | added p95 ms | gateway / direct p50 | errors | other CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.endpoint} | `{r.path}` | {r.pairs} | {r.direct_p50_ms:.2f} / {r.direct_p95_ms:.2f}"
            f" | {r.gateway_p50_ms:.2f} / {r.gateway_p95_ms:.2f} | {r.added_p50_ms:+.2f}"
            f" | {r.added_p95_ms:+.2f} | {r.ratio:.2f}x | {r.errors} | {r.other_cores:.2f} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-endpoints-") as tmp:
        workdir = Path(tmp)
        tokenizer = build_tokenizer(workdir, "loadtest.tiny_tokenizer")
        procs = Fleet(workdir)
        try:
            direct = start_replica(procs, tokenizer, args.time_scale)
            wait_ready(direct, "/health")
            policy = write_policy(workdir, tokenizer, direct.url, None, None)
            gateway = start_gateway(procs, "gateway", policy)
            wait_ready(gateway, "/readyz")
            rows = []
            for api in APIS:
                rows.append(measure(api, direct, gateway, workdir, args))
                log(f"{api.name}: added p50 {rows[-1].added_p50_ms:+.2f} ms")
            return rows
        finally:
            procs.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rotations", type=int, default=30, help="per endpoint")
    parser.add_argument("--block", type=int, default=20, help="requests to a target in a row")
    parser.add_argument("--skip", type=int, default=3, help="not counted, in each block")
    parser.add_argument("--limit-s", type=float, default=20.0, help="per endpoint, at most")
    parser.add_argument("--time-scale", type=float, default=1000.0, help="the replica's speed-up")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Markdown report file")
    args = parser.parse_args(argv)
    if not 0 <= args.skip < args.block or args.rotations < 1:
        parser.error("need --rotations >= 1 and 0 <= --skip < --block")
    # SIGTERM's default would skip the `finally` that stops the children.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rows = run(args)
    shape = (
        f"{started}; {args.rotations} rotations of {args.block} requests a target, the first"
        f" {args.skip} of each block not counted; replica {PROFILE} at time scale"
        f" {args.time_scale:g}"
    )
    report = f"{shape}\n\n{table(rows)}\n"
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    rows_json = {"shape": shape, "rows": [asdict(r) for r in rows]}
    args.out.with_suffix(".json").write_text(json.dumps(rows_json, indent=2))
    return 1 if any(r.errors for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
