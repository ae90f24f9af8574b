"""The latency the gateway adds at one connection, beside the proxies and routers it is compared with.

Issue 39's target for the short path is relative to a Rust router in the same run: what the
gateway adds over talking to the replica directly, at most 1.5x what vllm-router adds. This starts
the zero-delay stub replica and, in front of it, the aiohttp pass-through (`loadtest.passthrough`),
nginx, vllm-router and the gateway (bench-overhead's policy), and measures the short chat through
each at one connection, side by side in alternating blocks (`loadtest.paired_latency`, every
request paired with direct's in the same rotation), for `--rounds` rounds.

nginx and vllm-router are not part of the gateway's environment (CI installs neither): a router
that is absent is skipped, said so in the report, and the others are measured. To measure them,
nginx from the system's packages (`apt-get install nginx-light`: found on PATH or in /usr/sbin)
and vllm-router from PyPI into a virtual environment of its own (`python -m venv /tmp/routers &&
/tmp/routers/bin/pip install vllm-router`), then `--vllm-router /tmp/routers/bin/vllm-router`.

    python -m loadtest.bench_routers [--rounds 3] [--rotations 30] [--vllm-router PATH] [--out F]

Loopback only; every child in its own process group, stopped in a `finally`; each paired run is
bounded by `--rotations` and a time limit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtest.overhead.bodies import dumps, short_chat
from loadtest.overhead.fleet import (
    HOST,
    ROOT,
    CpuMeter,
    Fleet,
    Service,
    build_tokenizer,
    check_target,
    free_port,
    log,
    start_backends,
    start_gateway,
    wait_ready,
    wait_started,
)
from loadtest.overhead.policy import write_policy

TARGET_RATIO = 1.5  # the gateway's added p50 over vllm-router's, at most (issue 39)

_NGINX_CONF = """\
daemon off;
worker_processes 1;
pid {workdir}/{name}.pid;
error_log stderr warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_buffer_size 1m;
    keepalive_requests 1000000;
    {upstream}
    server {{
        listen {host}:{port};
        location / {{
{location}
        }}
    }}
}}
"""
_PROXY_TO_STUB = """\
            proxy_pass http://stub;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;"""


def find_nginx() -> str | None:
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def _start_nginx(procs: Fleet, nginx: str, name: str, upstream: str, location: str) -> Service:
    """One nginx worker, no access log, its `location /` as given, on a free port."""
    port = free_port()
    conf = procs.workdir / f"{name}.conf"
    values = {"workdir": procs.workdir, "name": name, "upstream": upstream, "host": HOST}
    conf.write_text(_NGINX_CONF.format(**values, port=port, location=location))
    argv = [nginx, "-e", "stderr", "-p", str(procs.workdir), "-c", str(conf)]
    return procs.start(name, argv, port)


def start_nginx(procs: Fleet, nginx: str, stub: Service) -> Service:
    """nginx proxying to the stub over kept-alive connections; a connection is never closed
    after its 1,000th request (nginx's default) in a paired run."""
    server = stub.url.removeprefix("http://")
    upstream = f"upstream stub {{ server {server}; keepalive 16; keepalive_requests 1000000; }}"
    return _start_nginx(procs, nginx, "nginx", upstream, _PROXY_TO_STUB)


def start_nginx_stub(procs: Fleet, nginx: str, model: str, tokens: int) -> Service:
    """A replica that costs next to nothing: nginx answering every request with the same
    non-streamed chat completion of `tokens` tokens (it reads no body). For a benchmark whose
    Python stub would take a share of the cores the gateway is measured on."""
    answer = {
        "id": "chatcmpl-nginx", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " tok" * tokens},
                     "finish_reason": "length"}],
        "usage": {"completion_tokens": tokens, "total_tokens": tokens},
    }  # fmt: skip
    location = f"            default_type application/json;\n            return 200 '{json.dumps(answer)}';"
    return _start_nginx(procs, nginx, "nginx-stub", "", location)


def start_vllm_router(procs: Fleet, router: str, stub: Service) -> Service:
    port = free_port()
    argv = [router, "--host", HOST, "--port", str(port), "--worker-urls", stub.url]
    argv += ["--policy", "round_robin", "--log-level", "warning"]
    return procs.start("vllm-router", argv, port)


def paired(
    targets: dict[str, Service], services: list[Service], body: Path, rotations: int
) -> tuple[dict[str, float], float]:
    """Each target's added p50 over direct in µs (requests paired within a rotation), and the
    CPU the machine spent on anything else meanwhile, in cores."""
    argv = [sys.executable, "-m", "loadtest.paired_latency", "--body", str(body)]
    argv += ["--baseline", "direct", "--rotations", str(rotations)]
    argv += [f"{name}={service.port}" for name, service in targets.items()]
    with CpuMeter(targets["direct"], services) as cpu:
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"paired latency client failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout)["targets"]
    for name, data in result.items():
        if data["errors"]:
            raise RuntimeError(f"{name}: {data['errors']} requests failed")
    added = {
        name: 1000 * data["added"]["p50_ms"] for name, data in result.items() if "added" in data
    }
    return added, cpu.other_cores


def run(rounds: int, rotations: int, routers: dict[str, str | None]) -> list[str]:
    lines = [f"# What each proxy adds at one connection ({rounds} rounds)", ""]
    for name, path in routers.items():
        if path is None:
            lines.append(
                f"- {name}: not found, skipped (see `python -m loadtest.bench_routers --help`)"
            )
    with tempfile.TemporaryDirectory(prefix="bench-routers-") as tmp:
        workdir = Path(tmp)
        tokenizer = build_tokenizer(workdir, "loadtest.tiny_tokenizer")
        procs = Fleet(workdir)
        try:
            stub, passthrough = start_backends(procs)
            policy = write_policy(workdir, tokenizer, stub.url, None, None)
            gateway = start_gateway(procs, "gateway", policy)
            starts = {"nginx": start_nginx, "vllm-router": start_vllm_router}
            others = [starts[name](procs, path, stub) for name, path in routers.items() if path]
            wait_started(stub, passthrough, [gateway])
            body = workdir / "short.json"
            body.write_text(dumps(short_chat()))
            for service in others:
                wait_ready(service, None)
                check_target(service.name, service.port, {"short": body.read_text()})
            targets = {"direct": stub, "pass-through": passthrough}
            targets |= {s.name: s for s in others} | {"gateway": gateway}
            services = list(targets.values())
            names = [n for n in targets if n != "direct"]
            lines += ["", "| round | " + " | ".join(names) + " | other CPU |"]
            lines.append("|---" * (len(names) + 2) + "|")
            per_round: dict[str, list[float]] = {name: [] for name in names}
            for n in range(rounds):
                added, other = paired(targets, services, body, rotations)
                for name in names:
                    per_round[name].append(added[name])
                cells = " | ".join(f"{added[name]:.0f} µs" for name in names)
                lines.append(f"| {n + 1} | {cells} | {other:.2f} |")
                log(lines[-1])
            medians = {name: statistics.median(v) for name, v in per_round.items()}
            lines.append("| median | " + " | ".join(f"{medians[n]:.0f} µs" for n in names) + " | |")
            lines.append("")
            for name in names:
                if name != "gateway" and medians[name] > 0:
                    lines.append(f"- gateway / {name}: {medians['gateway'] / medians[name]:.2f}x")
            if "vllm-router" in medians:
                ratio = medians["gateway"] / medians["vllm-router"]
                verdict = "met" if ratio <= TARGET_RATIO else "missed"
                lines.append(f"- target gateway <= {TARGET_RATIO}x vllm-router: {verdict}")
        finally:
            procs.stop()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="paired runs (>= 1)")
    parser.add_argument("--rotations", type=int, default=30, help="of each paired run (>= 1)")
    parser.add_argument("--vllm-router", help="its executable (default: on PATH)")
    parser.add_argument("--nginx", help="its executable (default: on PATH or in /usr/sbin)")
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.rotations < 1:
        parser.error("need --rounds >= 1 and --rotations >= 1")
    routers = {
        "nginx": args.nginx or find_nginx(),
        "vllm-router": args.vllm_router or shutil.which("vllm-router"),
    }
    lines = run(args.rounds, args.rotations, routers)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
