"""Issue 38's experiments: SLO admission and adaptive caps against caps set at the knee.

    python -m loadtest.slo_experiments goodput    --profile gemma-3-27b-tpu-v6e-2x2 \
        --replicas 2 --time-scale 10 --seed 0 --out loadtest/out/slo-goodput [--autoscale]
    python -m loadtest.slo_experiments miscap     ... --out loadtest/out/slo-miscap
    python -m loadtest.slo_experiments overload   ... --out loadtest/out/slo-overload
    python -m loadtest.slo_experiments prediction ... --out loadtest/out/slo-prediction

Each run starts the simulated replicas (in this process, as the autoscaling loop does) and the
real gateway (a subprocess, `processes.gateway`), once per variant, and drives the same planned
arrivals of the `slo-mixed` workload (loadgen's: classification with a TTFT objective, critical
or standard; generation with TTFT and TPOT objectives, a third sheddable) through each. Before
anything runs, the simulator's engine gives what the variants are set from, in simulated time
and without HTTP: the knee of the mixed workload's closed-loop curve (loadgen's knee finder: the
static cap), its throughput there (the fleet's capacity, which the loads are multiples of) and
the latency model's seed (`seed-latency`).

- **goodput** (a): bursts from 0.7x to 1.5x capacity; `static` (caps at the knee, as today)
  against `slo` (the same caps, admission by objective with the seed) and `slo+adaptive`
  (adaptive caps under a ceiling of twice the knee). Goodput per
  replica-hour: requests that met their objectives, as the client observed them, over the fixed
  fleet's replicas x the trace's simulated duration (the same for every variant). `--autoscale` runs both under the autoscaling
  loop too, which pays for the replica-hours its HPA asks for.
- **miscap** (b): steady load at capacity; caps at 0.5x and 2x the knee with adaptive caps on,
  against the knee's static caps: goodput per simulated minute, and each minute's ratio.
- **overload** (c): steady load at 2x capacity, the three variants: the critical requests' TTFT
  attainment (of those sent) and, per tier, the share of its requests refused with 429.
- **prediction** (d): steady load at 0.8x capacity through `slo`: |predicted - observed| TTFT
  and TPOT, p50 and p90, from the gateway's `x-gateway-predicted-*-ms` and what the client saw
  (its TTFT from sending: the gateway's queue is in it), and from the gateway's access log
  (TTFT from the grant, as the model predicts it: the log's TTFT less its queue wait).

Every figure is simulated. The gateway reads wall time, so what the policy says in simulated
time (queue wait, objectives, the seed, the adaptive interval) is written over the time scale
(`wall_slo`). The table is printed and written to OUT/table.md with OUT/results.json; each
variant's gateway log and access log are under OUT/VARIANT/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import yaml

from gateway.config.schema import COUNT_BY_CHARS, LatencyModelSpec
from loadtest import processes
from loadtest.autoscale import report as autoscale_report
from loadtest.autoscale.loop import (
    HEALTH_TICK_S,
    AutoscaleConfig,
    PoolConfig,
    run_autoscale,
    trace_plan,
    wall_slo,
)
from loadtest.autoscale.trace import Trace, builtin
from loadtest.loadgen.compare import SLO, goodput_per_replica_hour, met_objectives, objective_slos
from loadtest.loadgen.knee import find_knee
from loadtest.loadgen.profile import read_access_log
from loadtest.loadgen.progress import Progress
from loadtest.loadgen.prompts import PromptBuilder
from loadtest.loadgen.runner import RequestRecord, run_level
from loadtest.loadgen.seed_latency import fit_seed, shapes
from loadtest.loadgen.stats import Point, percentile
from loadtest.loadgen.sweep import session
from loadtest.loadgen.workloads import Workload, load_workload
from loadtest.sim import Profile, ReplicaOptions, load_profile, start_replica
from loadtest.sim.closed_loop import observe_closed_loop

EXPERIMENTS = ("goodput", "miscap", "overload", "prediction")
WORKLOAD = "slo-mixed"
KNEE_USERS = (4, 8, 16, 32, 64, 128)  # closed-loop levels the knee is looked for in
KNEE_REQUESTS_PER_USER = 6
TAIL_S = 120.0  # simulated seconds the last arrivals get before they are cut off
TIERS = ("critical", "standard", "sheddable")
MINUTE_S = 60.0


@dataclass(frozen=True)
class Setup:
    experiment: str
    profile: str
    replicas: int
    time_scale: float
    seed: int
    out: Path
    duration_s: float  # simulated seconds of arrivals
    queue_wait_s: float = 2.0  # the queue's max wait, simulated: the longest objective
    adaptive_interval_s: float = 5.0  # simulated seconds between two moves of a cap
    autoscale: bool = False
    startup_s: float = 120.0  # the autoscaling loop's start-up, simulated
    max_requests: int = 20_000
    # Every rate times this: the experiments' loads are multiples of capacity; below 1 for a
    # smoke run (the CI test) that must not load the machine.
    load: float = 1.0


@dataclass(frozen=True)
class Knee:
    """The mixed workload's knee on one replica, from the simulator's engine (simulated)."""

    cap: int
    capacity_rps: float  # one replica's completed requests per second at the knee
    reason: str


def knee_of(profile: Profile, workload: Workload, seed: int) -> Knee:
    """The knee finder's cap on the workload's closed-loop curve, run on the engine itself."""
    points = []
    for users in KNEE_USERS:
        observed = observe_closed_loop(
            profile, users, shapes(workload), requests=KNEE_REQUESTS_PER_USER * users, seed=seed
        )
        e2e = [o.ttft_s + (o.tpot_s or 0.0) * (o.output_tokens - 1) for o in observed]
        rps = users / float(np.mean(e2e))  # Little's law: a closed loop without think time
        points.append(Point(users, rps, 0.0, len(observed), 1.0, percentile(e2e, 95), None))
    knee = find_knee(points)
    at = next(p for p in points if p.load == knee.max_concurrency)
    return Knee(knee.max_concurrency, at.rps, knee.reason)


@dataclass(frozen=True)
class Variant:
    name: str
    cap: int  # per replica: the static cap, or the adaptive caps' ceiling
    slo: dict[str, Any] | None = None  # the pool's `slo:`, simulated units


def slo_spec(
    workload: Workload, model: LatencyModelSpec, adaptive_interval_s: float | None
) -> dict[str, Any]:
    """The pool's `slo:` for the workload, in simulated units: the tiers' default objectives are
    the tightest any class asks (requests send their own); with an interval, adaptive caps hold
    them too."""
    objectives = [c.slo for c in workload.classes if c.slo is not None]
    ttft = min((o.ttft_ms for o in objectives if o.ttft_ms), default=None)
    tpot = min((o.tpot_ms for o in objectives if o.tpot_ms), default=None)
    target = {k: v for k, v in (("ttft_ms", ttft), ("tpot_ms", tpot)) if v is not None}
    spec: dict[str, Any] = {
        "objectives": dict.fromkeys(TIERS, target),
        "headers": True,
        "model": model.model_dump(),
    }
    if adaptive_interval_s is not None:
        spec["adaptive"] = {"target": target, "interval_s": adaptive_interval_s}
    return spec


@dataclass
class VariantRun:
    variant: Variant
    records: list[RequestRecord]
    time_scale: float
    duration_s: float  # simulated: the trace's, arrivals and all
    replica_hours: float
    slip_s: float  # the most simulated time a replica's clock lost to a busy machine
    notes: list[str] = field(default_factory=list)
    access: list[dict[str, Any]] = field(default_factory=list)  # the gateway's access log


def policy(setup: Setup, profile: Profile, urls: Sequence[str], variant: Variant) -> dict[str, Any]:
    """The gateway's policy for a fixed fleet, its durations in wall seconds."""
    k = setup.time_scale
    pool: dict[str, Any] = {
        "model": profile.served_model_name,
        "replicas": list(urls),
        "max_concurrency": variant.cap,
        "queue": {"max_depth": 100_000, "max_wait_s": setup.queue_wait_s / k},
        "health": {"interval_s": HEALTH_TICK_S / k},
    }
    if variant.slo is not None:
        pool["slo"] = wall_slo(variant.slo, k)
    return {
        "models": {
            profile.served_model_name: {
                "tokenizer": COUNT_BY_CHARS,
                "max_model_len": profile.serving.max_model_len,
            }
        },
        "pools": {"fleet": pool},
        "classes": [{"name": "any"}],
        "routes": [{"match": {"model": profile.served_model_name}, "pool": "fleet"}],
    }


async def run_fleet(setup: Setup, profile: Profile, variant: Variant, trace: Trace) -> VariantRun:
    """The trace through the gateway in front of a fresh fixed fleet (cold caches)."""
    k = setup.time_scale
    out = setup.out / variant.name
    out.mkdir(parents=True, exist_ok=True)
    planned = trace_plan(trace, k, setup.seed, setup.max_requests)
    bodies = PromptBuilder(None).bodies(profile.served_model_name, planned, True)
    options = ReplicaOptions(time_scale=k, seed=setup.seed)
    async with contextlib.AsyncExitStack() as stack:
        replicas = []
        for _ in range(setup.replicas):
            replica = await start_replica(profile, options)
            stack.push_async_callback(replica.close)
            replicas.append(replica)
        path = out / "policy.yaml"
        path.write_text(yaml.safe_dump(policy(setup, profile, [r.url for r in replicas], variant)))
        url = await stack.enter_async_context(processes.gateway(path, processes.free_port(), out))
        max_wall_s = (trace.duration_s + TAIL_S) / k
        progress = Progress()
        progress.start(f"{setup.experiment} {variant.name}", len(planned))
        async with session(max_wall_s) as http:
            run = await run_level(http, url, planned, bodies, None, max_wall_s, True, progress, k)
        progress.finish(f"{sum(r.ok for r in run.records)} of {len(run.records)} ok")
        slip = max(r.engine.slip_s for r in replicas)
    hours = setup.replicas * trace.duration_s / 3600
    access = read_access_log(out / "access.jsonl")
    return VariantRun(variant, run.records, k, trace.duration_s, hours, slip, access=access)


async def run_autoscaled(
    setup: Setup, profile: Profile, variant: Variant, trace: Trace
) -> VariantRun:
    """The same variant under the autoscaling loop: its HPA pays for the replica-hours."""
    config = AutoscaleConfig(
        trace=trace,
        tokenizer=None,
        out=setup.out / f"{variant.name}-autoscaled",
        pools=(
            PoolConfig(
                name="fleet",
                profile=setup.profile,
                max_concurrency=variant.cap,
                initial_replicas=setup.replicas,
                min_replicas=1,
                max_replicas=max(2, 4 * setup.replicas),
                slo=variant.slo,
            ),
        ),
        time_scale=setup.time_scale,
        startup_s=setup.startup_s,
        queue_wait_s=setup.queue_wait_s,
        seed=setup.seed,
        max_requests=setup.max_requests,
    )
    run = await run_autoscale(config)
    hours = autoscale_report.summarise(run, {}, MINUTE_S)["replica_hours"]
    slip = max((m.replica.engine.slip_s for m in run.members if m.replica), default=0.0)
    name = Variant(f"{variant.name} (autoscaled)", variant.cap, variant.slo)
    return VariantRun(name, run.records, setup.time_scale, trace.duration_s, hours, slip, run.notes)


# --- the figures ----------------------------------------------------------------------------


def _met_share(records: Sequence[RequestRecord], slos: Mapping[str, SLO], k: float) -> float:
    return met_objectives(records, slos, k) / len(records) if records else math.nan


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def goodput_rows(runs: Sequence[VariantRun], slos: Mapping[str, SLO]) -> list[dict[str, Any]]:
    """Per variant: requests, those that met their objectives, goodput per replica-hour."""
    rows = []
    for run in runs:
        k = run.time_scale
        by_class = {
            cls: _met_share([r for r in run.records if r.cls == cls], slos, k) for cls in slos
        }
        rows.append(
            {
                "variant": run.variant.name,
                "cap": run.variant.cap,
                "requests": len(run.records),
                "met": met_objectives(run.records, slos, k),
                "refused_429": sum(r.status == 429 for r in run.records),
                "replica_hours": run.replica_hours,
                "goodput_per_replica_hour": goodput_per_replica_hour(
                    run.records, slos, k, run.replica_hours
                ),
                "met_by_class": by_class,
            }
        )
    return rows


def goodput_table(rows: Sequence[dict[str, Any]]) -> str:
    classes = list(rows[0]["met_by_class"]) if rows else []
    base = rows[0]["goodput_per_replica_hour"] if rows else math.nan
    lines = [
        "| variant | cap | requests | met objectives | "
        + " | ".join(f"{c} met" for c in classes)
        + " | 429 | replica-hours | goodput / replica-hour | vs first |",
        "|---|---:|---:|---:|" + "---:|" * len(classes) + "---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["goodput_per_replica_hour"] / base if base else math.nan
        lines.append(
            f"| {r['variant']} | {r['cap']} | {r['requests']} | {r['met']} | "
            + " | ".join(_pct(r["met_by_class"][c]) for c in classes)
            + f" | {r['refused_429']} | {r['replica_hours']:.3f}"
            f" | {r['goodput_per_replica_hour']:.1f} | {_num(ratio, 2)}x |"
        )
    return "\n".join(lines)


def minute_rows(runs: Sequence[VariantRun], slos: Mapping[str, SLO]) -> list[dict[str, Any]]:
    """Per variant, the requests that met their objectives per simulated minute, by arrival."""
    rows = []
    for run in runs:
        k = run.time_scale
        minutes = max(1, math.ceil(run.duration_s / MINUTE_S))  # a late send: the last
        met = [0] * minutes
        for r in run.records:
            if (slos.get(r.cls) or SLO()).met(r, k):
                met[min(minutes - 1, int(r.start_s * k // MINUTE_S))] += 1
        rows.append({"variant": run.variant.name, "cap": run.variant.cap, "per_minute": met})
    return rows


def minute_table(rows: Sequence[dict[str, Any]]) -> str:
    minutes = max(len(r["per_minute"]) for r in rows)
    reference = rows[0]["per_minute"]
    head = " | ".join(f"minute {i + 1}" for i in range(minutes))
    lines = [
        f"| variant | cap | {head} | last minute vs {rows[0]['variant']} |",
        "|---|---:|" + "---:|" * (minutes + 1),
    ]
    for r in rows:
        counts = r["per_minute"] + [0] * (minutes - len(r["per_minute"]))
        last = counts[-1] / reference[-1] if reference[-1] else math.nan
        cells = " | ".join(str(n) for n in counts)
        lines.append(f"| {r['variant']} | {r['cap']} | {cells} | {_num(last, 2)}x |")
    return "\n".join(lines)


def overload_rows(runs: Sequence[VariantRun], slos: Mapping[str, SLO]) -> list[dict[str, Any]]:
    """Per variant: the critical requests' TTFT attainment (of those sent) and each tier's share
    of its requests refused with 429."""
    rows = []
    for run in runs:
        k = run.time_scale
        critical = [r for r in run.records if r.priority == "critical"]
        ttft_met = sum(
            r.ok
            and r.ttft_s is not None
            and r.ttft_s * k <= (getattr(slos.get(r.cls), "ttft_s", None) or math.inf)
            for r in critical
        )
        refused = {}
        for tier in TIERS:
            sent = [r for r in run.records if r.priority == tier]
            refused[tier] = sum(r.status == 429 for r in sent) / len(sent) if sent else math.nan
        codes: dict[str, int] = {}
        for r in run.records:
            if r.status == 429:
                codes[r.code or "?"] = codes.get(r.code or "?", 0) + 1
        rows.append(
            {
                "variant": run.variant.name,
                "critical": len(critical),
                "critical_ttft_attainment": ttft_met / len(critical) if critical else math.nan,
                "refused_429_by_tier": refused,
                "codes_429": codes,
                "goodput_per_replica_hour": goodput_per_replica_hour(
                    run.records, slos, k, run.replica_hours
                ),
            }
        )
    return rows


def overload_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| variant | critical sent | critical TTFT met | "
        + " | ".join(f"{t} 429" for t in TIERS)
        + " | 429 codes | goodput / replica-hour |",
        "|---|---:|---:|" + "---:|" * len(TIERS) + "---|---:|",
    ]
    for r in rows:
        codes = ", ".join(f"{c} {n}" for c, n in sorted(r["codes_429"].items())) or "-"
        lines.append(
            f"| {r['variant']} | {r['critical']} | {_pct(r['critical_ttft_attainment'])} | "
            + " | ".join(_pct(r["refused_429_by_tier"][t]) for t in TIERS)
            + f" | {codes} | {r['goodput_per_replica_hour']:.1f} |"
        )
    return "\n".join(lines)


def _errors(pairs: Sequence[tuple[float, float]], k: float) -> dict[str, Any]:
    """|predicted - observed| of (predicted, observed) wall-second pairs, in simulated ms."""
    errors = [abs(predicted - observed) * k * 1000 for predicted, observed in pairs]
    return {
        "requests": len(errors),
        "p50_ms": percentile(errors, 50),
        "p90_ms": percentile(errors, 90),
    }


def _client_pairs(run: VariantRun, metric: str) -> list[tuple[float, float]]:
    return [
        (predicted, observed)
        for r in run.records
        if r.ok
        and (predicted := getattr(r, f"predicted_{metric}_s")) is not None
        and (observed := getattr(r, f"{metric}_s")) is not None
    ]


def _logged_pairs(run: VariantRun, metric: str) -> list[tuple[float, float]]:
    """From the access log: TTFT from the grant (its TTFT from arrival less its queue wait),
    TPOT over the output tokens after the first."""
    out = []
    for line in run.access:
        predicted, ttft = line.get(f"predicted_{metric}_s"), line.get("ttft_s")
        if line.get("status") != 200 or predicted is None or ttft is None:
            continue
        if metric == "ttft":
            out.append((predicted, ttft - (line.get("queue_wait_s") or 0.0)))
        elif (tokens := line.get("output_tokens") or 0) > 1 and line.get("e2e_s") is not None:
            out.append((predicted, (line["e2e_s"] - ttft) / (tokens - 1)))
    return out


def prediction_rows(runs: Sequence[VariantRun]) -> list[dict[str, Any]]:
    """|predicted - observed| in simulated ms, over the completed requests the gateway predicted:
    as the client observed them, and as the gateway logged them."""
    rows = []
    for run in runs:
        for source, pairs in (("client", _client_pairs), ("gateway log", _logged_pairs)):
            row: dict[str, Any] = {"variant": run.variant.name, "observed by": source}
            for metric in ("ttft", "tpot"):
                row[metric] = _errors(pairs(run, metric), run.time_scale)
            rows.append(row)
    return rows


def prediction_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| variant | observed by | TTFT predicted | TTFT error p50 ms | p90 ms | TPOT predicted"
        " | TPOT error p50 ms | p90 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, p = r["ttft"], r["tpot"]
        lines.append(
            f"| {r['variant']} | {r['observed by']} | {t['requests']} | {_num(t['p50_ms'])}"
            f" | {_num(t['p90_ms'])} | {p['requests']} | {_num(p['p50_ms'], 2)}"
            f" | {_num(p['p90_ms'], 2)} |"
        )
    return "\n".join(lines)


# --- the experiments ------------------------------------------------------------------------


def _trace(spec: str) -> Trace:
    points = builtin(spec)
    assert points is not None
    return Trace({WORKLOAD: tuple(points)})


@dataclass(frozen=True)
class Plan:
    """What one experiment runs: its trace and variants, and how its table is made."""

    trace: Trace
    variants: tuple[Variant, ...]
    table: Callable[[Sequence[VariantRun], Mapping[str, SLO]], tuple[list[dict[str, Any]], str]]


def _goodput(runs: Sequence[VariantRun], slos: Mapping[str, SLO]) -> tuple[list[Any], str]:
    rows = goodput_rows(runs, slos)
    return rows, goodput_table(rows)


def _minutes(runs: Sequence[VariantRun], slos: Mapping[str, SLO]) -> tuple[list[Any], str]:
    rows = minute_rows(runs, slos)
    return rows, minute_table(rows)


def _overload(runs: Sequence[VariantRun], slos: Mapping[str, SLO]) -> tuple[list[Any], str]:
    rows = overload_rows(runs, slos)
    return rows, overload_table(rows)


def _prediction(runs: Sequence[VariantRun], slos: Mapping[str, SLO]) -> tuple[list[Any], str]:
    rows = prediction_rows(runs)
    return rows, prediction_table(rows)


def experiment_plan(setup: Setup, workload: Workload, knee: Knee, model: LatencyModelSpec) -> Plan:
    """The experiment's trace (rates are multiples of the fleet's capacity) and variants:
    `static` (caps at the knee, as before objectives), `slo` (the same caps, admission by
    objective: the latency model, headroom placement, sheddable work refused when no replica
    would meet it) and `slo+adaptive` (adaptive caps under a ceiling of twice the knee)."""
    capacity = knee.capacity_rps * setup.replicas * setup.load
    d = setup.duration_s
    slo = slo_spec(workload, model, setup.adaptive_interval_s)
    static = Variant("static", knee.cap)
    by_objective = Variant("slo", knee.cap, slo_spec(workload, model, None))
    adaptive = Variant("slo+adaptive", 2 * knee.cap, slo)
    if setup.experiment == "goodput":
        every = max(d / 3, 1.0)
        spec = (
            f"bursts:base={0.7 * capacity:.4g},peak={1.5 * capacity:.4g},start={every / 3:.4g},"
            f"every={every:.4g},length={every / 3:.4g},duration={d:g}"
        )
        return Plan(_trace(spec), (static, by_objective, adaptive), _goodput)
    steady = {"miscap": 1.0, "overload": 2.0, "prediction": 0.8}[setup.experiment]
    rate = f"{steady * capacity:.4g}"
    trace = _trace(f"step:base={rate},peak={rate},start=0,end=0,duration={d:g}")
    if setup.experiment == "miscap":
        # Written too low: the caps start there, under a ceiling that lets them find the knee.
        ceiling = {**slo, "adaptive": {**slo["adaptive"], "max_concurrency": 2 * knee.cap}}
        low = Variant("slo+adaptive, cap 0.5x knee", max(1, knee.cap // 2), ceiling)
        high = Variant("slo+adaptive, cap 2x knee", 2 * knee.cap, slo)
        return Plan(trace, (static, low, high), _minutes)
    if setup.experiment == "overload":
        return Plan(trace, (static, by_objective, adaptive), _overload)
    return Plan(trace, (by_objective,), _prediction)


async def run_experiment(setup: Setup) -> dict[str, Any]:
    """Run the experiment; returns what results.json holds, `table` among it."""
    profile = load_profile(setup.profile)
    workload = load_workload(WORKLOAD)
    knee = knee_of(profile, workload, setup.seed)
    model = fit_seed(profile, setup.seed).model
    plan = experiment_plan(setup, workload, knee, model)
    slos = objective_slos(workload)
    runs = [await run_fleet(setup, profile, v, plan.trace) for v in plan.variants]
    if setup.autoscale and setup.experiment == "goodput":
        runs += [await run_autoscaled(setup, profile, v, plan.trace) for v in plan.variants]
    rows, table = plan.table(runs, slos)
    head = (
        f"{setup.experiment}: {setup.replicas} x {setup.profile}, {WORKLOAD}, time scale"
        f" {setup.time_scale:g}, seed {setup.seed}, {setup.duration_s:g} simulated s of"
        f" arrivals; knee {knee.cap} ({knee.reason}), capacity {knee.capacity_rps:.2f} req/s"
        " a replica. Simulated times."
        + (f" Every rate x{setup.load:g} (a smoke run)." if setup.load != 1 else "")
    )
    slips = ", ".join(f"{run.variant.name} {run.slip_s:.1f} s" for run in runs)
    head += f" Most simulated time a replica's clock lost to the machine: {slips}."
    notes = [n for run in runs for n in run.notes]
    return {
        "setup": {**asdict(setup), "out": str(setup.out)},
        "knee": asdict(knee),
        "variants": [asdict(v) for v in plan.variants],
        "trace": plan.trace.rows(),
        "rows": rows,
        "table": f"{head}\n\n{table}\n" + "".join(f"\n> {n}\n" for n in notes),
        "requests": {run.variant.name: [r.row() for r in run.records] for run in runs},
    }


def write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_bytes(
        orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    )
    (out / "table.md").write_text(result["table"])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.slo_experiments", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("experiment", choices=EXPERIMENTS)
    p.add_argument("--profile", default="gemma-3-27b-tpu-v6e-2x2")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--time-scale", type=float, default=10.0, help="simulated s per wall s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=180.0, help="simulated seconds of arrivals")
    p.add_argument(
        "--queue-wait", type=float, default=2.0, help="the queue's max wait, simulated s"
    )
    p.add_argument(
        "--adaptive-interval", type=float, default=5.0, help="between cap moves, simulated s"
    )
    p.add_argument(
        "--autoscale", action="store_true", help="goodput: under the autoscaling loop as well"
    )
    p.add_argument("--startup", type=float, default=120.0, help="--autoscale: simulated s")
    p.add_argument(
        "--load", type=float, default=1.0, help="every rate times this (below 1: a smoke run)"
    )
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.replicas < 1 or min(args.time_scale, args.duration, args.load) <= 0:
        raise SystemExit("--replicas, --time-scale, --duration and --load must be positive")
    setup = Setup(
        args.experiment, args.profile, args.replicas, args.time_scale, args.seed, args.out,
        args.duration, args.queue_wait, args.adaptive_interval, args.autoscale, args.startup,
        load=args.load,
    )  # fmt: skip
    result = asyncio.run(run_experiment(setup))
    write(result, args.out)
    print(result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
