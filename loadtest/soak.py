"""Soak: minutes of steady mixed load through the gateway; is its resident memory flat?

A leak that costs a few hundred bytes a request never shows in a test or a 5 s benchmark; it
shows as a gateway that grows until the kernel kills it. So this runs the real processes long
enough to see the trend: simulated vLLM replicas (`llm-loadtest simulate`, one process per
pool, TPU v6e profiles, time-scaled) and `python -m gateway serve` in front, each a separate
process on free 127.0.0.1 ports, with a policy shaped like policies/demo.yaml (two pools,
classification and generation) whose models use the tiny real tokenizer of
loadtest/tiny_tokenizer.py, so counting is exact, as in production. This process sends
open-loop Poisson arrivals of the `mixed` workload (classification 4,000 in / 10 out,
generation 500 in / 1,000 out, every prompt unique): about half streamed, half not, and a share
of the streams cut by the client after a few chunks. Every few seconds it samples the gateway's
VmRSS (/proc/PID/status), its open descriptors and the in-flight gauges of its /metrics.

    python -m loadtest.soak [--minutes 10] [--rate 8] [--out loadtest/out/soak.md] [--state redis]

With `--state redis` the gateway leases its slots from a local redis-server, and the drained
gateway must also report no lease left.

The figure is RSS after warm-up (the first minute: imports, tokenizer caches, connection pools
and allocator arenas settle there) against the end and the maximum. Pass: the maximum after
warm-up is within 10% of the warm-up value, and once the load has drained the gateway reports
nothing in flight and nothing queued. Exit 0 on pass, 1 on fail, 2 if it could not run.
Bounded: a fixed arrival schedule, a cap on concurrent requests, a per-request read time-out,
a drain deadline, and every process group killed in `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.loadgen import PromptBuilder, RequestRecord, SweepConfig, Target, load_workload
from loadtest.loadgen.runner import JSON, PATHS, send
from loadtest.loadgen.workloads import Planned
from loadtest.overhead.fleet import (
    HOST,
    ROOT,
    Fleet,
    Service,
    build_tokenizer,
    free_port,
    start_redis,
    wait_ready,
)
from loadtest.overhead.report import git_revision, machine

MODEL_ALIAS = "gemma-3"
DEFAULT_OUT = ROOT / "loadtest" / "out" / "soak.md"
GROWTH_LIMIT = 0.10  # the acceptance bound: RSS after warm-up flat within 10%
MAX_INFLIGHT = 512  # client-side cap: an arrival beyond it is skipped and counted, not queued
REQUEST_READ_TIMEOUT_S = 120.0  # per socket read; a hung request fails instead of hanging the run
DRAIN_DEADLINE_S = 120.0  # after the last arrival, in-flight requests get this long
SETTLE_S = 5.0  # after the drain: let the gateway's own bookkeeping finish before the last scrape

# The two pools of policies/demo.yaml, with a simulator profile each and caps that let steady
# load mostly through (a soak measures memory, not shedding; a few 429s exercise that path too).
POOLS = {
    "classify-27b": {
        "model": "gemma-3-27b-it",
        "profile": "gemma-3-27b-tpu-v6e-2x2",
        "replicas": 2,
        "max_concurrency": 32,
        "queue": {"max_depth": 256, "max_wait_s": 10},
    },
    "generate-12b": {
        "model": "gemma-3-12b-it",
        "profile": "gemma-3-12b-tpu-v6e-2x2",
        "replicas": 2,
        "max_concurrency": 16,
        "queue": {"max_depth": 64, "max_wait_s": 5},
    },
}


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- processes -----------------------------------------------------------------------------------


def consecutive_free_ports(count: int, attempts: int = 50) -> int:
    """A base port with `count` free ports from it: `simulate` serves replica i on base + i."""
    for _ in range(attempts):
        base = free_port()
        if base + count > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on {HOST}")


def write_policy(
    workdir: Path, tokenizer: Path, bases: dict[str, int], redis_url: str | None
) -> Path:
    """Two pools on the simulated replicas; exact tokenization with the tiny tokenizer; with
    `redis_url`, slots and quotas shared through Redis as several gateways would run."""
    policy: dict[str, Any] = {
        "models": {
            spec["model"]: {"tokenizer": str(tokenizer), "max_model_len": 128000}
            for spec in POOLS.values()
        },
        "pools": {
            name: {
                "model": spec["model"],
                "replicas": [
                    f"http://{HOST}:{bases[name] + i}" for i in range(int(spec["replicas"]))
                ],
                "max_concurrency": spec["max_concurrency"],
                "queue": spec["queue"],
            }
            for name, spec in POOLS.items()
        },
        "classes": [
            {
                "name": "prefill_heavy",
                "when": {"input_tokens": {"gte": 1024}, "output_tokens": {"lte": 64}},
            },
            {"name": "decode_heavy", "when": {}},
        ],
        "routes": [
            {"match": {"model": MODEL_ALIAS, "class": "prefill_heavy"}, "pool": "classify-27b"},
            {"match": {"model": MODEL_ALIAS}, "pool": "generate-12b"},
        ],
        "server": {"access_log": True, "drain_grace_s": 5},
    }
    if redis_url is not None:
        policy["state"] = {"backend": "redis", "url": redis_url, "gateways": 3}
    path = workdir / "policy.yaml"
    path.write_text(json.dumps(policy, indent=2))  # JSON is YAML
    return path


def start_fleet(procs: Fleet, workdir: Path, time_scale: float, shared: bool) -> Service:
    """Tokenizer, simulators (and Redis), gateway, each ready before this returns the gateway."""
    tokenizer = build_tokenizer(workdir, "loadtest.tiny_tokenizer")
    redis_url = start_redis(procs) if shared else None
    bases: dict[str, int] = {}
    sims = []
    for name, spec in POOLS.items():
        count = int(spec["replicas"])
        bases[name] = base = consecutive_free_ports(count)
        argv = [
            sys.executable, "-m", "loadtest.cli", "simulate", "--profile", str(spec["profile"]),
            "--replicas", str(count), "--base-port", str(base), "--host", HOST,
            "--time-scale", f"{time_scale:g}", "--tokenizer", str(tokenizer),
        ]  # fmt: skip
        sims.append((procs.start(f"sim-{name}", argv, base), count))
    policy = write_policy(workdir, tokenizer, bases, redis_url)
    port = free_port()
    gateway = procs.start(
        "gateway",
        [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--host", HOST,
         "--port", str(port)],
        port,
    )  # fmt: skip
    for sim, count in sims:
        for i in range(count):
            wait_ready(Service(sim.name, sim.port + i, sim.proc, sim.log), "/health")
    wait_ready(gateway, "/readyz")
    return gateway


# --- sampling ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    t_s: float  # since the first arrival
    rss_kb: int
    fds: int
    inflight: float  # llm_inflight_requests, summed over pools and replicas
    queued: float  # llm_queue_depth, summed over pools
    done: int  # requests finished (any outcome) by then


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def gauges(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Sums of the gateway's in-flight gauges, from its own /metrics."""
    async with http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        text = await resp.text()
    wanted = ("llm_inflight_requests", "llm_inflight_tokens", "llm_queue_depth",
              "llm_replica_leases")  # fmt: skip
    out = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in out:
            out[family.name] = sum(s.value for s in family.samples)
    return out


# --- load ----------------------------------------------------------------------------------------


@dataclass
class Load:
    """The requests of the run and their outcomes, filled in as they finish."""

    planned: list[Planned]
    bodies: list[bytes]
    modes: list[str]  # "stream", "plain", or "cut" (streamed, the client leaves mid-stream)
    cuts: list[int]  # for "cut": content chunks read before hanging up
    records: list[RequestRecord] = field(default_factory=list)
    skipped: int = 0  # arrivals beyond MAX_INFLIGHT
    done: int = 0


def build_load(
    tokenizer: Path, rate: float, duration_s: float, stream_share: float, cut_share: float
) -> Load:
    """The arrival plan of `mixed` at `rate`, and a body for each, before the clock starts."""
    workload = load_workload("mixed")
    config = SweepConfig(
        targets=(Target("", MODEL_ALIAS, str(tokenizer)),),
        workloads=(workload,),
        rates=(rate,),
        duration_s=duration_s,
        requests_per_level=int(rate * duration_s * 2) + 10,
    )
    planned = config.planned(workload, rate)
    rng = random.Random("soak")
    modes, cuts = [], []
    for _ in planned:
        draw = rng.random()
        modes.append("cut" if draw < cut_share else "stream" if draw < stream_share else "plain")
        cuts.append(rng.randint(1, 4))
    builder = PromptBuilder(tokenizer)
    bodies: list[bytes] = [b""] * len(planned)
    for streamed in (True, False):
        idx = [i for i, m in enumerate(modes) if (m != "plain") == streamed]
        made = builder.bodies(MODEL_ALIAS, [planned[i] for i in idx], streamed)
        for i, b in zip(idx, made, strict=True):
            assert isinstance(b, bytes), "the soak's workloads have no sessions"
            bodies[i] = b
    return Load(planned, bodies, modes, cuts)


async def send_and_cut(
    http: aiohttp.ClientSession, url: str, body: bytes, p: Planned, rec: RequestRecord, after: int
) -> None:
    """A streamed request the client abandons after `after` content chunks: the disconnect the
    gateway must notice, closing upstream and releasing the slot and token reservation."""
    started = time.perf_counter()
    try:
        async with http.post(url + PATHS[p.endpoint], data=body, headers=JSON) as resp:
            rec.status = resp.status
            if resp.status != 200:
                await resp.read()
                return
            seen = 0
            async for line in resp.content:
                # vLLM's first chunk carries the role and an empty content: not output yet
                if line.startswith(b"data:") and b'"content":"' in line.replace(
                    b'"content":""', b""
                ):
                    seen += 1
                    if rec.ttft_s is None:
                        rec.ttft_s = time.perf_counter() - started
                    if seen >= after:
                        rec.error = "client_cut"
                        resp.close()  # drop the connection, not back to the pool
                        return
                elif line.startswith(b"data: [DONE]"):
                    return  # shorter than the cut: an ordinary completed stream
            rec.error = "incomplete"
    except aiohttp.ClientError as exc:
        rec.error = type(exc).__name__
    finally:
        rec.e2e_s = time.perf_counter() - started


async def drive(
    http: aiohttp.ClientSession, url: str, load: Load, started: float, deadline: float
) -> None:
    """Open loop: each request at its planned offset, whatever the earlier ones are doing."""
    inflight: set[asyncio.Task[None]] = set()

    async def one(i: int) -> None:
        p = load.planned[i]
        rec = RequestRecord(i, p.cls, p.endpoint, p.isl, p.osl, time.perf_counter() - started)
        load.records.append(rec)
        try:
            if load.modes[i] == "cut":
                await send_and_cut(http, url, load.bodies[i], p, rec, load.cuts[i])
            else:
                await send(http, url, load.bodies[i], p, rec, load.modes[i] == "stream")
        finally:
            load.done += 1

    try:
        for i, p in enumerate(load.planned):
            assert p.at is not None
            await asyncio.sleep(max(0.0, started + p.at - time.perf_counter()))
            if len(inflight) >= MAX_INFLIGHT:
                load.skipped += 1
                continue
            task = asyncio.create_task(one(i))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        if inflight:
            await asyncio.wait(set(inflight), timeout=max(0.0, deadline - time.perf_counter()))
    finally:
        for task in list(inflight):  # past the drain deadline: cancel, which closes them
            task.cancel()
        if inflight:
            await asyncio.wait(set(inflight), timeout=10)


async def sample_loop(
    http: aiohttp.ClientSession,
    gateway: Service,
    load: Load,
    started: float,
    every_s: float,
    samples: list[Sample],
    stop: asyncio.Event,
) -> None:
    while not stop.is_set():
        g = await gauges(http, gateway.url)
        samples.append(
            Sample(
                time.perf_counter() - started,
                rss_kb(gateway.proc.pid),
                open_fds(gateway.proc.pid),
                g["llm_inflight_requests"],
                g["llm_queue_depth"],
                load.done,
            )
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


@dataclass
class Outcome:
    samples: list[Sample]
    final: Sample
    final_gauges: dict[str, float]
    load: Load
    wall_s: float
    gateway_cpu_s: float  # user + system CPU of the gateway over the load
    load_avg: tuple[float, float]  # the machine's 1-minute load average at the start and end


async def soak(gateway: Service, load: Load, duration_s: float, every_s: float) -> Outcome:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=REQUEST_READ_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(timeout=timeout, connector=connector) as http,
        aiohttp.ClientSession() as probe,  # its own pool: scrapes never wait behind the load
    ):
        samples: list[Sample] = []
        stop = asyncio.Event()
        started = time.perf_counter()
        cpu0 = gateway.cpu_seconds()
        load0 = os.getloadavg()[0]  # anything else on the cores slows the load, not the figure
        sampler = asyncio.create_task(
            sample_loop(probe, gateway, load, started, every_s, samples, stop)
        )
        try:
            deadline = started + duration_s + DRAIN_DEADLINE_S
            await drive(http, gateway.url, load, started, deadline)
            wall = time.perf_counter() - started
            cpu = gateway.cpu_seconds() - cpu0
        finally:
            stop.set()
            await sampler
        await asyncio.sleep(SETTLE_S)
        final_gauges = await gauges(probe, gateway.url)
        final = Sample(
            time.perf_counter() - started,
            rss_kb(gateway.proc.pid),
            open_fds(gateway.proc.pid),
            final_gauges["llm_inflight_requests"],
            final_gauges["llm_queue_depth"],
            load.done,
        )
    return Outcome(samples, final, final_gauges, load, wall, cpu, (load0, os.getloadavg()[0]))


# --- the report ----------------------------------------------------------------------------------


def _mb(kb: float) -> str:
    return f"{kb / 1024:.1f}"


def slope_mb_per_min(samples: list[Sample]) -> float:
    """Least-squares trend of RSS over the samples: growth that a short run's ends could hide."""
    if len(samples) < 2:
        return 0.0
    xs = [s.t_s / 60 for s in samples]
    ys = [s.rss_kb / 1024 for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def report(
    out: Outcome, minutes: float, rate: float, warmup_s: float, time_scale: float, state: str
) -> tuple[str, bool]:
    load, samples = out.load, out.samples
    during = [s for s in samples if s.t_s <= minutes * 60 + 1]
    warm = next((s for s in during if s.t_s >= warmup_s), during[-1])
    after = [s for s in during if s.t_s >= warm.t_s]
    end = during[-1]
    peak = max(after, key=lambda s: s.rss_kb)
    growth_end = (end.rss_kb - warm.rss_kb) / warm.rss_kb
    growth_max = (peak.rss_kb - warm.rss_kb) / warm.rss_kb
    outcomes = Counter(r.outcome for r in load.records)
    completed = outcomes.pop("ok", 0)
    cut = outcomes.pop("client_cut", 0)
    failed = sum(outcomes.values())
    idle = all(
        out.final_gauges[name] == 0
        for name in ("llm_inflight_requests", "llm_queue_depth", "llm_replica_leases")
    )
    flat = growth_max <= GROWTH_LIMIT
    passed = flat and idle
    modes = Counter(load.modes[r.index] for r in load.records)

    lines = [
        "# Soak",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {machine()};"
        f" gateway at {git_revision()}; Python {sys.version.split()[0]};"
        f" slots and quotas in {state}.",
        "",
        f"`mixed` workload, open loop at {rate:g} req/s for {minutes:g} min"
        f" ({len(load.records)} sent: {modes['stream']} streamed, {modes['plain']} not,"
        f" {modes['cut']} streamed and cut by the client after 1-4 chunks;"
        f" {load.skipped} skipped at the client's cap of {MAX_INFLIGHT}); simulated TPU v6e"
        f" replicas, time scale {time_scale:g}; exact token counts (tiny tokenizer).",
        "",
        f"- requests: {completed} completed, {cut} cut by the client as planned, {failed} failed"
        + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(outcomes.items()))})" if failed else "")
        + f"; load drained {out.wall_s - minutes * 60:.1f}s after the last arrival;"
        f" the gateway used {out.gateway_cpu_s / out.wall_s:.2f} cores on average; machine load"
        f" average {out.load_avg[0]:.2f} at the start, {out.load_avg[1]:.2f} at the end",
        f"- gateway RSS: {_mb(warm.rss_kb)} MB at warm-up end ({warm.t_s:.0f}s),"
        f" {_mb(end.rss_kb)} MB at the end of the load ({end.t_s:.0f}s), max {_mb(peak.rss_kb)} MB"
        f" ({peak.t_s:.0f}s), {_mb(out.final.rss_kb)} MB after the drain;"
        f" first sample {_mb(samples[0].rss_kb)} MB",
        f"- growth after warm-up: {growth_end:+.1%} at the end, {growth_max:+.1%} at the max;"
        f" trend {slope_mb_per_min(after):+.2f} MB/min over {len(after)} samples",
        f"- open descriptors: {warm.fds} at warm-up end, max {max(s.fds for s in after)},"
        f" {out.final.fds} after the drain",
        f"- after the drain: llm_inflight_requests {out.final_gauges['llm_inflight_requests']:g},"
        f" llm_queue_depth {out.final_gauges['llm_queue_depth']:g},"
        f" llm_inflight_tokens {out.final_gauges['llm_inflight_tokens']:g},"
        f" llm_replica_leases {out.final_gauges['llm_replica_leases']:g}",
        "",
        "| minute | t (s) | RSS MB | vs warm-up | open fds | in flight | queued | requests done |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows: list[tuple[str, Sample]] = []
    for minute in range(int(minutes) + 1):
        near = min(samples, key=lambda s: abs(s.t_s - minute * 60))
        rows.append((str(minute), near))
    rows.append(("drained", out.final))
    for label, s in rows:
        lines.append(
            f"| {label} | {s.t_s:.0f} | {_mb(s.rss_kb)} | {(s.rss_kb - warm.rss_kb) / warm.rss_kb:+.1%}"
            f" | {s.fds} | {s.inflight:g} | {s.queued:g} | {s.done} |"
        )
    verdict = "PASS" if passed else "FAIL"
    lines += [
        "",
        f"**{verdict}**: RSS growth after warm-up {growth_max:+.1%} at the max"
        f" ({'within' if flat else 'beyond'} {GROWTH_LIMIT:.0%});"
        f" in flight, queued and leased after the drain {'all 0' if idle else 'NOT 0'}.",
    ]
    return "\n".join(lines) + "\n", passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of arrivals")
    parser.add_argument("--rate", type=float, default=8.0, help="arrivals per wall-clock second")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the Markdown report")
    parser.add_argument(
        "--warmup", type=float, help="seconds before the reference sample (default: 60, or a"
        " fifth of a run shorter than 5 minutes)",
    )  # fmt: skip
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--time-scale", type=float, default=10.0, help="simulated s per wall s")
    parser.add_argument("--stream-share", type=float, default=0.5, help="share streamed")
    parser.add_argument("--cut-share", type=float, default=0.05, help="share cut mid-stream")
    parser.add_argument(
        "--state",
        choices=("memory", "redis"),
        default="memory",
        help="where the gateway keeps slots and quotas: `redis` starts a local redis-server",
    )
    args = parser.parse_args(argv)
    duration = args.minutes * 60
    warmup = args.warmup if args.warmup is not None else min(60.0, duration / 5)
    if duration <= 0 or args.rate <= 0 or not 0 <= args.cut_share <= args.stream_share <= 1:
        parser.error("need --minutes > 0, --rate > 0 and 0 <= --cut-share <= --stream-share <= 1")
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        workdir = Path(tmp)
        procs = Fleet(workdir)
        try:
            gateway = start_fleet(procs, workdir, args.time_scale, args.state == "redis")
            log(f"building {args.rate * duration:.0f} request bodies")
            load = build_load(
                workdir / "tokenizer", args.rate, duration, args.stream_share, args.cut_share
            )
            log(
                f"gateway pid {gateway.proc.pid} at {gateway.url}; {len(load.planned)} requests"
                f" over {args.minutes:g} min, sampling every {args.sample_every:g}s"
            )
            outcome = asyncio.run(soak(gateway, load, duration, args.sample_every))
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            log(f"soak could not run: {exc}")
            for service in procs.services:
                log(f"{service.name} log tail:\n{service.log_tail()}")
            return 2
        finally:
            procs.stop()
    text, passed = report(outcome, args.minutes, args.rate, warmup, args.time_scale, args.state)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    log(f"report: {os.path.relpath(args.out)}")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
