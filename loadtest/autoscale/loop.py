"""One autoscaling run: trace -> gateway -> simulated pools, one HPA model per pool in the loop.

The gateway (`python -m gateway serve`, a subprocess) discovers each pool from the loopback DNS
server (dns.py); a stand-in for Prometheus scrapes the gateway's /metrics, and each pool's HPA
model (hpa.py) reads the newest scrape every sync period, as through prometheus-adapter, and
scales its simulated Deployment (pool.py); the open-loop load generator (loadtest.loadgen)
sends the trace's arrivals. The gateway's routes decide where each request goes, fallbacks
(spill-over) included. Everything runs on one simulated clock: wall seconds since the load began
times the time scale. Every duration in `AutoscaleConfig` is in simulated seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.admit.forecast import DEFAULT as FORECAST_DEFAULT
from gateway.config.schema import COUNT_BY_CHARS
from loadtest import processes
from loadtest.autoscale.attainment import SLO_MISS, MissRatio, slo_counts
from loadtest.autoscale.dns import DnsServer
from loadtest.autoscale.hpa import (
    DEFAULT_SCALE_DOWN,
    DEFAULT_SCALE_UP,
    DEFAULT_SYNC_PERIOD_S,
    DEFAULT_TOLERANCE,
    ExternalMetric,
    Hpa,
    HpaSpec,
    ScalingRules,
)
from loadtest.autoscale.pool import FIRST_HOST, POOL_STRIDE, Member, SimPool
from loadtest.autoscale.trace import Trace
from loadtest.loadgen.profile import read_access_log
from loadtest.loadgen.progress import Progress
from loadtest.loadgen.prompts import Body, PromptBuilder
from loadtest.loadgen.runner import RequestRecord, run_level
from loadtest.loadgen.sweep import session
from loadtest.loadgen.workloads import Planned, load_workload, plan
from loadtest.sim import ReplicaOptions, load_profile

# Gemma 3 27B on a v6e 2x2 host, from "pod scheduled" to "serving": pulling the vLLM TPU image
# (cached on the node), reading ~54 GB of bf16 weights, and XLA-compiling the padded batch
# shapes, which tpu-inference does before it serves. An estimate of 3 minutes, not measured;
# a new node (GKE provisioning a TPU VM) would add several more.
DEFAULT_STARTUP_S = 180.0
Signal = Literal["reactive", "forecast", "max", "attainment"]
REACTIVE = "llm_pool_desired_replicas"
FORECAST = "llm_pool_desired_replicas_forecast"
DNS_ZONE = "autoscale.test"  # pool P's headless Service is P.autoscale.test
MODEL_ALIAS = "gemma-3"  # what the load generator asks for; the policy routes it to the pool
STEP_WALL_S = 0.05  # how often starting replicas are checked for readiness (wall)
TAIL_S = 120.0  # simulated seconds the last arrivals get to finish before they are cut off
HEALTH_TICK_S = (
    1.0  # simulated: gateway/fleet/health.py's PASSIVE_TICK_S, the tick of a real gateway
)
# The most of its serving time a replica's simulated clock may slip (loadtest/sim/engine.py)
# before a run is taken to have measured the machine's pace rather than the autoscaling.
MOST_SLIP_SHARE = 0.02
# gateway/admit/forecast.py's time constants (real seconds in a real gateway: simulated here)
FORECAST_TIMES = ("level_s", "trend_s", "damping_s")
# The miss share an attainment HPA allows by default: 1 - a 90% attainment target.
DEFAULT_SLO_MISS_TARGET = 0.1


@dataclass(frozen=True)
class PoolConfig:
    """One simulated Deployment, the gateway's pool of it, and its HPA's replica bounds."""

    name: str = "generate-27b"
    profile: str = "gemma-3-27b-tpu-v6e-2x2"
    max_concurrency: int = 16  # the gateway's per-replica cap
    min_replicas: int = 1
    max_replicas: int = 8
    initial_replicas: int = 1  # ready at time 0
    target: float = 1.0  # the metrics' AverageValue target
    # The pool's policy `forecast` (gateway/admit/forecast.py), times in simulated seconds;
    # what is left out keeps the gateway's default.
    forecast: dict[str, float] = field(default_factory=dict)
    # The pool's policy `slo` (objectives per tier, the latency model's seed, ...) in simulated
    # milliseconds and seconds; None: no objectives, no attainment.
    slo: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if unknown := set(self.forecast) - {*FORECAST_TIMES, "ceiling"}:
            raise ValueError(f"pool {self.name}: forecast has no {sorted(unknown)}")
        if not 0 < self.min_replicas <= self.max_replicas:
            raise ValueError(f"pool {self.name}: need 0 < min_replicas <= max_replicas")
        if not 0 <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"pool {self.name}: need 0 <= initial_replicas <= max_replicas")
        if self.max_concurrency <= 0 or self.target <= 0:
            raise ValueError(f"pool {self.name}: max_concurrency and target must be positive")


@dataclass(frozen=True)
class AutoscaleConfig:
    trace: Trace
    tokenizer: str | None  # a tokenizer directory; None: 4 characters a token everywhere
    out: Path
    pools: tuple[PoolConfig, ...] = (PoolConfig(),)
    # The gateway's `classes` and `routes` (policy syntax); None: one class, every request to
    # the first pool.
    classes: tuple[dict[str, Any], ...] | None = None
    routes: tuple[dict[str, Any], ...] | None = None
    spill: bool = True  # False: the routes' fallbacks are left out
    time_scale: float = 12.0
    startup_s: float = DEFAULT_STARTUP_S
    signal: Signal = "reactive"
    metric: str = REACTIVE
    forecast_metric: str = FORECAST
    # `attainment`: the miss share the HPA's Value target allows (loadtest/autoscale/attainment.py)
    slo_miss_target: float = DEFAULT_SLO_MISS_TARGET
    scale_up: ScalingRules | None = None  # None: the API's defaults
    scale_down: ScalingRules | None = None
    tolerance: float = DEFAULT_TOLERANCE
    sync_period_s: float = DEFAULT_SYNC_PERIOD_S
    queue_wait_s: float = 30.0  # the gateway's max_wait_s, simulated
    dns_interval_s: float = 5.0  # how often the gateway re-resolves, simulated
    # Prometheus's scrape of the gateway (deploy/base/monitoring/servicemonitor.yaml: 15 s); the
    # HPA reads the newest scrape through the adapter. 0: the HPA reads /metrics at each sync.
    scrape_interval_s: float = 15.0
    max_requests: int = 20_000
    seed: int = 0
    notes: tuple[str, ...] = ()  # for the report, e.g. what of an HPA manifest is not modelled

    def __post_init__(self) -> None:
        positive = {
            "time_scale": self.time_scale,
            "startup_s": self.startup_s,
            "sync_period_s": self.sync_period_s,
            "queue_wait_s": self.queue_wait_s,
            "dns_interval_s": self.dns_interval_s,
        }
        if bad := [name for name, value in positive.items() if not value > 0]:
            raise ValueError(f"must be positive: {', '.join(bad)}")
        if self.scrape_interval_s < 0 or self.tolerance < 0:
            raise ValueError("scrape_interval_s and tolerance must not be negative")
        names = [p.name for p in self.pools]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"need one or more pools with distinct names, not {names}")
        if self.signal == "attainment":
            if without := [p.name for p in self.pools if not (p.slo or {}).get("objectives")]:
                raise ValueError(
                    f"--signal attainment: pool {', '.join(without)} has no `slo.objectives`,"
                    " so no attainment to read"
                )
            if not 0 < self.slo_miss_target < 1:
                raise ValueError("slo_miss_target is a share: between 0 and 1")

    @property
    def pool(self) -> PoolConfig:
        """The first pool: the one a single-pool run scales."""
        return self.pools[0]


@dataclass
class Sample:
    """One HPA sync of one pool, in simulated seconds."""

    pool: str
    t_s: float
    rate_rps: float  # the trace's, all workloads
    ready: int
    current: int
    desired: int
    reason: str
    metrics: dict[str, float | None]


@dataclass
class AutoscaleRun:
    config: AutoscaleConfig
    signal_used: dict[str, tuple[str, ...]]  # pool -> the metrics its HPA read
    notes: list[str]
    samples: list[Sample]
    members: list[Member]
    records: list[RequestRecord]
    access: list[dict[str, Any]]
    wall_s: float
    end_s: float  # simulated time when the run stopped
    url_of: dict[str, str] = field(default_factory=dict)  # replica URL -> host

    @property
    def slip_share(self) -> float:
        """The largest share of its serving time that a replica's simulated clock slipped
        because the process could not keep up: time the replica did not serve, so the pool
        had less capacity than the run's clock says and the HPA saw a longer backlog."""
        shares = [
            m.replica.engine.slip_s / (m.gone_s - m.started_s)
            for m in self.members
            if m.replica is not None
            and m.started_s is not None
            and m.gone_s is not None
            and m.gone_s > m.started_s
        ]
        return max(shares, default=0.0)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def dns_name(pool: str) -> str:
    return f"{pool}.{DNS_ZONE}"


def policy(config: AutoscaleConfig, dns_port: int, ports: Mapping[str, int]) -> dict[str, Any]:
    """The gateway's policy: each pool on DNS discovery (`ports`: its replicas' port). The
    gateway's own durations are wall seconds, so they are the simulated ones over the time
    scale."""
    k = config.time_scale
    models: dict[str, Any] = {}
    pools: dict[str, Any] = {}
    for p in config.pools:
        profile = load_profile(p.profile)
        models[profile.served_model_name] = {
            "tokenizer": config.tokenizer or COUNT_BY_CHARS,
            "max_model_len": profile.serving.max_model_len,
        }
        pools[p.name] = {
            "model": profile.served_model_name,
            "max_concurrency": p.max_concurrency,
            "dns": {
                "name": f"{dns_name(p.name)}:{ports[p.name]}",
                "interval_s": config.dns_interval_s / k,
                "nameservers": [f"127.0.0.1:{dns_port}"],
            },
            "queue": {"max_depth": 1024, "max_wait_s": config.queue_wait_s / k},
            # The gateway smooths llm_pool_desired_replicas per health tick (at most
            # PASSIVE_TICK_S = 1 s apart, wall clock), not per second: probing every
            # simulated second keeps one tick per simulated second, so the signal moves
            # on the simulated clock as it would on a real one (and not 12x slower).
            "health": {"interval_s": HEALTH_TICK_S / k},
            "startup_s": config.startup_s / k,  # the forecast's horizon
            "forecast": _forecast(p, k),
        }
        if p.slo is not None:
            pools[p.name]["slo"] = wall_slo(p.slo, k)
    routes = config.routes or ({"match": {"model": MODEL_ALIAS}, "pool": config.pool.name},)
    if not config.spill:
        routes = tuple({k: v for k, v in r.items() if k != "fallback"} for r in routes)
    return {
        "models": models,
        "pools": pools,
        "classes": list(config.classes or ({"name": "any"},)),
        "routes": list(routes),
        # The run ends when its load is done: a request a client gave up on meanwhile (a slow
        # machine's time-out) must not hold the gateway's stop for its whole drain.
        "server": {"drain_grace_s": 1},
    }


def _forecast(pool: PoolConfig, k: float) -> dict[str, float]:
    """The pool's forecast constants for the gateway: its times over the time scale."""
    given = {**FORECAST_DEFAULT.model_dump(), **pool.forecast}
    return {name: value / k if name in FORECAST_TIMES else value for name, value in given.items()}


# A pool's `slo` fields that are durations (scaled down by the time scale), and rates (up).
_SLO_MS = ("ttft_ms", "tpot_ms", "ttft_base_ms", "ttft_per_1k_prefill_ms", "ttft_per_running_ms",
           "tpot_base_ms", "tpot_per_running_ms", "tpot_per_1k_context_ms")  # fmt: skip
_SLO_S = ("interval_s",)
_SLO_PER_S = ("max_per_s",)


def wall_slo(given: Any, k: float) -> Any:
    """The pool's `slo` for the gateway: its latencies and times over the time scale (objectives,
    the model's seed, the adaptive caps' target and interval), its rates times it."""
    if not isinstance(given, dict):
        return given
    out = {}
    for name, value in given.items():
        if name in _SLO_MS or name in _SLO_S:
            out[name] = value / k
        elif name in _SLO_PER_S:
            out[name] = value * k
        else:
            out[name] = wall_slo(value, k)
    return out


def planned_requests(config: AutoscaleConfig) -> list[Planned]:
    """The trace's arrivals as the load generator's plan: wall-clock offsets, sorted."""
    return trace_plan(config.trace, config.time_scale, config.seed, config.max_requests)


def trace_plan(trace: Trace, time_scale: float, seed: int, limit: int) -> list[Planned]:
    """A trace's arrivals (simulated seconds) as a plan at wall-clock offsets, sorted; each
    series' name is the workload it draws its shapes from."""
    rng = random.Random(seed)
    out: list[Planned] = []
    for name, times in trace.arrivals(rng, limit).items():
        workload = load_workload(name)
        out += plan(workload, len(times), rng, [t / time_scale for t in times])
    return sorted(out, key=lambda p: p.at or 0.0)


Gauges = dict[str, dict[str, float]]  # pool -> gauge name -> value


def parse_gauges(text: str, names: set[str]) -> Gauges:
    """The named gauges' values per pool in a Prometheus text exposition."""
    out: Gauges = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and (pool := sample.labels.get("pool")) is not None:
                out.setdefault(pool, {})[sample.name] = sample.value
    return out


async def exposition(http: aiohttp.ClientSession, url: str) -> str | None:
    """The gateway's /metrics now; None if it did not answer."""
    try:
        async with http.get(f"{url}/metrics") as resp:
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None


async def scrape(http: aiohttp.ClientSession, url: str, names: set[str]) -> Gauges | None:
    """The gauges now; None if the gateway did not answer."""
    text = await exposition(http, url)
    return None if text is None else parse_gauges(text, names)


def hpa_metrics(
    config: AutoscaleConfig, pool: str, have_forecast: bool
) -> tuple[tuple[str, ...], list[str]]:
    """The metric names a pool's HPA reads for the signal, and what fell back if the forecast is
    not exported. `max` is an HPA with both metrics: it takes the larger proposal, so the
    reactive signal is the floor; so is `attainment`'s, whose miss share only adds replicas
    while the pool misses its objectives more than its target allows."""
    wanted = {
        "reactive": (config.metric,),
        "forecast": (config.forecast_metric,),
        "max": (config.metric, config.forecast_metric),
        "attainment": (config.metric, SLO_MISS),
    }[config.signal]
    if config.forecast_metric in wanted and not have_forecast:
        note = (
            f"--signal {config.signal}: the gateway exports no {config.forecast_metric}"
            f"{{pool={pool!r}}}; fell back to the reactive {config.metric} alone. (A real"
            " HPA listing a metric it cannot read would never scale down.)"
        )
        return (config.metric,), [note]
    return wanted, []


def external_metric(config: AutoscaleConfig, pool: PoolConfig, name: str) -> ExternalMetric:
    """A metric the HPA reads with its target: the miss share against a Value target, the
    demand gauges against the pool's AverageValue."""
    if name == SLO_MISS:
        return ExternalMetric(name, config.slo_miss_target, "Value")
    return ExternalMetric(name, pool.target)


@dataclass
class Scaled:
    """One pool in the loop: its Deployment and its HPA."""

    sim: SimPool
    hpa: Hpa

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.hpa.spec.metrics)


async def run_autoscale(config: AutoscaleConfig) -> AutoscaleRun:
    config.out.mkdir(parents=True, exist_ok=True)
    k = config.time_scale
    started = time.perf_counter()
    clock_zero = [time.perf_counter()]  # reset when the load begins: simulated time 0

    def clock() -> float:
        return (time.perf_counter() - clock_zero[0]) * k

    options = ReplicaOptions(time_scale=k, tokenizer=config.tokenizer, seed=config.seed)
    sims: dict[str, SimPool] = {}
    for i, p in enumerate(config.pools):
        first = FIRST_HOST + i * POOL_STRIDE
        sims[p.name] = SimPool(
            p.name, first, load_profile(p.profile), options, free_port(str(first)),
            config.startup_s, clock, drain_wait_s=2 * config.dns_interval_s / k,
            drain_limit_s=TAIL_S / k,
        )  # fmt: skip
    dns = DnsServer({dns_name(name): sim.addresses for name, sim in sims.items()})
    planned = planned_requests(config)

    def build_bodies() -> list[Body]:
        return PromptBuilder(config.tokenizer).bodies(MODEL_ALIAS, planned, True)

    samples: list[Sample] = []
    notes = list(config.notes)
    scaled: dict[str, Scaled] = {}
    async with contextlib.AsyncExitStack() as stack:
        # Seconds of tokenizer work: done while the replicas and the gateway start.
        bodies_task = asyncio.create_task(asyncio.to_thread(build_bodies))
        stack.push_async_callback(_cancelled, bodies_task)
        await dns.start()
        stack.callback(dns.close)
        for p in config.pools:
            stack.push_async_callback(sims[p.name].close)
            await sims[p.name].start_ready(p.initial_replicas)
        spec = policy(config, dns.port, {name: sim.port for name, sim in sims.items()})
        policy_path = config.out / "policy.yaml"
        policy_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        port = free_port("127.0.0.1")
        url = await stack.enter_async_context(processes.gateway(policy_path, port, config.out))
        http = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        )
        bodies = await bodies_task
        first_scrape = await scrape(http, url, {config.metric, config.forecast_metric}) or {}
        for p in config.pools:
            have = config.forecast_metric in first_scrape.get(p.name, {})
            names, fallbacks = hpa_metrics(config, p.name, have)
            notes += fallbacks
            hpa = Hpa(
                HpaSpec(
                    metrics=tuple(external_metric(config, p, n) for n in names),
                    min_replicas=p.min_replicas,
                    max_replicas=p.max_replicas,
                    scale_up=config.scale_up or DEFAULT_SCALE_UP,
                    scale_down=config.scale_down or DEFAULT_SCALE_DOWN,
                    tolerance=config.tolerance,
                    sync_period_s=config.sync_period_s,
                )
            )
            scaled[p.name] = Scaled(sims[p.name], hpa)
        records = await _drive(config, url, http, scaled, planned, bodies, samples, clock_zero)
    access = read_access_log(config.out / "access.jsonl")
    urls = {
        f"http://{m.host}:{sims[m.pool].port}": m.host for s in sims.values() for m in s.members
    }
    return AutoscaleRun(
        config,
        {name: s.metrics for name, s in scaled.items()},
        notes,
        samples,
        [m for sim in sims.values() for m in sim.members],
        records,
        access,
        time.perf_counter() - started,
        clock(),
        urls,
    )


async def run_keeping_pace(config: AutoscaleConfig, halvings: int = 2) -> AutoscaleRun:
    """`run_autoscale`, run again at half the time scale (up to `halvings` times) while the
    replicas' clocks slipped more than `MOST_SLIP_SHARE`: on a busy machine a fast time scale
    asks more requests per wall second than the processes serve, and the run would show the
    machine's pace instead of the autoscaling. Returns the first run that kept pace, or the
    slowest one."""
    run = await run_autoscale(config)
    for _ in range(halvings):
        if run.slip_share <= MOST_SLIP_SHARE:
            break
        config = replace(config, time_scale=config.time_scale / 2)
        run = await run_autoscale(config)
    return run


async def _cancelled(task: asyncio.Task[Any]) -> None:
    task.cancel()  # if the gateway never came up
    await asyncio.gather(task, return_exceptions=True)


async def _drive(
    config: AutoscaleConfig,
    url: str,
    http: aiohttp.ClientSession,
    scaled: Mapping[str, Scaled],
    planned: list[Planned],
    bodies: list[Body],
    samples: list[Sample],
    clock_zero: list[float],
) -> list[RequestRecord]:
    """Send the load while the HPAs sync on their period; all stop when the load is done. A
    background task that fails (a replica that could not start) ends the run with its error."""
    k = config.time_scale
    names = {config.metric, config.forecast_metric}
    last_sync_s = config.trace.duration_s + TAIL_S
    max_wall_s = last_sync_s / k
    progress = Progress()

    async def starter() -> None:
        while True:
            for s in scaled.values():
                await s.sim.step()
            await asyncio.sleep(STEP_WALL_S)

    async def until(t_s: float) -> None:
        await asyncio.sleep(max(0.0, clock_zero[0] + t_s / k - time.perf_counter()))

    # What Prometheus holds: the last successful scrape (a failed one keeps the old samples;
    # a series a successful one lacks is gone, as staleness markers make it), and the SLO
    # counts of each scrape the adapter's miss ratio is a rate over.
    stored: Gauges = {}
    misses = MissRatio()

    async def read(t_s: float) -> Gauges | None:
        text = await exposition(http, url)
        if text is None:
            return None
        misses.scraped(t_s, slo_counts(text))
        return parse_gauges(text, names)

    async def prometheus() -> None:
        t = config.scrape_interval_s / 2  # scrapes out of phase with the syncs
        while t <= last_sync_s:
            await until(t)
            if (values := await read(t)) is not None:
                stored.clear()
                stored.update(values)
            t += config.scrape_interval_s

    async def controller() -> None:
        t = config.sync_period_s
        while t <= last_sync_s:
            await until(t)
            if config.scrape_interval_s:
                values = dict(stored)  # prometheus-adapter's instant query: the newest sample
            else:
                values = await read(t) or {}
            for name, s in scaled.items():  # the controller syncs every HPA each period
                pool_values: dict[str, float | None] = dict(values.get(name, {}))
                if SLO_MISS in s.metrics:
                    pool_values[SLO_MISS] = misses.value(name, t)
                current = s.sim.current
                decision = s.hpa.sync(t, current, pool_values, s.sim.ready)
                if decision.desired != current:
                    s.sim.scale_to(decision.desired)
                samples.append(
                    Sample(name, t, config.trace.rate(t), s.sim.ready, current,
                           decision.desired, decision.reason,
                           {n: pool_values.get(n) for n in sorted({*names, *s.metrics})})
                )  # fmt: skip
            t += config.sync_period_s

    label = f"autoscale {'+'.join(scaled)} signal={config.signal}"
    progress.start(label, len(planned))
    clock_zero[0] = time.perf_counter()
    async with session(max_wall_s) as load, asyncio.TaskGroup() as group:
        background = [group.create_task(starter()), group.create_task(controller())]
        if config.scrape_interval_s:
            background.append(group.create_task(prometheus()))
        try:
            run = await run_level(load, url, planned, bodies, None, max_wall_s, True, progress, k)
        finally:
            for task in background:
                task.cancel()
    ok = sum(r.ok for r in run.records)
    progress.finish(f"{ok} of {len(run.records)} ok")
    return run.records
