"""What the gateway costs on top of the cheapest Python proxy, measured side by side in one run.

Absolute numbers on a 2-core machine swing 2-3x between runs (docs/benchmarks.md), so this
benchmark never reports the gateway alone: it starts three targets at once — the zero-delay stub
replica, a bare aiohttp pass-through to it (`loadtest.passthrough`) and the gateway to it — and
measures them back to back, under the same load generator, in the same minute. The ratios between
them are the result; the raw numbers only give them a scale.

- Throughput and latency come from `wrk` (C, one thread), not from Python: a Python load generator
  costs about as much CPU per request as the proxies it measures, so on two cores it would become
  the bottleneck and blur exactly the differences measured here.
- (a) a short chat request, (b) a ~4,000-token classification request (tiny tokenizer) whose
  system message (a rules block) is identical in every request and whose user message varies per
  request, at 1, 16 and 64 connections.
- (a) at one connection again, once a round, the three targets side by side in alternating
  blocks (`loadtest.paired_latency`): wrk's runs come one after another while the machine's
  speed drifts, and issue 15's one-connection verdict is a quotient of differences of p50s.
- (c) time to first body byte of a 20-chunk stream at 16 connections, which wrk cannot see, from a
  small asyncio raw-socket client run as its own process (`--ttfb-client`, internal).
- What counting costs on the tokenizers users serve, at 16 connections: (d) Gemma 3 and (e)
  Llama 3 (their real tokenizer.json and chat template, `loadtest.real_tokenizers`), each a
  classification chat of ~4,000 tokens of real English prose (`loadtest.prose`: ~3,000 tokens of
  rules in the system message, ~1,000 of product text in the user's, max_tokens 10), every one
  unique: drawn from a seed printed with the report (from the OS unless `--seed`) and sized from
  the warm-up's rate, so no cache of the gateway's or of a tokenizer's can have seen a whole
  prompt, and words are as varied as prose's. A vocabulary of a few thousand words would live in
  the tokenizers' word caches and flatter the count. Beside the gateway's CPU per request, in the
  same run: what the counting backend the gateway chose for the model (`explain`'s
  `counting_backend`) spends alone on the same rendered texts, what the tokenizers library alone
  (`encode_batch_fast`) spends on them, both in this process on the threads the gateway would
  count them on, and the pass-through's CPU per request for the same bodies: the gateway's
  target is the sum of the two (counting plus the cheapest proxying). And the simulated 27B
  classification replicas (8.6 req/s each) one gateway core keeps up with.
- (f) (d) and (e) again on a second gateway with one tokenizer thread, against the first (by
  default as many threads as CPUs): how counting scales with the cores. wrk reads prepared
  bodies, so the load generator leaves the cores to the gateway.

    python -m loadtest.bench_overhead [--duration 5] [--rounds 1] [--seed N] [--out loadtest/out/overhead.md]

Everything listens and connects on 127.0.0.1 only; every child runs in its own process group and is
killed in a `finally`; every load loop is bounded in time and in requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import http.client
import itertools
import json
import math
import os
import platform
import random
import re
import resource
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from gateway.tokenizer.cpus import available_cpus
from loadtest import prose, real_tokenizers

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
MODEL = "bench-model"
CHAT_PATH = "/v1/chat/completions"
CONNECTIONS = (1, 16, 64)
TTFB_CONNECTIONS = 16
STREAM_TOKENS = 20
TARGETS = ("direct", "pass-through", "gateway")
ONE_THREAD = "gateway-1t"  # the gateway again with one tokenizer thread, for (f)
DEFAULT_OUT = ROOT / "loadtest" / "out" / "overhead.md"
READY_TIMEOUT_S = 120.0  # the gateway imports transformers and loads three tokenizers first
MAX_TTFB_REQUESTS = 200_000  # per run: a hard bound beside the time limit
RULE_COUNT = 65  # with the tiny tokenizer: ~3,850 tokens of rules, ~4,000 with the listing

# The project's targets (docs/benchmarks.md): gateway vs the pass-through, run side by side.
TARGET_RPS_SHORT = 0.6
TARGET_RPS_CLASSIFY = 0.4
TARGET_ADDED_P50 = 2.0
# Issue 15's, for the short path: CPU and req/s at 64 connections, added p50 at one.
TARGET_CPU_SHORT_15, TARGET_RPS_SHORT_15, TARGET_ADDED_P50_15 = 1.5, 0.7, 1.3
OTHER_CPU_WARN = 0.15  # cores used by anything else during a run before the report says so
COUNTING_CONNECTIONS = 16
RULES_TOKENS, LISTING_TOKENS = 3000, 1000  # a counting chat's system and user messages, ~4,000
WARM_BODIES = 300  # fresh bodies for a gateway's 1 s warm-up; its rate sizes the measured run's
MAX_BODIES = 20_000  # ~400 MB of bodies at most per run; a run outlasting them says so
ALONE_TEXTS = 300  # of the gateway's bodies, rendered and counted by each library alone
TARGET_OVER_ALONE = 1.3  # gateway CPU / (the counting backend alone + the pass-through's)
TARGET_THREADS = 1.6  # (f) req/s with 2 tokenizer threads on 2 cores over 1 thread's
CLASSIFY_RPS_PER_REPLICA = 8.6  # one simulated TPU v6e 2x2 replica of Gemma 3 27B (capacity.md)


@dataclass(frozen=True)
class Counted:
    """A real model whose counting (d)/(e) measure, and issue 26's target for it."""

    row: str  # the request's letter in the report
    key: str  # its `loadtest.real_tokenizers` name
    label: str
    min_replicas: int  # simulated 27B classification replicas per gateway core

    @property
    def model(self) -> str:
        return f"bench-{self.key}"


COUNTED = (Counted("d", "gemma3", "Gemma 3", 100), Counted("e", "llama3", "Llama 3", 250))


# --- the requests --------------------------------------------------------------------------------

_SUBJECTS = (
    "lithium battery packs", "children's toys", "medical devices", "dietary supplements",
    "replica brand items", "knives and blades", "cosmetics", "used electronics",
    "prescription drugs", "e-cigarettes", "pet food", "car seats", "baby formula", "sunscreen",
    "phone chargers",
)  # fmt: skip
_RULES = (
    "Listings for {s} must not claim that the product will cure, treat or prevent any medical"
    " condition.",
    "Sellers of {s} must show a valid safety certificate and the certificate number in the"
    " description.",
    "A listing for {s} is prohibited if the image text (OCR) contradicts the description or the"
    " brand.",
    "Price claims for {s} such as 'lowest price' or 'was/now' must be supported by a price history"
    " of 30 days.",
    "Warranty and refund terms for {s} must be stated; a listing that says 'no refund' for {s} is"
    " allowed only for custom items.",
    "If the listing for {s} mentions a counterfeit, replica or 'inspired by' brand, label it as"
    " prohibited.",
    "Shipping of {s} by air must follow the carrier's dangerous goods rules; state the category"
    " and label number.",
)
_LISTINGS = (
    "{s}, brand new in box, ships from our warehouse in two days. Includes a one year warranty"
    " and a free carry case. Certificate number {n} is printed on the label.",
    "Second hand {s} in good condition, small scratches on the side, tested and working. No"
    " refund on used items, but we answer every question within a day.",
    "Premium {s} that doctors recommend: helps with sleep, pain and stress. Lowest price on the"
    " market, was 49.99, now 19.99, only {n} left in stock.",
    "{s} inspired by a famous designer brand, same look at a tenth of the price. Ships by air"
    " worldwide, battery included, category label {n}.",
)
_PLACEHOLDER = "@@LISTING@@"


_INSTRUCTIONS = (
    "You are a marketplace compliance reviewer. Read the rules, then classify the product"
    " listing the user gives you.\n"
    "Answer with exactly one label: ALLOW, REVIEW or PROHIBIT. Do not explain.\n"
)


def rules_block() -> str:
    """The system prompt every classification request repeats word for word."""
    lines = [_INSTRUCTIONS]
    for i in range(RULE_COUNT):
        rule = _RULES[(i * 5) % len(_RULES)]
        lines.append(f"Rule {i + 1}. " + rule.format(s=_SUBJECTS[(i * 7) % len(_SUBJECTS)]))
    return "\n".join(lines)


def listings() -> list[str]:
    """Product descriptions the classification request cycles through (a SKU makes each unique)."""
    return [
        template.format(s=subject.capitalize(), n=1000 + 37 * i)
        for i, (template, subject) in enumerate((t, s) for t in _LISTINGS for s in _SUBJECTS[:8])
    ]


def short_chat() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello to the benchmark in a few words."}],
        "max_tokens": 16,
    }


def classify_chat(listing: str, rules: str | None = None, model: str = MODEL) -> dict[str, Any]:
    """A classification request: `rules` (by default the fixed block) and a listing to label."""
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": rules_block() if rules is None else rules},
            {"role": "user", "content": f"Classify this listing.\n\n{listing}"},
        ],
        "max_tokens": 10,
        "temperature": 0,
    }


def prose_chat(model: str, chars_per_token: float, rng: random.Random) -> dict[str, Any]:
    """A classification request of ~4,000 tokens of prose, every word of it drawn from `rng`:
    ~3,000 tokens of rules, ~1,000 of listing, sized by the model's `chars_per_token`."""
    rules = prose.text(rng, round(RULES_TOKENS * chars_per_token))
    listing = prose.text(rng, round(LISTING_TOKENS * chars_per_token))
    return classify_chat(listing, f"{_INSTRUCTIONS}\n{rules}", model)


def stream_chat() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Stream twenty tokens to the benchmark."}],
        "max_tokens": STREAM_TOKENS,
        "stream": True,
    }


def dumps(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"))


# --- wrk scripts ---------------------------------------------------------------------------------

# wrk prints this line from `done`; latency percentiles are in microseconds.
_DONE_LUA = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%d duration_us=%d p50_us=%d p99_us=%d connect=%d read=%d write=%d status=%d timeout=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


def _lua_string(text: str) -> str:
    """A Lua long-bracket literal: no escaping, so the JSON goes out byte for byte."""
    level = 1
    while f"]{'=' * level}]" in text:
        level += 1
    return f"[{'=' * level}[{text}]{'=' * level}]"


def static_lua(body: str) -> str:
    """The same body on every request: wrk builds it once, the cheapest load to generate."""
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {_lua_string(body)}\n" + _DONE_LUA
    )


def varying_lua(prefix: str, variants: Sequence[str], suffix: str) -> str:
    """A new user message per request (SKU counter + a cycled listing) around a fixed rules block.

    Each body is unique, so nothing downstream can cache the whole request; only the rules block
    repeats, as in a real classification workload.
    """
    items = ",\n".join(_lua_string(v) for v in variants)
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"local prefix = {_lua_string(prefix)}\n"
        f"local suffix = {_lua_string(suffix)}\n"
        f"local listings = {{\n{items}\n}}\n"
        "local counter = 0\n"
        "local threads = 0\n"
        "-- setup runs in the main state and sets the global `id` in each thread's own state\n"
        "setup = function(thread) threads = threads + 1; thread:set('id', threads) end\n"
        "request = function()\n"
        "  counter = counter + 1\n"
        "  local listing = listings[(counter % #listings) + 1]\n"
        "  local body = prefix .. 'SKU ' .. tostring(id or 0) .. '-' .. tostring(counter) .. ': '"
        " .. listing .. suffix\n"
        "  return wrk.format(nil, nil, nil, body)\n"
        "end\n" + _DONE_LUA
    )


def bodies_lua(path: Path) -> str:
    """Bodies read once from `path` (one JSON body a line), sent in order and, if the run
    outlasts them, again from the top. Building a 33 KB body in Lua per request took a share of
    the cores the gateway's tokenizer threads need; reading prepared ones costs wrk next to
    nothing, so a gateway with 2 threads can be shown using 2 cores."""
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        "local bodies = {}\n"
        f"for line in io.lines({_lua_string(str(path))}) do bodies[#bodies + 1] = line end\n"
        "local sent = 0\n"
        "request = function()\n"
        "  sent = sent + 1\n"
        "  return wrk.format(nil, nil, nil, bodies[(sent - 1) % #bodies + 1])\n"
        "end\n" + _DONE_LUA
    )


def write_bodies(
    path: Path,
    counted: Counted,
    chars_per_token: float,
    count: int,
    rng: random.Random,
    keep: int = 0,
) -> list[dict[str, Any]]:
    """`count` prose chats of `counted`'s model drawn from `rng` (seeded once per run: no earlier
    run sent them), one JSON body a line; the first `keep` of them returned, to be counted alone."""
    kept = []
    with open(path, "w") as out:
        for n in range(count):
            chat = prose_chat(counted.model, chars_per_token, rng)
            out.write(dumps(chat) + "\n")
            if n < keep:
                kept.append(chat)
    return kept


def classify_parts() -> tuple[str, list[str], str]:
    """The classification body split around the listing, each part already JSON-escaped."""
    body = dumps(classify_chat(_PLACEHOLDER))
    prefix, suffix = body.split(_PLACEHOLDER)
    return prefix, [json.dumps(x)[1:-1] for x in listings()], suffix


# --- processes -----------------------------------------------------------------------------------


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
    port: int, method: str, path: str, body: str | None = None, timeout: float = 10
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
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


def write_policy(
    workdir: Path,
    tokenizer: Path,
    replica: str,
    redis_url: str | None,
    tokenizer_threads: int | None,
    name: str = "policy.yaml",
    counted: Mapping[str, Path] | None = None,
) -> Path:
    """The tiny tokenizer's model and `counted`'s (model name: tokenizer directory, each counted
    by the backend `auto` chooses), a pool each of the one replica with caps that never queue,
    access log on; with `redis_url`, quotas and slots shared through Redis as several gateways
    would run."""
    pool = {"replicas": [replica], "max_concurrency": 100000, "queue": {"max_depth": 1024}}
    models = {MODEL: tokenizer, **(counted or {})}
    policy: dict[str, Any] = {
        "models": {
            model: {"tokenizer": str(directory), "max_model_len": 32768}
            for model, directory in models.items()
        },
        "pools": {model: {"model": model, **pool} for model in models},
        "classes": [
            {
                "name": "prefill_heavy",
                "when": {"input_tokens": {"gte": 1024}, "output_tokens": {"lte": 64}},
            },
            {"name": "decode_heavy", "when": {}},
        ],
        "routes": [{"match": {"model": model}, "pool": model} for model in models],
        "server": {"access_log": True, "drain_grace_s": 2},
    }
    if tokenizer_threads is not None:
        policy["server"]["tokenizer_threads"] = tokenizer_threads
    if redis_url is not None:
        policy["state"] = {"backend": "redis", "url": redis_url, "gateways": 3}
    path = workdir / name
    path.write_text(json.dumps(policy, indent=2))  # JSON is YAML
    return path


def explain(policy: Path, body: str, workdir: Path) -> dict[str, Any]:
    """How the gateway itself counts and classifies a request (offline, `llm-gateway explain`)."""
    request = workdir / "explain.json"
    request.write_text(body)
    argv = [sys.executable, "-m", "gateway", "explain", "--policy", str(policy), "--json"]
    out = subprocess.run(
        [*argv, str(request)], cwd=ROOT, capture_output=True, check=True, timeout=120
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


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


# --- measuring -----------------------------------------------------------------------------------


@dataclass
class Run:
    request: str
    connections: int
    target: str
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    cpu_ms_per_request: float | None
    other_cores: float
    round: int = 0  # (a) and (b) run `--rounds` times; each round's ratios are its own pairs
    loop_ms_per_request: float | None = None  # of `cpu_ms_per_request`, the main thread's


_BENCH_LINE = re.compile(r"^BENCH (.*)$", re.M)


def run_wrk(url: str, script: Path, connections: int, duration: int) -> dict[str, int]:
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--timeout", "5s"]
    out = subprocess.run(
        [*argv, "-s", str(script), url + CHAT_PATH],
        capture_output=True, text=True, timeout=duration + 30, check=False,
    )  # fmt: skip
    match = _BENCH_LINE.search(out.stdout)
    if out.returncode != 0 or match is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout}\n{out.stderr}")
    return {k: int(v) for k, v in (item.split("=") for item in match.group(1).split())}


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


def measure(
    request: str,
    target: Service,
    services: Sequence[Service],
    script: Path,
    connections: int,
    duration: int,
) -> Run:
    """One wrk run, plus the CPU the target's own process (stub or proxy) spent per request."""
    with CpuMeter(target, services) as cpu:
        stats = run_wrk(target.url, script, connections, duration)
    requests = stats["requests"]
    errors = sum(stats[k] for k in ("connect", "read", "write", "status", "timeout"))
    return Run(
        request=request,
        connections=connections,
        target=target.name,
        rps=requests / (stats["duration_us"] / 1e6),
        p50_ms=stats["p50_us"] / 1000,
        p99_ms=stats["p99_us"] / 1000,
        requests=requests,
        errors=errors,
        cpu_ms_per_request=1000 * cpu.target_s / requests if requests else None,
        other_cores=cpu.other_cores,
        loop_ms_per_request=1000 * cpu.target_loop_s / requests if requests else None,
    )


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


@dataclass
class Paired:
    """One `loadtest.paired_latency` run: each target's one-connection p50, side by side."""

    shape: str  # how `loadtest.paired_latency` measured, in words
    p50_ms: dict[str, float | None]
    requests: int
    errors: int
    other_cores: float

    def added(self, name: str = "gateway") -> float | None:
        """What `name` adds to direct's p50, over what the pass-through adds."""
        return added_ratio(*(self.p50_ms.get(t) for t in ("direct", "pass-through", name)))


def added_ratio(direct: float | None, base: float | None, other: float | None) -> float | None:
    """(other - direct) / (base - direct): the latency `other` adds in units of what `base` adds;
    None when a figure is missing or `base` adds nothing."""
    if direct is None or base is None or other is None or base <= direct:
        return None
    return (other - direct) / (base - direct)


def measure_paired(
    targets: Mapping[str, Service], services: Sequence[Service], body: Path
) -> Paired:
    """The short request at one connection, `targets` (direct, the pass-through and one or more
    gateways) in alternating blocks; "other CPU" is what nothing of `services` used."""
    argv = [sys.executable, "-m", "loadtest.paired_latency", "--body", str(body)]
    argv += [f"{name}={service.port}" for name, service in targets.items()]
    with CpuMeter(targets["direct"], services) as cpu:
        out = subprocess.run(
            argv, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False
        )
    if out.returncode != 0:
        raise RuntimeError(f"paired latency client failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout)
    data = result["targets"]
    return Paired(
        shape=result["shape"],
        p50_ms={name: data[name]["p50_ms"] for name in targets},
        requests=min(data[name]["requests"] for name in targets),
        errors=sum(data[name]["errors"] for name in targets),
        other_cores=cpu.other_cores,
    )


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of a sorted sequence."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# --- the TTFB client (runs in its own process) ---------------------------------------------------


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


def chat_request(body: bytes, port: int) -> bytes:
    """A whole HTTP/1.1 chat-completions request with `body`, as the raw-socket clients send it."""
    return (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _ttfb_main(port: int, body: bytes, duration: float, connections: int) -> dict[str, Any]:
    request = chat_request(body, port)
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


class Alone:
    """One library encoding one model's `tokenizer.json` alone, in this process: what counting
    costs without the gateway around it.

    Measured just before the gateway run it is compared with, on texts that run sends and on the
    threads the gateway would count them on: the machine's speed moves by a third within minutes
    here, and two busy cores make each one slower, so a figure taken once, single-threaded,
    before the load flattered or wronged the gateway by as much as the ratio it was meant to
    check."""

    def __init__(self, library: str, tokenizer_json: Path, threads: int) -> None:
        from gateway.policy.schema import ServerSpec
        from gateway.tokenizer.counters import (
            INLINE_SHARE,  # also sets the gateway's TOKENIZERS_PARALLELISM
        )

        self.count: Callable[[str], int] = (
            _fastokens_count(tokenizer_json)
            if library == "fastokens"
            else _tokenizers_count(tokenizer_json)
        )
        # Where the gateway counts a text of this library (gateway/tokenizer/counters.py), at the policy's
        # default `inline_tokenize_max_chars`: longer ones on its tokenizer threads.
        limit: int = ServerSpec.model_fields["inline_tokenize_max_chars"].default
        self.inline_max = limit if library == "fastokens" else limit // INLINE_SHARE
        self.count("warm up")
        # Long-lived, as the gateway's tokenizer threads are: fastokens keeps state per thread
        # (its regex engine's caches), and a new thread's first few dozen Llama 3 texts cost up
        # to ten times its later ones.
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"alone-{library}")

    def cost(self, texts: list[str]) -> tuple[float, float]:
        """The mean thread-CPU ms and the mean tokens per text; as the gateway counts them, those
        over its inline limit on all the threads at once, the rest one at a time on this one."""
        spent: list[float] = []
        tokens: list[int] = []

        def count(share: list[str]) -> None:
            for text in share:
                started = time.thread_time()
                tokens.append(self.count(text))
                spent.append(time.thread_time() - started)

        count([text for text in texts if len(text) <= self.inline_max])
        threaded = [text for text in texts if len(text) > self.inline_max]
        list(self._pool.map(count, [threaded[i :: self.threads] for i in range(self.threads)]))
        return 1000 * statistics.fmean(spent), statistics.fmean(tokens)


def _fastokens_count(tokenizer_json: Path) -> Callable[[str], int]:
    """fastokens' count of a rendered chat (`encode`, no special tokens: the template wrote them)."""
    import fastokens

    tokenizer = fastokens.Tokenizer.from_file(str(tokenizer_json))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def _tokenizers_count(tokenizer_json: Path) -> Callable[[str], int]:
    """The tokenizers library's (`encode_batch_fast`: the batch entry point releases the GIL)."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return lambda text: len(tokenizer.encode_batch_fast([text], add_special_tokens=False)[0])


@dataclass
class Libraries:
    """One real model's side of (d)/(e): its chat template, and the library the gateway counts it
    with and the tokenizers library, each alone."""

    counted: Counted
    backend: str  # the gateway's choice for this model: `explain`'s `counting_backend`
    alone: dict[str, Alone]  # the backend's and the tokenizers library's (one, if the same)
    chars_per_token: float  # of prose, by this tokenizer: sizes its ~4,000-token chats
    template: Any  # the transformers tokenizer whose chat template renders a chat, as vLLM's

    @classmethod
    def load(cls, counted: Counted, directory: Path, backend: str, threads: int) -> Libraries:
        from gateway.tokenizer.counters import load_tokenizer

        alone = {
            library: Alone(library, directory / "tokenizer.json", threads)
            for library in dict.fromkeys((backend, "tokenizers"))
        }
        sample = prose.text(random.Random(0), 200_000)
        chars_per_token = len(sample) / alone[backend].count(sample)
        return cls(counted, backend, alone, chars_per_token, load_tokenizer(str(directory)))

    def render(self, chat: dict[str, Any]) -> str:
        """The prompt vLLM encodes for `chat` (transformers' rendering, generation prompt on)."""
        text: str = self.template.apply_chat_template(
            chat["messages"], tokenize=False, add_generation_prompt=True
        )
        return text


@dataclass
class AloneCost:
    """What one library alone spent per text on (a sample of) the gateway's texts."""

    ms: float
    tokens: float
    chars: float


def counting_report(
    runs: list[Run],
    own: dict[tuple[str, str], AloneCost],
    libraries: list[Libraries],
    threads_label: str,
    notes: list[str],
) -> list[str]:
    """(d)/(e): the gateway's CPU per request against each library alone plus the pass-through's,
    the verdicts, and (f)."""
    by = {(r.request, r.target): r for r in runs if r.connections == COUNTING_CONNECTIONS}
    lines = [
        "",
        f"Counting on the real tokenizers, {COUNTING_CONNECTIONS} connections, every prompt new:"
        " CPU per request in ms. Gateway: all its threads (of it, the main thread's: the event"
        " loop, serving HTTP and rendering, everything but encoding these long texts, which runs"
        " on the tokenizer threads). Alone: the library's mean thread-CPU per text on"
        f" {ALONE_TEXTS} of the texts the gateway's run sends, rendered by the model's chat"
        f" template, on {threads_label} at once as the gateway counts them, in this process just"
        " before the gateway's run. Pass-through: the same bodies through it. Replicas per core:"
        f" 1,000 / (gateway CPU ms) / {CLASSIFY_RPS_PER_REPLICA} classification req/s of a"
        " simulated 27B replica.",
        "",
        "| request | counted by | tokens per prompt | characters | gateway | of which the event"
        " loop | counting backend alone | tokenizers alone | pass-through | gateway req/s |"
        " other CPU | 27B replicas per gateway core |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = ["", "| ratio | value | target | result |", "|---|---:|---:|---|"]
    for lib in libraries:
        counted, backend = lib.counted, lib.backend
        row = counted.row
        gw, pt = by.get((row, "gateway")), by.get((row, "pass-through"))
        mine, theirs = own.get((row, backend)), own.get((row, "tokenizers"))
        if gw is None or pt is None or mine is None or theirs is None:
            continue
        cpu, loop, base = (
            gw.cpu_ms_per_request or 0,
            gw.loop_ms_per_request or 0,
            pt.cpu_ms_per_request or 0,
        )
        replicas = 1000 / cpu / CLASSIFY_RPS_PER_REPLICA if cpu else None
        lines.append(
            f"| ({row}) {counted.label} | {backend} | {mine.tokens:,.0f} | {mine.chars:,.0f} |"
            f" {cpu:.3f} | {loop:.3f} | {mine.ms:.3f} | {theirs.ms:.3f} | {base:.3f} |"
            f" {gw.rps:,.0f} | {max(gw.other_cores, pt.other_cores):.2f} |"
            f" {'-' if replicas is None else f'{replicas:.0f}'} |"
        )
        name = f"({row}) {counted.label}"
        over, verdict = _ratio(cpu / (mine.ms + base), TARGET_OVER_ALONE, False)
        verdicts.append(
            f"| {name}: gateway / ({backend} alone + pass-through) | {over} |"
            f" <= {TARGET_OVER_ALONE} | {verdict} |"
        )
        shown, verdict = _ratio(replicas, counted.min_replicas, True)
        bound = 1000 / counted.min_replicas / CLASSIFY_RPS_PER_REPLICA
        verdicts.append(
            f"| {name}: 27B classification replicas per gateway core | {shown} |"
            f" >= {counted.min_replicas} (<= {bound:.3f} ms) | {verdict} |"
        )
        if backend != "tokenizers":
            verdicts.append(
                f"| {name}: gateway / (tokenizers alone + pass-through) |"
                f" {cpu / (theirs.ms + base):.3f} | - | - |"
            )
    lines += verdicts
    threads_rows, threads_verdicts = [], []
    for lib in libraries:
        row = lib.counted.row
        many, one = by.get((row, "gateway")), by.get((row, ONE_THREAD))
        if not (many and one and one.rps):
            continue
        threads_rows += [
            f"| ({row}) {lib.counted.label} | {label} | {r.rps:,.0f} | {r.cpu_ms_per_request or 0:.3f} |"
            f" {r.rps * (r.cpu_ms_per_request or 0) / 1000:.2f} | {r.other_cores:.2f} |"
            for label, r in ((threads_label, many), ("1", one))
        ]
        shown, verdict = _ratio(many.rps / one.rps, TARGET_THREADS, True)
        threads_verdicts.append(
            f"| (f) ({row}) req/s with {threads_label} / with 1 | {shown} | >= {TARGET_THREADS} |"
            f" {verdict} |"
        )
    if threads_rows:
        lines += [
            "",
            f"(f) Tokenizer threads: (d) and (e) at {COUNTING_CONNECTIONS} connections on the"
            f" gateway with {threads_label} against the same gateway with one.",
            "",
            "| request | threads | req/s | gateway CPU ms/req | cores the gateway used | other CPU |",
            "|---|---|---:|---:|---:|---:|",
            *threads_rows,
            "",
            "| ratio | value | target | result |",
            "|---|---:|---:|---|",
            *threads_verdicts,
        ]
    if notes:
        lines += ["", *(f"**{note}**" for note in notes)]
    return lines


def measure_counting(
    targets: dict[str, Service],
    services: Sequence[Service],
    libraries: list[Libraries],
    workdir: Path,
    duration: int,
    rng: random.Random,
    notes: list[str],
    own: dict[tuple[str, str], AloneCost],
) -> list[Run]:
    """(d) and (e) on the gateway, the pass-through and the one-thread gateway (f).

    A gateway's runs send bodies no earlier run sent: a fresh set for its warm-up, then one
    sized from the warm-up's rate (twice what it would need), so no cache has seen any of them;
    a run that still outlasts its set is noted in `notes`. The pass-through is sent the bodies
    the gateway just was. Before the gateway's run, `own[(request, library)]` gets what each
    library alone spends on the first of the bodies it is about to be sent, on as many threads
    as the gateway's, once it has counted the gateway's warm-up bodies on them."""
    runs = []
    for lib in libraries:
        request, script = lib.counted.row, workdir / f"counting-{lib.counted.row}.lua"
        measured = workdir / f"bodies-{request}.txt"
        for name in ("gateway", "pass-through", ONE_THREAD):
            target, counted = targets[name], name != "pass-through"
            if counted:
                warm = workdir / "bodies-warm.txt"
                warm_chats = write_bodies(
                    warm, lib.counted, lib.chars_per_token, WARM_BODIES, rng,
                    WARM_BODIES if name == "gateway" else 0,
                )  # fmt: skip
                script.write_text(bodies_lua(warm))
                warmed = run_wrk(target.url, script, COUNTING_CONNECTIONS, 1)
                rate = warmed["requests"] / (warmed["duration_us"] / 1e6)
                sized = min(MAX_BODIES, max(WARM_BODIES, math.ceil(2 * rate * duration)))
                kept = write_bodies(
                    measured, lib.counted, lib.chars_per_token, sized, rng,
                    ALONE_TEXTS if name == "gateway" else 0,
                )  # fmt: skip
                script.write_text(bodies_lua(measured))
                if kept:
                    # Each library alone first counts what the gateway's warm-up did: both
                    # tokenizers cache words, fastokens' first texts cost many times its later
                    # ones, and the gateway is measured warm.
                    warmed_up = [lib.render(chat) for chat in warm_chats]
                    texts = [lib.render(chat) for chat in kept]
                    chars = statistics.fmean(map(len, texts))
                    for library, alone in lib.alone.items():
                        alone.cost(warmed_up)
                        own[(request, library)] = AloneCost(*alone.cost(texts), chars)
            else:
                run_wrk(target.url, script, COUNTING_CONNECTIONS, 1)  # warm up its connections
            result = measure(request, target, services, script, COUNTING_CONNECTIONS, duration)
            if counted and result.requests > sized:
                notes.append(
                    f"({request}) {name} outlasted its fresh bodies ({result.requests:,} requests,"
                    f" {sized:,} bodies) and sent some again."
                )
            log(
                f"({request}) c={COUNTING_CONNECTIONS} {name:<12} {result.rps:8,.0f} req/s"
                f"  CPU {result.cpu_ms_per_request or 0:.3f} ms/req  errors {result.errors}"
            )
            runs.append(result)
    return runs


# --- the report ----------------------------------------------------------------------------------


def machine() -> str:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {model}"


def git_revision() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
            check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "gateway"], cwd=ROOT, capture_output=True,
            text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        return rev + (" (gateway/ modified)" if dirty else "")
    return "unknown"


def _ratio(value: float | None, target: float, at_least: bool) -> tuple[str, str]:
    if value is None:
        return "n/a", "n/a (the pass-through added no measurable latency)"
    ok = value >= target if at_least else value <= target
    return f"{value:.3f}", "met" if ok else "**MISSED**"  # 3 digits: 0.396 must not read as 0.40


def report(
    runs: list[Run],
    paired: list[Paired],
    ttfb: list[TtfbResult],
    header: list[str],
    duration: int,
    rounds: int,
) -> tuple[str, bool]:
    """The Markdown report and whether every run was free of errors."""
    by = {(r.request, r.connections, r.target, r.round): r for r in runs}
    lines = [*header, ""]
    lines += [
        f"Throughput and latency: wrk -t1 -cN -d{duration}s, targets measured back to back per"
        f" row group, in {rounds} round(s). CPU ms/req: user+system CPU of the target's own"
        " process (the stub for direct, the proxy otherwise) per request served. Other CPU:"
        " cores busy with anything but this benchmark during the run (other work on the"
        " machine, and kernel time no process is charged for).",
        "",
        "| request | conns | round | target | req/s | p50 ms | p99 ms | CPU ms/req | req/s vs pass-through | other CPU | errors |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        base = by.get((r.request, r.connections, "pass-through", r.round))
        vs = f"{r.rps / base.rps:.2f}x" if base and base.rps else "-"
        cpu_ms = f"{r.cpu_ms_per_request:.3f}" if r.cpu_ms_per_request is not None else "-"
        lines.append(
            f"| {r.request} | {r.connections} | {r.round + 1 if r.request in 'ab' else '-'} |"
            f" {r.target} | {r.rps:,.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {cpu_ms} | {vs} |"
            f" {r.other_cores:.2f} | {r.errors} |"
        )
    lines += [
        "",
        f"(c) stream, {STREAM_TOKENS} chunks, {TTFB_CONNECTIONS} connections, {duration}s:"
        " time from sending the request to the first chunk of the body (asyncio raw-socket client).",
        "",
        "| target | TTFB p50 ms | TTFB p99 ms | added p50 vs direct | full stream p50 ms | req/s | CPU ms/req | other CPU | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    direct = next((t for t in ttfb if t.target == "direct"), None)
    for t in ttfb:
        extra = f"{t.p50_ms - direct.p50_ms:+.2f} ms" if direct else "-"
        cpu_ms = f"{t.cpu_ms_per_request:.3f}" if t.cpu_ms_per_request is not None else "-"
        lines.append(
            f"| {t.target} | {t.p50_ms:.2f} | {t.p99_ms:.2f} | {extra} | {t.total_p50_ms:.2f} |"
            f" {t.rps:,.0f} | {cpu_ms} | {t.other_cores:.2f} | {t.errors} |"
        )

    lines += [
        "",
        "(a) at one connection again, the three targets side by side (`loadtest.paired_latency`:"
        f" {paired[0].shape if paired else '-'}), once a round: wrk's one-connection runs above come one after another"
        " while the machine's speed drifts.",
        "",
        "| round | direct p50 ms | pass-through p50 ms | gateway p50 ms | requests each | added p50 ratio | other CPU | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, p in enumerate(paired):
        ms = [f"{p.p50_ms[t]:.3f}" if p.p50_ms[t] is not None else "-" for t in TARGETS]
        ratio = p.added()
        lines.append(
            f"| {n + 1} | {' | '.join(ms)} | {p.requests:,} |"
            f" {f'{ratio:.3f}' if ratio is not None else '-'} | {p.other_cores:.2f} | {p.errors} |"
        )

    def rps_ratio(request: str, n: int) -> float | None:
        gw, pt = by.get((request, 64, "gateway", n)), by.get((request, 64, "pass-through", n))
        return gw.rps / pt.rps if gw and pt and pt.rps else None

    def added(n: int) -> float | None:
        runs = (by.get(("a", 1, t, n)) for t in TARGETS)
        return added_ratio(*(r.p50_ms if r else None for r in runs))

    def paired_added(n: int) -> float | None:
        return paired[n].added() if n < len(paired) else None

    def cpu(n: int) -> float | None:
        gw, pt = by.get(("a", 64, "gateway", n)), by.get(("a", 64, "pass-through", n))
        if gw and pt and gw.cpu_ms_per_request and pt.cpu_ms_per_request:
            return gw.cpu_ms_per_request / pt.cpu_ms_per_request
        return None

    def median(ratio: Callable[[int], float | None]) -> tuple[float | None, str]:
        """The median of the rounds' ratios, each of one round's back-to-back pair, and their
        range: a single 5 s pair on a shared machine moves by a third."""
        values = sorted(v for v in map(ratio, range(rounds)) if v is not None)
        if not values:
            return None, ""
        spread = f" ({values[0]:.3f}-{values[-1]:.3f})" if len(values) > 1 else ""
        return statistics.median(values), spread

    rows = [
        ("(a) short: gateway / pass-through req/s at 64 conns", median(partial(rps_ratio, "a")), TARGET_RPS_SHORT, True),
        ("(b) classify: gateway / pass-through req/s at 64 conns", median(partial(rps_ratio, "b")), TARGET_RPS_CLASSIFY, True),
        ("(a) short, 1 conn: (gateway p50 - direct p50) / (pass-through p50 - direct p50)", median(added), TARGET_ADDED_P50, False),
        ("issue 15: (a) short, gateway / pass-through CPU per request at 64 conns", median(cpu), TARGET_CPU_SHORT_15, False),
        ("issue 15: (a) short, gateway / pass-through req/s at 64 conns", median(partial(rps_ratio, "a")), TARGET_RPS_SHORT_15, True),
        ("issue 15: (a) short, 1 conn, side by side: added p50 over the pass-through's", median(paired_added), TARGET_ADDED_P50_15, False),
    ]  # fmt: skip
    kind = f"median of {rounds} rounds (range)" if rounds > 1 else "value"
    lines += ["", f"| ratio | {kind} | target | result |", "|---|---:|---:|---|"]
    for label, (value, spread), target, at_least in rows:
        shown, verdict = _ratio(value, target, at_least)
        sign = ">=" if at_least else "<="
        lines.append(f"| {label} | {shown}{spread} | {sign} {target} | {verdict} |")
    every: list[Run | Paired | TtfbResult] = [*runs, *paired, *ttfb]
    clean = all(r.errors == 0 for r in every)
    disturbed = max((r.other_cores for r in every), default=0.0)
    if disturbed > OTHER_CPU_WARN:
        lines += [
            "",
            f"**Other work used up to {disturbed:.2f} cores during a run: this run was disturbed;"
            " rerun on a quiet machine before trusting its ratios.**",
        ]
    if not clean:
        lines += [
            "",
            "**Some runs had errors (see the errors column): their numbers are suspect.**",
        ]
    return "\n".join(lines) + "\n", clean


# --- the run -------------------------------------------------------------------------------------


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


def log(message: str, stream: TextIO = sys.stderr) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=stream, flush=True)


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


@contextlib.contextmanager
def fleet(
    workdir: Path, shared: bool, threads: int | None, counted: Mapping[str, Path]
) -> Iterator[dict[str, Service]]:
    """Start stub, pass-through and the two gateways, counting the tiny tokenizer's model and
    `counted`'s (and, `shared`, the Redis the gateways share their slots through), wait until
    each is ready, and yield them by name."""
    tokenizer = build_tokenizer(workdir, "loadtest.tiny_tokenizer")
    procs = Fleet(workdir)
    try:
        redis_url = start_redis(procs) if shared else None
        stub, passthrough = start_backends(procs)
        policy = write_policy(workdir, tokenizer, stub.url, redis_url, threads, counted=counted)
        one_thread = write_policy(
            workdir, tokenizer, stub.url, redis_url, 1, "policy-1t.yaml", counted
        )
        gateways = [
            start_gateway(procs, name, file)
            for name, file in (("gateway", policy), (ONE_THREAD, one_thread))
        ]
        wait_started(stub, passthrough, gateways)
        yield {s.name: s for s in (stub, passthrough, *gateways)}
    finally:
        procs.stop()


def run(
    duration: int, out_path: Path, shared: bool, threads: int | None, rounds: int, seed: int
) -> int:
    if shutil.which("wrk") is None:
        log("wrk is not installed (apt-get install -y wrk)")
        return 2
    if shared and shutil.which("redis-server") is None:
        log("redis-server is not installed (apt-get install -y redis-server)")
        return 2
    started = time.monotonic()
    load = os.getloadavg()[0]  # anything else on these two cores skews every number below
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        workdir = Path(tmp)
        short_body, stream_body = dumps(short_chat()), dumps(stream_chat())
        prefix, variants, suffix = classify_parts()
        sample_classify = prefix + "SKU 0-0: " + variants[0] + suffix
        scripts = {"a": workdir / "short.lua", "b": workdir / "classify.lua"}
        scripts["a"].write_text(static_lua(short_body))
        scripts["b"].write_text(varying_lua(prefix, variants, suffix))
        stream_file = workdir / "stream.json"
        stream_file.write_text(stream_body)
        short_file = workdir / "short.json"
        short_file.write_text(short_body)
        rng = random.Random(seed)  # every counting prompt of the run is drawn from it
        directories = {c.model: real_tokenizers.directory(c.key) for c in COUNTED}
        runs: list[Run] = []
        paired: list[Paired] = []
        ttfb: list[TtfbResult] = []
        notes: list[str] = []
        own: dict[tuple[str, str], AloneCost] = {}
        gateway_threads = threads or available_cpus()
        with fleet(workdir, shared, threads, directories) as targets:
            services = list(targets.values())
            policy = workdir / "policy.yaml"
            decision = explain(policy, sample_classify, workdir)
            short_decision = explain(policy, short_body, workdir)
            bodies = {"short": short_body, "classify": sample_classify, "stream": stream_body}
            libraries = []
            for counted in COUNTED:
                # A sample (~4.5 characters a token) shows which library the gateway counts the
                # model with, and that the texts measured alone are counted as the gateway does.
                chat = prose_chat(counted.model, 4.5, rng)
                sample = explain(policy, dumps(chat), workdir)
                lib = Libraries.load(
                    counted, directories[counted.model], sample["counting_backend"], gateway_threads
                )
                alone = lib.alone[lib.backend].count(lib.render(chat))
                if alone != sample["input_tokens"]:
                    notes.append(
                        f"({counted.row}) {counted.label}: the gateway counts the sample"
                        f" {sample['input_tokens']} tokens, {lib.backend} alone {alone} on its"
                        " rendering: the texts measured alone are not counted as the gateway's."
                    )
                bodies[f"counting ({counted.row})"] = dumps(chat)
                libraries.append(lib)
            for name, service in targets.items():
                check_target(name, service.port, bodies)
            log(
                f"ready; (b) is {len(sample_classify):,} bytes, {decision['input_tokens']} input"
                f" tokens, class {decision['class']}"
            )
            for request in ("a", "b"):
                for name in TARGETS:  # warm up: connections, caches, the estimator's window
                    run_wrk(targets[name].url, scripts[request], 16, 1)
                for n, connections in itertools.product(range(rounds), CONNECTIONS):
                    for name in TARGETS:
                        result = measure(
                            request, targets[name], services, scripts[request], connections,
                            duration,
                        )  # fmt: skip
                        result.round = n
                        log(
                            f"({request}) c={connections:<2} {name:<12} {result.rps:8,.0f} req/s"
                            f"  p50 {result.p50_ms:6.2f} ms  p99 {result.p99_ms:6.2f} ms"
                            f"  other CPU {result.other_cores:.2f}  errors {result.errors}"
                        )
                        runs.append(result)
            for _ in range(rounds):
                paired.append(measure_paired(targets, services, short_file))
                log(
                    "(a) c=1 paired blocks, p50 ms: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in paired[-1].p50_ms.items() if v)
                    + f"  other CPU {paired[-1].other_cores:.2f}"
                )
            runs += measure_counting(
                targets, services, libraries, workdir, duration, rng, notes, own
            )
            for name in TARGETS:
                result_t = measure_ttfb(targets[name], services, stream_file, duration)
                log(
                    f"(c) TTFB {name:<12} p50 {result_t.p50_ms:.2f} ms p99 {result_t.p99_ms:.2f} ms"
                )
                ttfb.append(result_t)
            rss = {name: targets[name].rss_mb() for name in ("gateway", ONE_THREAD)}
    import aiohttp

    header = [
        f"Run {datetime.datetime.now().astimezone().isoformat(timespec='seconds')},"
        f" {machine()}, Python {platform.python_version()}, aiohttp {aiohttp.__version__},"
        f" gateway at {git_revision()}, load average {load:.2f} at the start,"
        f" {time.monotonic() - started:.0f}s in all.",
        "",
        (
            "The gateway shares its slots and quotas through a local redis-server (`state: redis`)."
            if shared
            else "The gateway keeps its slots and quotas in memory (`state: memory`)."
        )
        + f" Tokenizer threads: {threads or 'the default (the CPUs it may use)'}.",
        "",
        f"(a) short chat: 1 user message, max_tokens 16, {len(short_body)} bytes,"
        f" {short_decision['input_tokens']} input tokens, class {short_decision['class']}.",
        f"(b) classification: a fixed {RULE_COUNT}-rule system message + a user message unique per"
        f" request, max_tokens 10, ~{len(sample_classify):,} bytes,"
        f" {decision['input_tokens']} input tokens (the gateway's count, tiny tokenizer),"
        f" class {decision['class']}.",
        f"(d) Gemma 3, (e) Llama 3: a classification chat of ~{RULES_TOKENS:,} tokens of rules"
        f" (system) and ~{LISTING_TOKENS:,} of product text (user) drawn from real prose"
        f" (`loadtest.prose`, {len(prose.paragraphs()):,} paragraphs of stdlib docstrings), every"
        f" one new, max_tokens 10; seed {seed} (`--seed {seed}` draws the same texts again). Each"
        " gateway loads the three models (RSS after the runs: "
        + ", ".join(f"{name} {mb:,.0f} MB" for name, mb in rss.items())
        + ").",
    ]
    text, clean = report(runs, paired, ttfb, header, duration, rounds)
    threads_label = f"{gateway_threads} threads"
    text += "\n".join(counting_report(runs, own, libraries, threads_label, notes)) + "\n"
    print(text)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text)
    log(f"wrote {out_path}")
    return 0 if clean else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=int, default=5, help="seconds per measured run (>= 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Markdown report file")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure (a) and (b) this many times, targets back to back in each; the verdicts"
        " are the medians of the rounds' ratios (>= 1)",
    )
    parser.add_argument(
        "--state",
        choices=("memory", "redis"),
        default="memory",
        help="where the gateway keeps slots and quotas: `redis` starts a local redis-server",
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="draw (d) and (e)'s prose from this seed (default: a new one from the OS, printed)",
    )
    parser.add_argument(
        "--tokenizer-threads",
        type=int,
        help="the gateway's server.tokenizer_threads (default: its own, the CPUs it may use)",
    )
    # Internal: the child processes this benchmark starts.
    parser.add_argument("--ttfb-client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--ttfb-body", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.duration < 1:
        parser.error("--duration must be at least 1 second")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.ttfb_client is not None:
        return ttfb_client(args.ttfb_client, args.ttfb_body, args.duration)
    # SIGTERM's default would end this process without its `finally`, leaving the children
    # running: turn it into SystemExit so the fleet is stopped either way.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    seed = secrets.randbits(32) if args.seed is None else args.seed
    log(f"seed {seed}")
    return run(
        args.duration, args.out, args.state == "redis", args.tokenizer_threads, args.rounds, seed
    )


if __name__ == "__main__":
    raise SystemExit(main())
