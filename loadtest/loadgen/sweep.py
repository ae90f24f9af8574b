"""`sweep`: each target x workload x level, in order, and the curves the report draws.

Every target gets the same planned shapes (the plan's random draws are seeded by the workload,
never by the target), so models are compared on identical traffic; prompts differ only in
their unique tag (see prompts.py).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from loadtest.loadgen.knee import KneeParams
from loadtest.loadgen.progress import Progress
from loadtest.loadgen.prompts import PromptBuilder
from loadtest.loadgen.runner import LevelRun, run_level
from loadtest.loadgen.stats import Curve, LoadKind, summarize
from loadtest.loadgen.workloads import Planned, Workload, plan, poisson_arrivals

DEFAULT_USERS = (16, 32, 64, 128)
REQUESTS_PER_USER = 4  # closed-loop default: each user sends this many requests per level


@dataclass(frozen=True)
class Target:
    url: str
    model: str
    tokenizer: str | None = None  # local HF tokenizer directory; None: 4 characters a token


@dataclass(frozen=True)
class SweepConfig:
    targets: tuple[Target, ...]
    workloads: tuple[Workload, ...]
    users: tuple[int, ...] | None = None  # None: the workload's own levels, else DEFAULT_USERS
    rates: tuple[float, ...] = ()  # given: open loop at these arrival rates instead of users
    duration_s: float | None = None  # open loop: how long arrivals last
    requests_per_level: int | None = None  # None: REQUESTS_PER_USER x users (closed loop)
    max_seconds_per_level: float = 600.0
    stream: bool = True
    seed: int = 0
    time_scale: float = 1.0
    baseline_level: float = 16
    knee: KneeParams = field(default_factory=KneeParams)
    target_replicas: int = 1  # replicas behind each target: the knee is divided among them

    def __post_init__(self) -> None:
        if self.rates and not self.duration_s:
            raise ValueError("an open-loop sweep (rates) needs a duration")

    @property
    def kind(self) -> LoadKind:
        return "rate" if self.rates else "users"

    def reported_load(self, load: float) -> float:
        """A level's load in the report's clock: a rate is sent in wall-clock arrivals per second,
        which are `time_scale` times fewer per simulated second; users are users."""
        return load / self.time_scale if self.rates else load

    def loads(self, workload: Workload) -> tuple[float, ...]:
        if self.rates:
            return self.rates
        return self.users or tuple(workload.users or DEFAULT_USERS)

    def planned(self, workload: Workload, load: float) -> list[Planned]:
        """The level's requests. The shapes' draws are seeded by the workload alone, so every
        level starts with the same sequence of shapes and levels differ by load, not by mix."""
        shapes = random.Random(f"{self.seed}:{workload.name}")
        if self.rates:
            assert self.duration_s is not None
            times = random.Random(f"{self.seed}:{workload.name}:{load:g}")
            arrivals = poisson_arrivals(load, self.duration_s, times, self.requests_per_level)
            return plan(workload, len(arrivals), shapes, arrivals)
        count = self.requests_per_level or REQUESTS_PER_USER * int(load)
        return plan(workload, count, shapes)


@dataclass
class Series:
    target: Target
    workload: Workload
    levels: list[tuple[float, LevelRun]] = field(default_factory=list)


@dataclass
class SweepResult:
    config: SweepConfig
    series: list[Series]

    def curves(self) -> list[Curve]:
        """One curve per series, plus one per class when a workload mixes several."""
        out = []
        for s in self.series:
            classes: list[str | None] = [None]
            if len(s.workload.classes) > 1:
                classes += [c.name for c in s.workload.classes]
            for cls in classes:
                curve = Curve(s.target.model, s.target.url, s.workload.name, cls, self.config.kind)
                for load, run in s.levels:
                    records = [r for r in run.records if cls is None or r.cls == cls]
                    curve.levels.append(
                        (
                            self.config.reported_load(load),
                            summarize(records, run.duration_s, self.config.time_scale),
                        )
                    )
                out.append(curve)
        return out


def session(max_seconds: float) -> aiohttp.ClientSession:
    """One session per target; no connection limit: the users or arrivals bound concurrency."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=max_seconds)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


def builders(targets: Sequence[Target]) -> dict[str | None, PromptBuilder]:
    """One prompt builder per tokenizer: its filler encoding and shape guesses are reused."""
    return {tok: PromptBuilder(tok) for tok in dict.fromkeys(t.tokenizer for t in targets)}


async def run_sweep(config: SweepConfig, progress: Progress | None = None) -> SweepResult:
    """Run every target x workload x level; traffic goes only to the targets' URLs."""
    progress = progress or Progress()
    prompts = builders(config.targets)
    result = SweepResult(config, [])
    for target in config.targets:
        async with session(config.max_seconds_per_level) as http:
            for workload in config.workloads:
                series = Series(target, workload)
                result.series.append(series)
                for load in config.loads(workload):
                    planned = config.planned(workload, load)
                    bodies = await asyncio.to_thread(
                        prompts[target.tokenizer].bodies, target.model, planned, config.stream
                    )
                    label = (
                        f"{target.model} {workload.name} {config.kind}"
                        f"={config.reported_load(load):g}"
                    )
                    progress.start(label, len(planned))
                    run = await run_level(
                        http,
                        target.url,
                        planned,
                        bodies,
                        None if config.rates else int(load),
                        config.max_seconds_per_level,
                        config.stream,
                        progress,
                        config.time_scale,
                    )
                    series.levels.append((load, run))
                    progress.finish(level_line(run, config.time_scale))
    return result


def level_line(run: LevelRun, time_scale: float) -> str:
    """One clock for the whole line: a duration in wall-clock seconds next to latencies and rates
    in simulated ones read as if requests outlived the run."""
    s = summarize(run.records, run.duration_s, time_scale)
    failed = ", ".join(f"{k}: {v}" for k, v in sorted(s.failed.items())) or "none"
    clock = "" if time_scale == 1 else f" (simulated seconds, time scale {time_scale:g})"
    return (
        f"{s.completed}/{len(run.records)} completed in {s.duration_s:.1f}s,"
        f" {s.rps:.2f} req/s, {s.output_tps:.0f} out tok/s, P95 E2E {_s(s.e2e.p95)},"
        f" failed {failed}, unfinished {s.unfinished}{clock}"
    )


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}s"
