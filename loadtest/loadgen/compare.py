"""`compare`: the same open-loop workload against several targets — typically plain round-robin
over the replicas first, then the gateway — scored by goodput against per-class SLOs.

Goodput is the rate of requests that completed *and* met their class's SLO: a request counts only
if each of its class's limits held for it (E2E, TTFT, TPOT). A class's SLO "holds" when the P95
of each limited metric is within its limit. Classes without an SLO count every completed
request. Rejections are 429s and 503s: the gateway's way of saying "not now" instead of serving
everything late. With `time_scale` K, limits are in simulated seconds and measured wall-clock
times are multiplied by K before the comparison.

Goodput per replica-hour is what the fleet's cost bought: the requests that met their objectives
over the replica-hours that served them (a fixed fleet's replicas x the run's simulated duration,
or what an autoscaled fleet paid for). A workload's classes with `slo:` give the objectives
(`objective_slos`), checked against what the client observed.

Every target gets the same planned arrivals and shapes (one seed); the targets run one after
the other, never at once, since they usually share the replicas.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from loadtest.loadgen.progress import Progress
from loadtest.loadgen.prompts import PromptBuilder
from loadtest.loadgen.runner import LevelRun, RequestRecord, run_level
from loadtest.loadgen.stats import LevelStats, summarize
from loadtest.loadgen.sweep import Target, level_line, session
from loadtest.loadgen.workloads import BUILTIN, Workload, WorkloadClass, plan, poisson_arrivals

REJECTIONS = ("429", "503")
METRICS = {"e2e": "e2e_s", "ttft": "ttft_s", "tpot": "tpot_s"}


@dataclass(frozen=True)
class SLO:
    """Per-request limits in (simulated) seconds; `None`: not limited."""

    e2e_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None

    def limits(self) -> dict[str, float]:
        return {m: v for m in METRICS.values() if (v := getattr(self, m)) is not None}

    def met(self, rec: RequestRecord, time_scale: float) -> bool:
        if not rec.ok:
            return False
        for metric, limit in self.limits().items():
            value = getattr(rec, metric)
            if value is None or value * time_scale > limit:
                return False
        return True

    def held(self, stats: LevelStats) -> bool:
        """Whether the class's P95 of every limited metric is within its limit."""
        for metric, limit in self.limits().items():
            p95 = getattr(stats, metric.removesuffix("_s")).p95
            if p95 is None or p95 > limit:
                return False
        return True

    def describe(self) -> str:
        names = {v: k.upper() for k, v in METRICS.items()}
        return ", ".join(f"{names[m]} P95 <= {v:g}s" for m, v in self.limits().items()) or "none"


def objective_slos(workload: Workload) -> dict[str, SLO]:
    """Per class with objectives (`slo:`, simulated ms), the SLO a request must meet to count."""
    return {c.name: _objective_slo(c) for c in workload.classes if c.slo is not None}


def _objective_slo(c: WorkloadClass) -> SLO:
    assert c.slo is not None
    ttft, tpot = c.slo.ttft_ms, c.slo.tpot_ms
    return SLO(
        ttft_s=None if ttft is None else ttft / 1000, tpot_s=None if tpot is None else tpot / 1000
    )


def met_objectives(records: Iterable[RequestRecord], slos: Mapping[str, SLO], k: float) -> int:
    """Requests that completed within their class's limits (a class without any: completed)."""
    return sum((slos.get(r.cls) or SLO()).met(r, k) for r in records)


def goodput_per_replica_hour(
    records: Iterable[RequestRecord], slos: Mapping[str, SLO], k: float, replica_hours: float
) -> float:
    """Requests that met their objectives per replica-hour paid (simulated hours)."""
    if replica_hours <= 0:
        raise ValueError("replica_hours must be positive")
    return met_objectives(records, slos, k) / replica_hours


DEFAULT_SLOS: dict[str, SLO] = {
    "classification": SLO(e2e_s=2.0),
    "generation": SLO(ttft_s=2.0, tpot_s=0.1),
}


def parse_slo(text: str) -> tuple[str, SLO]:
    """`CLASS:metric=seconds,...`, e.g. `generation:ttft=2,tpot=0.1`; metrics e2e, ttft, tpot."""
    cls, _, spec = text.partition(":")
    limits: dict[str, float] = {}
    for part in filter(None, spec.split(",")):
        metric, _, value = part.partition("=")
        if metric not in METRICS:
            raise ValueError(f"unknown SLO metric {metric!r} in {text!r}: use e2e, ttft, tpot")
        limits[METRICS[metric]] = float(value)
    if not cls or not limits:
        raise ValueError(f"an SLO reads CLASS:metric=seconds[,metric=seconds], not {text!r}")
    return cls, SLO(**limits)


@dataclass(frozen=True)
class CompareConfig:
    targets: tuple[tuple[str, Target], ...]  # (name, target); the first is the baseline
    rate: float  # arrivals per wall-clock second
    duration_s: float
    workload: Workload = BUILTIN["mixed"]
    requests: int | None = None  # at most this many arrivals
    max_seconds: float = 600.0
    slos: dict[str, SLO] = field(default_factory=lambda: dict(DEFAULT_SLOS))
    time_scale: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class Outcome:
    """One target's result for one class (or `all`)."""

    cls: str
    stats: LevelStats
    slo: str
    met: int
    goodput: float  # requests/s that met their SLO
    slo_held: bool | None  # None: no SLO for this class
    rejections: int


@dataclass
class CompareResult:
    config: CompareConfig
    runs: dict[str, LevelRun]

    def outcomes(self) -> dict[str, list[Outcome]]:
        """Per target: `all` first, then each class of the workload."""
        config = self.config
        out: dict[str, list[Outcome]] = {}
        for name, run in self.runs.items():
            rows = []
            for cls in ["all", *(c.name for c in config.workload.classes)]:
                records = [r for r in run.records if cls == "all" or r.cls == cls]
                stats = summarize(records, run.duration_s, config.time_scale)
                slo = config.slos.get(cls)
                met = met_objectives(records, config.slos, config.time_scale)
                rows.append(
                    Outcome(
                        cls=cls,
                        stats=stats,
                        slo=slo.describe() if slo else "-",
                        met=met,
                        goodput=met / stats.duration_s if stats.duration_s else 0.0,
                        slo_held=None if slo is None else slo.held(stats),
                        rejections=sum(stats.failed.get(code, 0) for code in REJECTIONS),
                    )
                )
            out[name] = rows
        return out

    def goodput_ratio(self) -> float | None:
        """The last target's goodput over the first's (gateway over round-robin)."""
        outcomes = self.outcomes()
        first, last = outcomes[self.config.targets[0][0]], outcomes[self.config.targets[-1][0]]
        return last[0].goodput / first[0].goodput if first[0].goodput else None


async def run_compare(config: CompareConfig, progress: Progress | None = None) -> CompareResult:
    """Run the workload against each target in turn; traffic goes only to the targets' URLs."""
    progress = progress or Progress()
    rng = random.Random(f"{config.seed}:compare:{config.workload.name}:{config.rate:g}")
    arrivals = poisson_arrivals(config.rate, config.duration_s, rng, config.requests)
    planned = plan(config.workload, len(arrivals), rng, arrivals)
    prompts: dict[str | None, PromptBuilder] = {}
    result = CompareResult(config, {})
    for name, target in config.targets:
        builder = prompts.setdefault(target.tokenizer, PromptBuilder(target.tokenizer))
        bodies = await asyncio.to_thread(builder.bodies, target.model, planned, True)
        async with session(config.max_seconds) as http:
            progress.start(f"compare {name} ({target.url}) rate={config.rate:g}", len(planned))
            run = await run_level(
                http, target.url, planned, bodies, None, config.max_seconds, True, progress,
                config.time_scale,
            )  # fmt: skip
        result.runs[name] = run
        progress.finish(level_line(run, config.time_scale))
    return result


def _p95(stats: LevelStats, metric: str, scale: float = 1.0) -> str:
    value = getattr(stats, metric).p95
    return "-" if value is None else f"{value * scale:.2f}"


def table(result: CompareResult) -> str:
    lines = [
        "| target | class | SLO | sent | completed | rejected | unfinished | met SLO | goodput /s"
        " | P95 E2E s | P95 TTFT s | P95 TPOT ms | SLO held |",
        "|---|---|---|" + "---:|" * 10,
    ]
    for name, rows in result.outcomes().items():
        for o in rows:
            held = "-" if o.slo_held is None else ("yes" if o.slo_held else "**no**")
            lines.append(
                f"| {name} | {o.cls} | {o.slo} | {o.stats.sent} | {o.stats.completed}"
                f" | {o.rejections} | {o.stats.unfinished} | {o.met} | {o.goodput:.2f}"
                f" | {_p95(o.stats, 'e2e')} | {_p95(o.stats, 'ttft')}"
                f" | {_p95(o.stats, 'tpot', 1000)} | {held} |"
            )
    ratio = result.goodput_ratio()
    names = [name for name, _ in result.config.targets]
    lines.append("")
    lines.append(
        f"Goodput ratio {names[-1]} / {names[0]}: "
        + ("undefined (no request met its SLO on the first)" if ratio is None else f"{ratio:.2f}x")
    )
    return "\n".join(lines)


def markdown(result: CompareResult) -> str:
    c = result.config
    out = [
        "# Compare report",
        "",
        f"- workload {c.workload.name}, open loop at {c.rate:g} arrivals/s for {c.duration_s:g}s"
        f" ({len(next(iter(result.runs.values())).records)} requests per target)",
        *(f"- {name}: {t.model} at {t.url}" for name, t in c.targets),
    ]
    if c.time_scale != 1:
        out.append(f"- time scale {c.time_scale:g}: latencies and rates in simulated time")
    out += ["", table(result), ""]
    return "\n".join(out)


def to_json(result: CompareResult) -> dict[str, Any]:
    c = result.config
    return {
        "config": {**asdict(c), "workload": c.workload.model_dump(mode="json")},
        "outcomes": {name: [asdict(o) for o in rows] for name, rows in result.outcomes().items()},
        "goodput_ratio": result.goodput_ratio(),
        "requests": {name: [r.row() for r in run.records] for name, run in result.runs.items()},
    }


def write_compare_report(result: CompareResult, out: str | Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "compare.json", out / "compare.md"]
    paths[0].write_bytes(orjson.dumps(to_json(result), option=orjson.OPT_INDENT_2))
    paths[1].write_text(markdown(result))
    return paths
