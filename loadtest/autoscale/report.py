"""An autoscaling run's report: JSON, Markdown and a PNG, every time in simulated seconds.

A request violates its SLO when it completed (200) but one of its class's limits did not hold
for it (E2E, TTFT or TPOT, loadgen's `SLO`); refused ones (429, 503) are counted apart, as are
other failures. Replica-hours count each replica from when it was asked for (a TPU that is
loading weights is paid for) until it was stopped, within the run; goodput per replica-hour is
the requests that met their SLO over them (loadgen's `goodput_per_replica_hour`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

from loadtest.autoscale.hpa import DEFAULT_SCALE_DOWN, DEFAULT_SCALE_UP, ScalingRules
from loadtest.autoscale.loop import AutoscaleConfig, AutoscaleRun
from loadtest.autoscale.pool import Member
from loadtest.loadgen.compare import SLO, goodput_per_replica_hour
from loadtest.loadgen.report import request_row
from loadtest.loadgen.runner import RequestRecord
from loadtest.loadgen.stats import percentile

REFUSED = (429, 503)


def violates(rec: RequestRecord, slo: SLO | None, time_scale: float) -> bool:
    """Completed, but over one of its workload's limits."""
    return rec.ok and slo is not None and not slo.met(rec, time_scale)


def _counts(records: list[RequestRecord], slos: Mapping[str, SLO], k: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    e2e = [r.e2e_s * k for r in ok if r.e2e_s is not None]
    violations = sum(violates(r, slos.get(r.cls), k) for r in records)
    refused = {code: sum(r.status == code for r in records) for code in REFUSED}
    return {
        "requests": len(records),
        "ok": len(ok),
        "slo_violations": violations,
        "refused_429": refused[429],
        "refused_503": refused[503],
        "violating_or_refused": violations + refused[429] + refused[503],
        "other_failures": sum(not r.ok and r.status not in REFUSED for r in records),
        "p50_e2e_s": _round(percentile(e2e, 50)),
        "p95_e2e_s": _round(percentile(e2e, 95)),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def p95_over_time(
    run: AutoscaleRun, window_s: float, metric: str = "e2e_s", workload: str | None = None
) -> list[tuple[float, float | None]]:
    """P95 of a latency (`e2e_s`, `ttft_s`, `tpot_s`) of the completed requests (of one
    workload, or all) that started in each window: (window midpoint, seconds)."""
    k = run.config.time_scale
    buckets: list[list[float]] = [[] for _ in range(_windows(run, window_s))]
    for r in run.records:
        value = getattr(r, metric)
        if r.ok and value is not None and workload in (None, r.cls):
            buckets[_window(run, r, window_s)].append(value * k)
    return [((i + 0.5) * window_s, percentile(b, 95)) for i, b in enumerate(buckets)]


def _windows(run: AutoscaleRun, window_s: float) -> int:
    return max(1, math.ceil(run.end_s / window_s))


def _window(run: AutoscaleRun, record: RequestRecord, window_s: float) -> int:
    """The window a request started in (simulated time), the last one for a late start."""
    start_s = record.start_s * run.config.time_scale
    return min(_windows(run, window_s) - 1, int(start_s // window_s))


def _rules(rules: ScalingRules) -> str:
    policies = ", ".join(
        f"{p.value:g}{'%' if p.type == 'Percent' else ' pods'} per {p.period_s:g} s"
        for p in rules.policies
    )
    return f"{rules.stabilization_s:g} s window, {policies} (select {rules.select})"


def behavior(run: AutoscaleRun) -> str:
    """The HPA behavior in effect, as the report prints it."""
    c = run.config
    up, down = c.scale_up or DEFAULT_SCALE_UP, c.scale_down or DEFAULT_SCALE_DOWN
    return f"scale up {_rules(up)}; scale down {_rules(down)}; tolerance {c.tolerance:g}"


def _member(m: Member, url: str | None, served: Counter[str | None]) -> dict[str, Any]:
    return {
        "pool": m.pool,
        "host": m.host,
        "asked_s": round(m.asked_s, 1),
        "ready_s": None if m.started_s is None else round(m.started_s, 1),
        "removed_s": None if m.removed_s is None else round(m.removed_s, 1),
        "stopped_s": None if m.gone_s is None else round(m.gone_s, 1),
        "requests_served": served.get(url, 0),
    }


def _replica_s(members: list[Member], end: float) -> float:
    """Each replica from when it was asked for until it stopped, within the run."""
    return sum(min(end, m.gone_s if m.gone_s is not None else end) - m.asked_s for m in members)


def summarise(run: AutoscaleRun, slos: Mapping[str, SLO], window_s: float) -> dict[str, Any]:
    k, end = run.config.time_scale, run.end_s
    ok_lines = [line for line in run.access if line.get("status") == 200]
    served = Counter(line.get("replica") for line in ok_lines)
    host_url = {h: u for u, h in run.url_of.items()}
    pools = {}
    for p in run.config.pools:
        members = [m for m in run.members if m.pool == p.name]
        samples = [s for s in run.samples if s.pool == p.name]
        pools[p.name] = {
            "profile": p.profile,
            "max_concurrency": p.max_concurrency,
            "replicas_min_max": [p.min_replicas, p.max_replicas],
            "hpa_metrics": list(run.signal_used.get(p.name, ())),
            "target": p.target,
            "replica_hours": round(_replica_s(members, end) / 3600, 3),
            "peak_ready": max((s.ready for s in samples), default=0),
            "peak_desired": max((s.desired for s in samples), default=0),
            "requests_served": sum(line.get("pool") == p.name for line in ok_lines),
            "spilled_in": sum(
                line.get("pool") == p.name and bool(line.get("spilled_from")) for line in ok_lines
            ),
        }
    replica_hours = _replica_s(run.members, end) / 3600
    by_class: dict[str, list[RequestRecord]] = {}
    for r in run.records:
        by_class.setdefault(r.cls, []).append(r)
    return {
        "window_s": window_s,
        "clock": "simulated seconds (wall seconds x time scale)",
        "time_scale": k,
        "simulated_s": round(end, 1),
        "wall_s": round(run.wall_s, 1),
        "signal": run.config.signal,
        "spill": run.config.spill,
        "notes": run.notes,
        "behavior": behavior(run),
        "startup_s": run.config.startup_s,
        "replica_hours": round(replica_hours, 3),
        "goodput_per_replica_hour": (
            round(goodput_per_replica_hour(run.records, slos, k, replica_hours), 1)
            if replica_hours > 0
            else None
        ),
        "spilled": sum(bool(line.get("spilled_from")) for line in ok_lines),
        "slos": {c: s.limits() for c, s in slos.items()},
        "all": _counts(run.records, slos, k),
        "by_workload": {c: _counts(rs, slos, k) for c, rs in by_class.items()},
        "pools": pools,
        "bad_by_window": bad_over_time(run, slos, window_s),
        "replicas": [_member(m, host_url.get(m.host), served) for m in run.members],
    }


def write(run: AutoscaleRun, summary: dict[str, Any], out: Path) -> list[Path]:
    timeline = [
        {
            "pool": s.pool,
            "t_s": s.t_s,
            "rate_rps": round(s.rate_rps, 4),
            "ready": s.ready,
            "current": s.current,
            "desired": s.desired,
            "reason": s.reason,
            "metrics": s.metrics,
        }
        for s in run.samples
    ]
    p95 = latency_windows(run, summary)
    data = {**summary, "timeline": timeline, "p95_by_window": p95}
    (out / "autoscale.json").write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    k = run.config.time_scale
    rows = (orjson.dumps(request_row(r, k)) for r in run.records)  # in simulated seconds
    (out / "requests.jsonl").write_bytes(b"\n".join(rows))
    plot(run, p95, summary, out / "autoscale.png")
    (out / "autoscale.md").write_text(markdown(run, summary))
    return [out / "autoscale.json", out / "autoscale.md", out / "autoscale.png"]


def spill_state(config: AutoscaleConfig) -> str:
    if not any(route.get("fallback") for route in config.routes or ()):
        return "no fallbacks"
    return f"spill-over {'on' if config.spill else 'off'}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def markdown(run: AutoscaleRun, summary: dict[str, Any]) -> str:
    c = run.config
    a = summary["all"]
    signal = f"signal `{c.signal}`, {spill_state(c)}"
    out = [
        "# Autoscaling run",
        "",
        f"Pools {', '.join(f'`{p.name}` ({p.profile})' for p in c.pools)}; {signal}; start-up"
        f" {c.startup_s:g} s, HPA sync {c.sync_period_s:g} s. Time scale {c.time_scale:g}:"
        f" {summary['simulated_s']:g} simulated seconds in {summary['wall_s']:g} wall seconds."
        " **Every time below is in simulated seconds.**",
        "",
        f"Behavior: {summary['behavior']}.",
        "",
        *[line for note in summary["notes"] for line in (f"> {note}", "")],
        "| requests | ok | SLO-violating | refused 429 | refused 503 | other failures"
        " | spilled | P50 E2E | P95 E2E | replica-hours |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {a['requests']} | {a['ok']} | {a['slo_violations']} | {a['refused_429']}"
        f" | {a['refused_503']} | {a['other_failures']} | {summary['spilled']}"
        f" | {_s(a['p50_e2e_s'])} s | {_s(a['p95_e2e_s'])} s | {summary['replica_hours']:g} |",
        "",
        f"Goodput: {_s(summary['goodput_per_replica_hour'])} requests within their SLO per"
        " replica-hour.",
        "",
        "| workload | SLO (s) | requests | ok | SLO-violating | refused | P95 E2E |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, w in summary["by_workload"].items():
        limits = summary["slos"].get(name) or {}
        slo = ", ".join(f"{m.removesuffix('_s')} {v:g}" for m, v in limits.items()) or "-"
        out.append(
            f"| {name} | {slo} | {w['requests']} | {w['ok']} | {w['slo_violations']}"
            f" | {w['refused_429'] + w['refused_503']} | {_s(w['p95_e2e_s'])} s |"
        )
    out += [
        "",
        "| pool | profile | cap | HPA reads (AverageValue) | replicas | peak ready"
        " | replica-hours | served | of which spilled in |",
        "|---|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for name, p in summary["pools"].items():
        metrics = ", ".join(f"`{m}`" for m in p["hpa_metrics"])
        low, high = p["replicas_min_max"]
        out.append(
            f"| {name} | {p['profile']} | {p['max_concurrency']} | {metrics} ({p['target']:g})"
            f" | {low}-{high} | {p['peak_ready']} | {p['replica_hours']:g}"
            f" | {p['requests_served']} | {p['spilled_in']} |"
        )
    out += [
        "",
        "Replicas (asked for, ready = serving and in DNS, removed = out of DNS, stopped ="
        " drained; requests served as the gateway's access log says):",
        "",
        "| pool | replica | asked | ready | removed | stopped | requests served |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for m in summary["replicas"]:
        out.append(
            f"| {m['pool']} | {m['host']} | {m['asked_s']:g} | {_s(m['ready_s'])}"
            f" | {_s(m['removed_s'])} | {_s(m['stopped_s'])} | {m['requests_served']} |"
        )
    out += ["", "![autoscaling](autoscale.png)", ""]
    return "\n".join(out)


def _ready_steps(members: list[Member], end_s: float) -> tuple[list[float], list[int]]:
    """Ready replicas over time, exactly: a step at every start and removal."""
    events = []
    for m in members:
        if m.started_s is not None:
            events.append((m.started_s, 1))
            if m.removed_s is not None:
                events.append((m.removed_s, -1))
    times, counts, level = [0.0], [0], 0
    for t, delta in sorted(events):
        level += delta
        times.append(t)
        counts.append(level)
    times.append(end_s)
    counts.append(level)
    return times, counts


Series = list[tuple[float, float | None]]


def bad_over_time(
    run: AutoscaleRun, slos: Mapping[str, SLO], window_s: float
) -> list[tuple[float, int]]:
    """SLO-violating or refused requests that started in each window: (midpoint, count)."""
    k = run.config.time_scale
    counts = [0] * _windows(run, window_s)
    for r in run.records:
        if r.status in REFUSED or violates(r, slos.get(r.cls), k):
            counts[_window(run, r, window_s)] += 1
    return [((i + 0.5) * window_s, n) for i, n in enumerate(counts)]


def latency_windows(run: AutoscaleRun, summary: dict[str, Any]) -> dict[str, dict[str, Series]]:
    """Per workload, the P95 over time of each latency its SLO limits (E2E if none)."""
    out: dict[str, dict[str, Series]] = {}
    for name in summary["by_workload"]:
        metrics = list(summary["slos"].get(name) or ()) or ["e2e_s"]
        out[name] = {m: p95_over_time(run, summary["window_s"], m, name) for m in metrics}
    return out


def _nan(values: Iterable[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in values]


def plot(
    run: AutoscaleRun, p95: dict[str, dict[str, Series]], summary: dict[str, Any], path: Path
) -> None:
    """Demand per workload, then each pool's replicas and signal, then P95 latency."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on CI or servers
    import matplotlib.pyplot as plt

    c = run.config
    rows = 2 + len(c.pools)
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.6 * rows), sharex=True)
    demand, *panels, bottom = axes
    step = max(1.0, run.end_s / 400)
    ts = [i * step for i in range(int(run.end_s / step) + 1)]
    for workload in c.trace.series:
        demand.plot(ts, [c.trace.rate(t, workload) for t in ts], label=workload)
    demand.set_ylabel("demand (req / sim s)")
    demand.set_ylim(bottom=0)
    demand.set_title(
        f"signal {c.signal}, {spill_state(c)}, start-up"
        f" {c.startup_s:g} s, time scale {c.time_scale:g}"
    )
    for ax, pool in zip(panels, c.pools, strict=True):
        members = [m for m in run.members if m.pool == pool.name]
        samples = [s for s in run.samples if s.pool == pool.name]
        times, counts = _ready_steps(members, run.end_s)
        ax.step(times, counts, where="post", color="tab:green", label="ready replicas")
        if samples:
            ax.step(
                [0.0] + [s.t_s for s in samples],
                [samples[0].current] + [s.desired for s in samples],
                where="post", color="tab:blue", linestyle="--", label="HPA desired",
            )  # fmt: skip
            for metric in summary["pools"][pool.name]["hpa_metrics"]:
                ax.plot(
                    [s.t_s for s in samples], _nan(s.metrics.get(metric) for s in samples),
                    linewidth=0.8, label=metric,
                )  # fmt: skip
        ax.set_ylabel(f"{pool.name}\nreplicas")
        ax.set_ylim(0, max(pool.max_replicas, max(counts, default=0)) + 1)
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
    for name, series in p95.items():
        limits = summary["slos"].get(name) or {}
        for metric, points in series.items():
            color, label = next(colors), f"{name} P95 {metric.removesuffix('_s').upper()}"
            bottom.plot([t for t, _ in points], _nan(v for _, v in points), marker=".",
                        color=color, label=label)  # fmt: skip
            if metric in limits:
                bottom.axhline(limits[metric], color=color, linestyle=":", linewidth=1,
                               label=f"{label.replace(' P95', '')} SLO")  # fmt: skip
    bottom.set_ylabel(f"P95, {summary['window_s']:g} s windows\n(sim s, log)")
    bottom.set_yscale("log")
    bottom.set_xlabel("time since the load began (simulated seconds)")
    bottom.set_xlim(left=0)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
