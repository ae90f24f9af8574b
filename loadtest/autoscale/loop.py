"""One autoscaling run: trace -> gateway -> simulated pool, with the HPA model in the loop.

The gateway (`python -m gateway serve`, a subprocess) discovers the pool from the loopback DNS
server (dns.py); a stand-in for Prometheus scrapes the gateway's /metrics, and the HPA model
(hpa.py) reads the newest scrape every sync period, as through prometheus-adapter, and scales
the simulated Deployment (pool.py); the open-loop load generator (loadtest.loadgen)
sends the trace's arrivals. Everything runs on one simulated clock: wall seconds since the
load began times the time scale. Every duration in `AutoscaleConfig` is in simulated seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.autoscale.dns import DnsServer
from loadtest.autoscale.hpa import (
    DEFAULT_SCALE_DOWN,
    DEFAULT_SCALE_UP,
    Decision,
    ExternalMetric,
    Hpa,
    HpaSpec,
    ScalingRules,
)
from loadtest.autoscale.pool import FIRST_HOST, Member, SimPool
from loadtest.autoscale.trace import Trace
from loadtest.loadgen.profile import read_access_log
from loadtest.loadgen.progress import Progress
from loadtest.loadgen.prompts import Body, PromptBuilder
from loadtest.loadgen.runner import RequestRecord, run_level
from loadtest.loadgen.sweep import session
from loadtest.loadgen.workloads import Planned, load_workload, plan
from loadtest.sim import ReplicaOptions, load_profile

Signal = Literal["reactive", "forecast", "max"]
REACTIVE = "llm_pool_desired_replicas"
FORECAST = "llm_pool_desired_replicas_forecast"
DNS_NAME = "pool.autoscale.test"
MODEL_ALIAS = "gemma-3"  # what the load generator asks for; the policy routes it to the pool
STEP_WALL_S = 0.05  # how often starting replicas are checked for readiness (wall)
TAIL_S = 120.0  # simulated seconds the last arrivals get to finish before they are cut off
READY_WALL_S = 60.0  # the gateway's start-up (imports, tokenizer, first DNS lookup), at most
HEALTH_TICK_S = 1.0  # simulated: gateway/health.py's PASSIVE_TICK_S, the tick of a real gateway


@dataclass(frozen=True)
class AutoscaleConfig:
    trace: Trace
    tokenizer: str
    out: Path
    profile: str = "gemma-3-27b-tpu-v6e-2x2"
    pool: str = "generate-27b"
    time_scale: float = 12.0
    startup_s: float = 180.0
    signal: Signal = "reactive"
    metric: str = REACTIVE
    forecast_metric: str = FORECAST
    target: float = 1.0  # the metrics' AverageValue target
    min_replicas: int = 1
    max_replicas: int = 8
    initial_replicas: int = 1
    scale_up: ScalingRules | None = None  # None: the API's defaults
    scale_down: ScalingRules | None = None
    tolerance: float = 0.1
    sync_period_s: float = 15.0
    max_concurrency: int = 16  # the gateway's per-replica cap
    queue_wait_s: float = 30.0  # the gateway's max_wait_s, simulated
    dns_interval_s: float = 5.0  # how often the gateway re-resolves, simulated
    # Prometheus's scrape of the gateway (deploy/base/monitoring/servicemonitor.yaml: 15 s); the
    # HPA reads the newest scrape through the adapter. 0: the HPA reads /metrics at each sync.
    scrape_interval_s: float = 15.0
    max_requests: int = 20_000
    seed: int = 0
    gateway_port: int = 0  # 0: a free one
    notes: tuple[str, ...] = ()  # for the report, e.g. what of an HPA manifest is not modelled


@dataclass
class Sample:
    """One HPA sync, in simulated seconds."""

    t_s: float
    rate_rps: float
    ready: int
    current: int
    desired: int
    reason: str
    metrics: dict[str, float | None]


@dataclass
class AutoscaleRun:
    config: AutoscaleConfig
    signal_used: tuple[str, ...]
    notes: list[str]
    samples: list[Sample]
    members: list[Member]
    records: list[RequestRecord]
    access: list[dict[str, Any]]
    wall_s: float
    end_s: float  # simulated time when the run stopped
    url_of: dict[str, str] = field(default_factory=dict)  # replica URL -> host


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def policy(config: AutoscaleConfig, dns_port: int) -> dict[str, Any]:
    """One pool on DNS discovery; the gateway's own durations are wall seconds, so they are
    the simulated ones over the time scale."""
    k = config.time_scale
    profile = load_profile(config.profile)
    return {
        "models": {
            profile.served_model_name: {
                "tokenizer": config.tokenizer,
                "max_model_len": profile.serving.max_model_len,
            }
        },
        "pools": {
            config.pool: {
                "model": profile.served_model_name,
                "max_concurrency": config.max_concurrency,
                "dns": {
                    "name": f"{DNS_NAME}:{{port}}",
                    "interval_s": config.dns_interval_s / k,
                    "nameservers": [f"127.0.0.1:{dns_port}"],
                },
                "queue": {"max_depth": 1024, "max_wait_s": config.queue_wait_s / k},
                # The gateway smooths llm_pool_desired_replicas per health tick (at most
                # PASSIVE_TICK_S = 1 s apart, wall clock), not per second: probing every
                # simulated second keeps one tick per simulated second, so the signal moves
                # on the simulated clock as it would on a real one (and not 12x slower).
                "health": {"interval_s": HEALTH_TICK_S / k},
            }
        },
        "classes": [{"name": "any"}],
        "routes": [{"match": {"model": MODEL_ALIAS}, "pool": config.pool}],
    }


def planned_requests(config: AutoscaleConfig) -> list[Planned]:
    """The trace's arrivals as the load generator's plan: wall-clock offsets, sorted."""
    rng = random.Random(config.seed)
    out: list[Planned] = []
    for name, times in config.trace.arrivals(rng, config.max_requests).items():
        workload = load_workload(name)
        out += plan(workload, len(times), rng, [t / config.time_scale for t in times])
    return sorted(out, key=lambda p: p.at or 0.0)


def parse_gauges(text: str, names: set[str], pool: str) -> dict[str, float]:
    """The named gauges' values for `pool` in a Prometheus text exposition."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and sample.labels.get("pool") == pool:
                out[sample.name] = sample.value
    return out


async def scrape(
    http: aiohttp.ClientSession, url: str, names: set[str], pool: str
) -> dict[str, float] | None:
    """The gauges now; None if the gateway did not answer."""
    try:
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return parse_gauges(text, names, pool)


def hpa_metrics(config: AutoscaleConfig, have_forecast: bool) -> tuple[tuple[str, ...], list[str]]:
    """The metric names the HPA reads for the signal, and what fell back if the forecast is
    not exported. `max` is an HPA with both metrics: it takes the larger proposal, so the
    reactive signal is the floor."""
    wanted = {
        "reactive": (config.metric,),
        "forecast": (config.forecast_metric,),
        "max": (config.metric, config.forecast_metric),
    }[config.signal]
    if config.forecast_metric in wanted and not have_forecast:
        note = (
            f"--signal {config.signal}: the gateway exports no {config.forecast_metric}"
            f"{{pool={config.pool!r}}}; fell back to the reactive {config.metric} alone. (A real"
            " HPA listing a metric it cannot read would never scale down.)"
        )
        return (config.metric,), [note]
    return wanted, []


async def wait_ready(
    http: aiohttp.ClientSession, url: str, proc: asyncio.subprocess.Process
) -> None:
    deadline = time.perf_counter() + READY_WALL_S
    while proc.returncode is None and time.perf_counter() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(f"{url}/readyz") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError("the gateway did not become ready; see gateway.log in the out dir")


async def run_autoscale(config: AutoscaleConfig, progress: Progress | None = None) -> AutoscaleRun:
    config.out.mkdir(parents=True, exist_ok=True)
    k = config.time_scale
    started = time.perf_counter()
    clock_zero = [time.perf_counter()]  # reset when the load begins: simulated time 0

    def clock() -> float:
        return (time.perf_counter() - clock_zero[0]) * k

    profile = load_profile(config.profile)
    options = ReplicaOptions(time_scale=k, tokenizer=config.tokenizer, seed=config.seed)
    port = free_port(str(FIRST_HOST))
    pool = SimPool(
        profile, options, port, config.startup_s, clock,
        drain_wait_s=2 * config.dns_interval_s / k, drain_limit_s=TAIL_S / k,
    )  # fmt: skip
    dns = DnsServer(DNS_NAME, pool.addresses)
    await dns.start()
    spec = policy(config, dns.port)
    spec["pools"][config.pool]["dns"]["name"] = f"{DNS_NAME}:{port}"
    policy_path = config.out / "policy.yaml"
    policy_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    gateway_port = config.gateway_port or free_port("127.0.0.1")
    url = f"http://127.0.0.1:{gateway_port}"
    planned = planned_requests(config)

    def build_bodies() -> list[Body]:
        return PromptBuilder(config.tokenizer).bodies(MODEL_ALIAS, planned, True)

    # Seconds of tokenizer work: done while the gateway starts.
    bodies_task = asyncio.create_task(asyncio.to_thread(build_bodies))
    samples: list[Sample] = []
    names: tuple[str, ...] = (config.metric,)
    notes: list[str] = []
    records: list[RequestRecord] = []
    access_path = config.out / "access.jsonl"
    proc: asyncio.subprocess.Process | None = None
    try:
        await pool.start_ready(config.initial_replicas)
        with access_path.open("wb") as log, (config.out / "gateway.log").open("wb") as errors:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "serve", "--policy", str(policy_path),
                "--host", "127.0.0.1", "--port", str(gateway_port), stdout=log, stderr=errors,
            )  # fmt: skip
            timeout = aiohttp.ClientTimeout(total=10)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                await wait_ready(http, url, proc)
                bodies = await bodies_task
                both = {config.metric, config.forecast_metric}
                first = await scrape(http, url, both, config.pool) or {}
                names, fallbacks = hpa_metrics(config, config.forecast_metric in first)
                notes = [*config.notes, *fallbacks]
                model = Hpa(
                    HpaSpec(
                        metrics=tuple(ExternalMetric(n, config.target) for n in names),
                        min_replicas=config.min_replicas,
                        max_replicas=config.max_replicas,
                        scale_up=config.scale_up or DEFAULT_SCALE_UP,
                        scale_down=config.scale_down or DEFAULT_SCALE_DOWN,
                        tolerance=config.tolerance,
                        sync_period_s=config.sync_period_s,
                    )
                )
                records = await _drive(config, url, http, pool, model, planned, bodies, samples,
                                       clock_zero, progress or Progress())  # fmt: skip
    finally:
        bodies_task.cancel()  # if the gateway never came up
        await asyncio.gather(bodies_task, return_exceptions=True)
        if proc is not None and proc.returncode is None:
            proc.terminate()
            await proc.wait()
        await pool.close()
        dns.close()
    urls = {f"http://{m.host}:{port}": m.host for m in pool.members}
    access = read_access_log(access_path)
    wall_s = time.perf_counter() - started
    return AutoscaleRun(
        config, names, notes, samples, pool.members, records, access, wall_s, clock(), urls
    )


async def _drive(
    config: AutoscaleConfig,
    url: str,
    http: aiohttp.ClientSession,
    pool: SimPool,
    model: Hpa,
    planned: list[Planned],
    bodies: list[Body],
    samples: list[Sample],
    clock_zero: list[float],
    progress: Progress,
) -> list[RequestRecord]:
    """Send the load while the HPA syncs on its period; both stop when the load is done."""
    k = config.time_scale
    names = {m.name for m in model.spec.metrics} | {config.metric, config.forecast_metric}
    last_sync_s = config.trace.duration_s + TAIL_S
    max_wall_s = last_sync_s / k

    async def starter() -> None:
        while True:
            await pool.step()
            await asyncio.sleep(STEP_WALL_S)

    async def until(t_s: float) -> None:
        await asyncio.sleep(max(0.0, clock_zero[0] + t_s / k - time.perf_counter()))

    # What Prometheus holds: the last successful scrape (a failed one keeps the old samples;
    # a series a successful one lacks is gone, as staleness markers make it).
    stored: dict[str, float] = {}

    async def prometheus() -> None:
        t = config.scrape_interval_s / 2  # scrapes out of phase with the syncs
        while t <= last_sync_s:
            await until(t)
            if (values := await scrape(http, url, names, config.pool)) is not None:
                stored.clear()
                stored.update(values)
            t += config.scrape_interval_s

    async def controller() -> None:
        period_s = model.spec.sync_period_s
        t = period_s
        while t <= last_sync_s:
            await until(t)
            if config.scrape_interval_s:
                values = dict(stored)  # prometheus-adapter's instant query: the newest sample
            else:
                values = await scrape(http, url, names, config.pool) or {}
            current = pool.current
            decision: Decision = model.sync(t, current, values)
            if decision.desired != current:
                await pool.scale_to(decision.desired)
            samples.append(
                Sample(t, config.trace.rate(t), pool.ready, current, decision.desired,
                       decision.reason, {n: values.get(n) for n in sorted(names)})
            )  # fmt: skip
            t += period_s

    async with session(max_wall_s) as load:
        progress.start(f"autoscale {config.pool} signal={config.signal}", len(planned))
        clock_zero[0] = time.perf_counter()
        background = [asyncio.create_task(starter()), asyncio.create_task(controller())]
        if config.scrape_interval_s:
            background.append(asyncio.create_task(prometheus()))
        try:
            run = await run_level(load, url, planned, bodies, None, max_wall_s, True, progress)
        finally:
            for task in background:
                task.cancel()
            outcomes = await asyncio.gather(*background, return_exceptions=True)
    # A replica that could not start, or an HPA step that failed, must not pass for a quiet run.
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return run.records
