"""The processes of a benchmark run: the stub replica, the pass-through, gateways, Redis.

Each child runs in its own process group, on a free loopback port, its stderr in a log file the
errors quote; `Fleet.stop` kills every group, and callers stop it in a `finally`. A target must
answer before anything is measured (`wait_ready`, `wait_started`) and must answer real requests
with 200 (`check_target`): a benchmark of fast 4xx answers is worthless. `CpuMeter` reads what
each process spent from /proc, and what else the shared machine did meanwhile. `loadtest.bench_ab`,
`loadtest.bench_instructions`, `loadtest.bench_vllm` and `loadtest.soak` start their processes
with these too.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from loadtest.overhead.bodies import CHAT_PATH, STREAM_TOKENS

ROOT = Path(__file__).resolve().parents[2]  # the checkout: loadtest/overhead/fleet.py
HOST = "127.0.0.1"
TARGETS = ("direct", "pass-through", "gateway")
READY_TIMEOUT_S = 120.0  # the gateway imports transformers and loads three tokenizers first


def log(message: str, stream: TextIO = sys.stderr) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=stream, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Service:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def cpu_seconds(self) -> float:
        """User + system CPU of the process, all threads (the gateway tokenizes in a pool)."""
        return _cpu_seconds(Path(f"/proc/{self.proc.pid}/stat"))

    def rss_mb(self) -> float:
        """The process's resident memory, in MB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def loop_cpu_seconds(self) -> float:
        """User + system CPU of the process's main thread: the event loop, without the pool."""
        return _cpu_seconds(Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/stat"))

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


def _cpu_seconds(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Fleet:
    """The processes of one run; `stop` kills each one's whole process group."""

    workdir: Path
    services: list[Service] = field(default_factory=list)

    def start(self, name: str, argv: list[str], port: int, cwd: Path = ROOT) -> Service:
        """Stdout goes to /dev/null: for the gateway that is its access log, on and written.
        `cwd` is the checkout whose `gateway` package a gateway runs (`loadtest.bench_ab`)."""
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as err, open(os.devnull, "wb") as out:
            proc = subprocess.Popen(
                argv, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        service = Service(name, port, proc, log)
        self.services.append(service)
        return service

    def stop(self) -> None:
        for service in self.services:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for service in self.services:
            try:
                service.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(service.proc.pid, signal.SIGKILL)
                service.proc.wait(timeout=5)


def http_request(
    port: int,
    method: str,
    path: str,
    body: str | bytes | None = None,
    timeout: float = 10,
    content_type: str = "application/json",
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = {"Content-Type": content_type} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def wait_ready(service: Service, path: str | None, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll until the service answers `path` with 200 (or accepts a connection when None)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(
                f"{service.name} exited with {service.proc.returncode}:\n{service.log_tail()}"
            )
        try:
            if path is None:
                socket.create_connection((HOST, service.port), timeout=1).close()
                return
            if http_request(service.port, "GET", path, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{service.name} not ready after {timeout_s:.0f}s:\n{service.log_tail()}")


def check_target(name: str, port: int, bodies: dict[str, str]) -> None:
    """One real request of each kind must succeed: a benchmark of fast 4xx answers is worthless."""
    for kind, body in bodies.items():
        status, headers, data = http_request(port, "POST", CHAT_PATH, body)
        if status != 200:
            raise RuntimeError(f"{name}: {kind} request answered {status}: {data[:300]!r}")
        if kind == "stream":
            if not data.rstrip().endswith(b"data: [DONE]") or data.count(b"data: ") < STREAM_TOKENS:
                raise RuntimeError(
                    f"{name}: the stream is not a complete SSE answer: {data[:300]!r}"
                )
        elif not json.loads(data).get("choices"):
            raise RuntimeError(f"{name}: {kind} answer has no choices: {data[:300]!r}")
        if name.startswith("gateway") and "x-request-id" not in headers:
            raise RuntimeError("gateway: no x-request-id header: is this really the gateway?")


class CpuMeter:
    """CPU spent during one measured run, split into the target's process and everything else.

    The machine is shared (other sessions run tests on the same two cores), so each run also
    reports the CPU that neither the benchmark's services nor its load generator used: a run with
    much of it was disturbed, whatever its numbers say.
    """

    def __init__(self, target: Service, services: Sequence[Service]) -> None:
        self.target = target
        self.services = services

    @staticmethod
    def _machine_busy() -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _children() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk or the TTFB client, once reaped
        return usage.ru_utime + usage.ru_stime

    def __enter__(self) -> CpuMeter:
        self._wall = time.perf_counter()
        self._busy = self._machine_busy()
        self._children0 = self._children()
        self._cpu = [s.cpu_seconds() for s in self.services]
        self._loop = self.target.loop_cpu_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._wall
        used = [
            s.cpu_seconds() - before for s, before in zip(self.services, self._cpu, strict=True)
        ]
        self.target_s = used[self.services.index(self.target)]
        self.target_loop_s = self.target.loop_cpu_seconds() - self._loop
        ours = sum(used) + self._children() - self._children0
        self.other_cores = max(0.0, self._machine_busy() - self._busy - ours) / wall


def build_tokenizer(workdir: Path, module: str) -> Path:
    """A tokenizer built by `module` (`loadtest.tiny_tokenizer`), in a child process so its
    import cost stays out of ours."""
    log(f"building {module}")
    tokenizer = workdir / module.rsplit(".", 1)[1]
    subprocess.run(
        [sys.executable, "-m", module, str(tokenizer)], cwd=ROOT, check=True,
        capture_output=True, timeout=300,
    )  # fmt: skip
    return tokenizer


def start_redis(procs: Fleet) -> str:
    """A memory-only redis-server on a free loopback port, for `state: redis`; its URL."""
    port = free_port()
    redis = procs.start(
        "redis",
        ["redis-server", "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"],
        port,
    )  # fmt: skip
    wait_ready(redis, None)
    return f"redis://{HOST}:{port}/0"


def start_backends(procs: Fleet, wrap: Sequence[str] = ()) -> tuple[Service, Service]:
    """The zero-delay stub replica and the minimal pass-through in front of it; `wrap` runs
    the pass-through under another program (`loadtest.bench_instructions`: callgrind)."""
    py, stub_port, pt_port = sys.executable, free_port(), free_port()
    stub = procs.start(
        "direct",
        [
            py,
            "-m",
            "loadtest.stub_backend",
            "--host",
            HOST,
            "--port",
            str(stub_port),
            "--no-record",
        ],
        stub_port,
    )
    passthrough = procs.start(
        "pass-through",
        [*wrap, py, "-m", "loadtest.passthrough", "--host", HOST, "--port", str(pt_port),
         "--upstream", stub.url],
        pt_port,
    )  # fmt: skip
    return stub, passthrough


def start_gateway(
    procs: Fleet, name: str, policy: Path, checkout: Path = ROOT, wrap: Sequence[str] = ()
) -> Service:
    """`python -m gateway serve` of `checkout`'s gateway package on a free port (under `wrap`,
    as `start_backends` runs the pass-through)."""
    port = free_port()
    argv = [*wrap, sys.executable, "-m", "gateway", "serve", "--policy", str(policy)]
    argv += ["--host", HOST]
    return procs.start(name, [*argv, "--port", str(port)], port, cwd=checkout)


def wait_started(
    stub: Service,
    passthrough: Service,
    gateways: Sequence[Service],
    timeout_s: float = READY_TIMEOUT_S,
) -> None:
    """Started together, so their start-ups overlap; each must answer before anything runs."""
    wait_ready(stub, "/health", timeout_s)
    wait_ready(passthrough, None, timeout_s)
    for gateway in gateways:
        wait_ready(gateway, "/readyz", timeout_s)
