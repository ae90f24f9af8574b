"""`llm-loadtest autoscale`: the gateway in front of a simulated pool that a model of the
Kubernetes HPA scales on the gateway's own metric, driven by a trace. Loopback only.

    llm-loadtest autoscale [--trace step:base=0.5,peak=5,start=60,end=240,duration=720 | FILE.csv]
                           [--signal reactive|forecast|max|attainment] [--startup-s 180]
                           [--time-scale 12]
                           [--out loadtest-autoscale]
    llm-loadtest autoscale --fleet loadtest/autoscale/fleets/gemma3-seed.yaml \
        --trace classification=step:base=4,peak=12,start=300,end=1500,duration=2100 \
        --trace generation=step:base=1.5,peak=1.5,duration=2100 --signal max [--no-spill]
    llm-loadtest autoscale --trace-from-log access.jsonl --bin-s 60 --trace-out trace.csv

Every duration is in simulated seconds (wall seconds x --time-scale); docs/autoscale.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gateway.config.schema import COUNT_BY_CHARS
from loadtest.autoscale import hpa, report
from loadtest.autoscale.loop import (
    DEFAULT_SLO_MISS_TARGET,
    FORECAST,
    REACTIVE,
    AutoscaleConfig,
    PoolConfig,
    Signal,
    run_autoscale,
)
from loadtest.autoscale.trace import STEP, from_access_log, load_traces, write_trace
from loadtest.loadgen.compare import DEFAULT_SLOS, SLO, objective_slos, parse_slo
from loadtest.loadgen.profile import read_access_log
from loadtest.loadgen.workloads import load_workload
from loadtest.real_tokenizers import cache_root
from loadtest.tiny_tokenizer import ensure

T = TypeVar("T")
DEFAULT_TRACE = "step:" + ",".join(f"{k}={v:g}" for k, v in STEP.items())


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def _not_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must not be negative")
    return value


def _slo(text: str) -> tuple[str, SLO]:
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _forecast(text: str) -> tuple[str, float]:
    key, eq, value = text.partition("=")
    if not eq:
        raise argparse.ArgumentTypeError(f"{text!r}: reads KEY=VALUE, e.g. ceiling=2.5")
    return key, _positive(value)


def _pool_slo(text: str) -> dict[str, Any]:
    given = yaml.safe_load(text)
    if not isinstance(given, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: a pool's `slo` mapping in YAML")
    return given


def _policy(text: str) -> hpa.ScalingPolicy:
    kind, value, period = text.split(":")
    if kind not in ("Pods", "Percent"):
        raise argparse.ArgumentTypeError(f"{text!r}: a policy reads Pods|Percent:VALUE:PERIOD_S")
    return hpa.ScalingPolicy(kind, int(value), float(period))  # type: ignore[arg-type]


def _rules(
    window: float | None, policies: list[hpa.ScalingPolicy] | None, select: str | None,
    default: hpa.ScalingRules, given: bool,
) -> hpa.ScalingRules | None:  # fmt: skip
    """The flags over `default` (the manifest's or the API's); None: the API's defaults."""
    if window is None and policies is None and select is None:
        return default if given else None
    return hpa.ScalingRules(
        default.stabilization_s if window is None else window,
        tuple(policies) if policies else default.policies,
        select or default.select,  # type: ignore[arg-type]
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llm-loadtest autoscale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", action="append", metavar="[WORKLOAD=]SPEC",
                   help="built-in NAME:params or a CSV file; WORKLOAD=NAME:params gives one"
                   f" workload its own curve; repeatable (default: {DEFAULT_TRACE})")  # fmt: skip
    p.add_argument("--fleet", type=Path,
                   help="pools, classes and routes from a YAML file"
                   " (loadtest/autoscale/fleets/); the single-pool flags then do not apply")  # fmt: skip
    p.add_argument("--forecast", action="append", default=[], type=_forecast, metavar="KEY=VALUE",
                   help="every pool's forecast constant (level_s, trend_s, damping_s: simulated;"
                   " ceiling), over the fleet's; repeatable")  # fmt: skip
    p.add_argument("--no-spill", dest="spill", action="store_false",
                   help="leave the routes' fallbacks out (spill-over off)")  # fmt: skip
    p.add_argument("--workload", default="generation", help="for trace rows without one")
    p.add_argument("--profile", help="simulated replica (default gemma-3-27b-tpu-v6e-2x2)")
    p.add_argument("--hpa", metavar="FILE[#NAME]",
                   help="take min/max replicas, behavior and target from an HPA manifest"
                   " (e.g. deploy/base/autoscaling/hpa.yaml#gemma3-27b-gen); flags override")  # fmt: skip
    p.add_argument("--pool", help="default: the --hpa metrics' pool, else generate-27b")
    p.add_argument("--time-scale", type=_positive, default=AutoscaleConfig.time_scale,
                   help="simulated s per wall s (default: %(default)s)")  # fmt: skip
    p.add_argument("--startup-s", type=_positive, default=AutoscaleConfig.startup_s,
                   help="asked for -> serving, per replica (default: %(default)s)")  # fmt: skip
    p.add_argument("--signal", choices=("reactive", "forecast", "max", "attainment"),
                   help="the metric(s) the HPA reads; max: both, the larger wins; attainment:"
                   " the reactive one and the SLO miss share, the larger wins (default:"
                   " reactive, or what the --hpa manifest lists)")  # fmt: skip
    p.add_argument("--slo-miss-target", type=_positive, default=DEFAULT_SLO_MISS_TARGET,
                   help="with --signal attainment: the miss share the HPA's Value target allows"
                   " (default: %(default)s, a 90%% attainment)")  # fmt: skip
    p.add_argument("--pool-slo", type=_pool_slo, metavar="YAML",
                   help="the pool's policy `slo` in simulated ms, e.g. '{objectives: {standard:"
                   " {ttft_ms: 2000, tpot_ms: 100}}}' (a fleet's pools say their own)")  # fmt: skip
    p.add_argument("--metric", default=REACTIVE, help="the reactive gauge")
    p.add_argument("--forecast-metric", default=FORECAST, help="for --signal forecast|max")
    p.add_argument("--target", type=_positive, help="AverageValue per replica (default 1)")
    p.add_argument("--min-replicas", type=int, help="default 1")
    p.add_argument("--max-replicas", type=int, help="default 8")
    p.add_argument("--initial-replicas", type=int, help="ready at time 0 (default 1)")
    p.add_argument(
        "--sync-period-s",
        type=_positive,
        default=hpa.DEFAULT_SYNC_PERIOD_S,
        help="the HPA's sync period (default %(default)s)",
    )
    p.add_argument(
        "--tolerance",
        type=_not_negative,
        default=hpa.DEFAULT_TOLERANCE,
        help="no change within this of a usage ratio of 1 (default %(default)s)",
    )
    for way, default in (("up", hpa.DEFAULT_SCALE_UP), ("down", hpa.DEFAULT_SCALE_DOWN)):
        p.add_argument(
            f"--scale-{way}-window-s",
            type=_not_negative,
            help=f"stabilisation window (default {default.stabilization_s:g})",
        )
        p.add_argument(
            f"--scale-{way}-policy",
            type=_policy,
            action="append",
            help="Pods|Percent:VALUE:PERIOD_S, repeatable (default: "
            + ", ".join(f"{x.type}:{x.value}:{x.period_s:g}" for x in default.policies)
            + ")",
        )
        p.add_argument(f"--scale-{way}-select", choices=("Max", "Min", "Disabled"),
                       help=f"policy selection (default {default.select})")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, help="gateway cap per replica (default 16)")
    p.add_argument("--queue-wait-s", type=_positive, default=AutoscaleConfig.queue_wait_s,
                   help="gateway max_wait_s")  # fmt: skip
    p.add_argument("--dns-interval-s", type=_positive, default=AutoscaleConfig.dns_interval_s,
                   help="gateway re-resolves")  # fmt: skip
    p.add_argument("--scrape-interval-s", type=_not_negative,
                   default=AutoscaleConfig.scrape_interval_s,
                   help="Prometheus scrapes the gateway; the HPA reads the newest scrape"
                   " (0: /metrics at each sync)")  # fmt: skip
    p.add_argument("--slo", action="append", default=[], type=_slo, metavar="CLASS:metric=s,...",
                   help="per workload, e.g. generation:ttft=2,tpot=0.1 (replaces its default)")  # fmt: skip
    p.add_argument("--slo-e2e-s", type=_positive, help="an E2E limit for every workload")
    p.add_argument("--window-s", type=_positive, default=30.0, help="P95-over-time window")
    p.add_argument(
        "--max-requests",
        type=int,
        default=AutoscaleConfig.max_requests,
        help="refuse a trace planning more (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="arrivals and shapes")
    p.add_argument("--tokenizer", help="HF tokenizer dir, or `estimate`: none anywhere, 4"
                   " characters a token (default: a tiny one, built)")  # fmt: skip
    p.add_argument(
        "--out",
        type=Path,
        default=Path("loadtest-autoscale"),
        help="report directory (default: %(default)s in the current directory)",
    )
    p.add_argument("--trace-from-log", type=Path, help="write a trace from an access log, exit")
    p.add_argument("--bin-s", type=float, default=60.0, help="with --trace-from-log")
    p.add_argument("--class-workload", action="append", default=[], metavar="CLASS=WORKLOAD",
                   help="with --trace-from-log: the gateway class's loadgen workload")  # fmt: skip
    p.add_argument(
        "--trace-out",
        type=Path,
        default=Path("trace.csv"),
        help="with --trace-from-log: the CSV written",
    )
    return p


def first(*values: T | None) -> T:
    """The first value given (a flag, then the manifest's, then the default)."""
    return next(v for v in values if v is not None)


def load_manifest(spec: str | None) -> hpa.Manifest | None:
    """`FILE#NAME`, or `FILE` for its first HorizontalPodAutoscaler."""
    if spec is None:
        return None
    path, _, name = spec.partition("#")
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    hpas = [d for d in docs if d.get("kind") == "HorizontalPodAutoscaler"]
    chosen = [d for d in hpas if not name or d["metadata"]["name"] == name]
    if not chosen:
        names = ", ".join(d["metadata"]["name"] for d in hpas)
        raise SystemExit(f"llm-loadtest autoscale: no HPA {name!r} in {path} (it has {names})")
    return hpa.from_manifest(chosen[0])


def manifest_target(manifest: hpa.Manifest | None, metric: str) -> float | None:
    if manifest is None:
        return None
    return next((m.target for m in manifest.metrics if m.name == metric), None)


def manifest_notes(manifest: hpa.Manifest | None) -> tuple[str, ...]:
    if manifest is None or not manifest.unmodelled:
        return ()
    return (
        f"HPA {manifest.name}: not modelled, so left out: {', '.join(manifest.unmodelled)}."
        " The real HPA would also scale on it (the larger proposal wins).",
    )


def slos(
    args: argparse.Namespace, classes: Iterable[str], workloads: Iterable[str] = ()
) -> dict[str, SLO]:
    """loadgen's default SLOs, then the workloads' own objectives (`slo:` on a class), then
    `--slo`, then `--slo-e2e-s` for every class sent."""
    out = dict(DEFAULT_SLOS)
    for name in workloads:
        out.update(objective_slos(load_workload(name)))
    out.update(args.slo)
    if args.slo_e2e_s is not None:
        for name in {*classes, *out}:
            base = out.get(name, SLO())
            out[name] = SLO(args.slo_e2e_s, base.ttft_s, base.tpot_s)
    return out


def tokenizer(given: str | None) -> str | None:
    """The tokenizer directory; None for `estimate`; the tiny one (built once, in the user's cache,
    not the installed package) if none."""
    if given == COUNT_BY_CHARS:
        return None
    if given is not None:
        return given
    return ensure(cache_root().parent / "tiny-tokenizer")


SINGLE_POOL_FLAGS = ("pool", "profile", "max_concurrency", "target", "min_replicas",
                     "max_replicas", "initial_replicas", "pool_slo")  # fmt: skip


def fleet(args: argparse.Namespace, manifest: hpa.Manifest | None) -> dict[str, Any]:
    """`pools`, `classes` and `routes` for the config: from `--fleet`, or one pool of flags."""
    if args.fleet is not None:
        given = [
            f"--{f.replace('_', '-')}" for f in SINGLE_POOL_FLAGS if getattr(args, f) is not None
        ]
        given += ["--hpa"] if manifest is not None else []
        if given:
            raise SystemExit(
                f"llm-loadtest autoscale: --fleet names its pools; drop {' '.join(given)}"
            )
        return load_fleet(args.fleet)
    pool = PoolConfig(
        name=args.pool or (manifest.pool if manifest else None) or PoolConfig.name,
        profile=args.profile or PoolConfig.profile,
        max_concurrency=first(args.max_concurrency, PoolConfig.max_concurrency),
        target=first(args.target, manifest_target(manifest, args.metric), PoolConfig.target),
        min_replicas=first(
            args.min_replicas, manifest.min_replicas if manifest else None, PoolConfig.min_replicas
        ),
        max_replicas=first(
            args.max_replicas, manifest.max_replicas if manifest else None, PoolConfig.max_replicas
        ),
        initial_replicas=first(args.initial_replicas, PoolConfig.initial_replicas),
        slo=args.pool_slo,
    )
    return {"pools": (pool,)}


def load_fleet(path: Path) -> dict[str, Any]:
    """A fleet file: `pools` (a list of PoolConfig fields), the gateway's `classes` and
    `routes` in policy syntax."""
    doc = yaml.safe_load(path.read_text()) or {}
    unknown = set(doc) - {"pools", "classes", "routes"}
    if unknown or not doc.get("pools"):
        raise SystemExit(f"llm-loadtest autoscale: {path}: needs `pools`; unknown: {unknown}")
    try:
        pools = tuple(PoolConfig(**entry) for entry in doc["pools"])
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"llm-loadtest autoscale: {path}: {exc}") from None
    return {
        "pools": pools,
        "classes": tuple(doc["classes"]) if doc.get("classes") else None,
        "routes": tuple(doc["routes"]) if doc.get("routes") else None,
    }


def manifest_signal(manifest: hpa.Manifest | None, args: argparse.Namespace) -> Signal:
    """The signal an HPA manifest's metric list amounts to: both gauges are `max`."""
    names = {m.name for m in manifest.metrics} if manifest else set()
    if args.forecast_metric in names:
        return "max" if args.metric in names else "forecast"
    return "reactive"


def build_config(args: argparse.Namespace, manifest: hpa.Manifest | None) -> AutoscaleConfig:
    pools = fleet(args, manifest)
    if args.forecast:
        given = dict(args.forecast)
        pools["pools"] = tuple(
            dataclasses.replace(p, forecast={**p.forecast, **given}) for p in pools["pools"]
        )
    return AutoscaleConfig(
        trace=load_traces(args.trace or [DEFAULT_TRACE], args.workload),
        tokenizer=tokenizer(args.tokenizer),
        out=args.out,
        **pools,
        spill=args.spill,
        time_scale=args.time_scale,
        startup_s=args.startup_s,
        signal=args.signal or manifest_signal(manifest, args),
        metric=args.metric,
        forecast_metric=args.forecast_metric,
        slo_miss_target=args.slo_miss_target,
        scale_up=_rules(args.scale_up_window_s, args.scale_up_policy, args.scale_up_select,
                        manifest.scale_up if manifest else hpa.DEFAULT_SCALE_UP,
                        manifest is not None),
        scale_down=_rules(args.scale_down_window_s, args.scale_down_policy,
                          args.scale_down_select,
                          manifest.scale_down if manifest else hpa.DEFAULT_SCALE_DOWN,
                          manifest is not None),
        notes=manifest_notes(manifest),
        tolerance=args.tolerance,
        sync_period_s=args.sync_period_s,
        queue_wait_s=args.queue_wait_s,
        dns_interval_s=args.dns_interval_s,
        scrape_interval_s=args.scrape_interval_s,
        max_requests=args.max_requests,
        seed=args.seed,
    )  # fmt: skip


def main(argv: Sequence[str]) -> int:
    """`argv[0]` is `autoscale`, as loadtest/cli.py passes it."""
    args = parser().parse_args(list(argv)[1:])
    if args.trace_from_log is not None:
        mapping = dict(pair.split("=", 1) for pair in args.class_workload)
        trace = from_access_log(read_access_log(args.trace_from_log), args.bin_s, mapping)
        write_trace(trace, args.trace_out)
        print(
            f"wrote {args.trace_out}: {trace.duration_s:g} s, workloads {', '.join(trace.series)}"
        )
        return 0
    manifest = load_manifest(args.hpa)
    try:
        config = build_config(args, manifest)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"llm-loadtest autoscale: {exc}") from None
    wall = config.trace.duration_s / config.time_scale
    print(f"autoscale: trace of {config.trace.duration_s:g} simulated s at time scale"
          f" {config.time_scale:g} (~{wall:.0f} s of load, wall clock), signal {config.signal}, start-up"
          f" {config.startup_s:g} s ...", flush=True)  # fmt: skip
    run = asyncio.run(run_autoscale(config))
    targets = slos(args, {r.cls for r in run.records}, config.trace.series)
    summary = report.summarise(run, targets, args.window_s)
    report.write(run, summary, args.out)
    for note in run.notes:
        print(f"note: {note}")
    a = summary["all"]
    print(f"{a['requests']} requests: {a['ok']} ok, {a['slo_violations']} SLO-violating,"
          f" {a['refused_429']} refused (429), {a['refused_503']} (503), {a['other_failures']}"
          f" other failures; {summary['spilled']} spilled; P95 E2E {a['p95_e2e_s']} s;"
          f" {summary['replica_hours']:g} replica-hours (simulated times)")  # fmt: skip
    for m in summary["replicas"]:
        print(f"  {m['pool']} {m['host']}: asked {m['asked_s']:g} s, ready {m['ready_s']}, removed"
              f" {m['removed_s']}, served {m['requests_served']}")  # fmt: skip
    print(f"report: {os.path.relpath(args.out)}/autoscale.md (autoscale.json, autoscale.png)")
    return 0 if a["ok"] else 1
