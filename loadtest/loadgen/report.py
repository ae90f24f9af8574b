"""A sweep's results on disk: JSON (everything), CSV (levels, requests), Markdown with PNG plots.

Files written into the output directory:

    OUT/results.json   config, per-request records, per-level stats, normalised tables, jumps, knees
    OUT/levels.csv     one row per curve and level
    OUT/requests.csv   one row per request
    OUT/report.md      the tables and plots a person reads
    OUT/throughput.png, OUT/latency.png

One clock throughout: with `time_scale` K every time and rate is in simulated seconds (wall clock
x K), and the CSV columns holding them say so (`e2e_sim_s`, `rps_sim`, ...). A sweep of several
levels plots each metric against the load; a single level has no curve to draw, so its plots
show each class's requests over simulated time and its latency distribution instead.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

import orjson

from loadtest.loadgen.knee import Knee, find_knee, policy_snippet
from loadtest.loadgen.runner import RequestRecord
from loadtest.loadgen.stats import (
    Curve,
    JumpFlag,
    Normalised,
    jump_flags,
    normalise,
    percentile,
)
from loadtest.loadgen.sweep import SweepResult


@dataclass
class Analysis:
    curves: list[Curve]
    normalised: Normalised
    jumps: list[JumpFlag]
    knees: dict[str, Knee]  # by curve label; closed-loop curves of whole workloads only
    snippets: dict[str, str]


def analyse(result: SweepResult) -> Analysis:
    config = result.config
    curves = result.curves()
    jumps = [f for c in curves for f in jump_flags(c.label, c.points(), c.kind)]
    knees: dict[str, Knee] = {}
    snippets: dict[str, str] = {}
    for curve in curves:
        if curve.kind != "users" or curve.cls is not None:
            continue  # an arrival rate, or one class's share of a mix's users, is no cap
        knee = knees[curve.label] = find_knee(curve.points(), config.knee, config.target_replicas)
        replicas = (
            [curve.url]
            if config.target_replicas == 1
            else [f"http://replica-{i + 1}:8000" for i in range(config.target_replicas)]
        )
        snippets[curve.label] = policy_snippet(knee, _slug(curve.label), curve.model, replicas)
    return Analysis(curves, normalise(curves, config.baseline_level), jumps, knees, snippets)


def _slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def _n(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def single_level(result: SweepResult) -> bool:
    """One level per series: no curve, so nothing to normalise, no jump and no knee."""
    return all(len(s.levels) == 1 for s in result.series)


def clock(time_scale: float) -> str:
    return "wall-clock seconds" if time_scale == 1 else f"simulated seconds (wall x {time_scale:g})"


_RATES = ("rps", "output_tps", "tpm")
_QUANTILE = re.compile(r"^(e2e|ttft|tpot)_p\d+$")


def _clocked(row: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """Column names that carry the simulated clock when there is one."""
    if time_scale == 1:
        return row
    out = {}
    for key, value in row.items():
        if key.endswith("_s"):
            key = f"{key[:-2]}_sim_s"
        elif _QUANTILE.match(key):
            key = f"{key}_sim_s"
        elif key in _RATES:
            key = f"{key}_sim"
        out[key] = value
    return out


def request_row(record: RequestRecord, time_scale: float) -> dict[str, Any]:
    """A request's row in the report's clock (the record keeps the wall clock it measured)."""
    row = record.row()
    for key in ("start_s", "ttft_s", "tpot_s", "e2e_s"):
        if row[key] is not None:
            row[key] = round(row[key] * time_scale, 6)
    return row


def _config(result: SweepResult) -> dict[str, Any]:
    config = asdict(result.config)
    config["workloads"] = [w.model_dump(mode="json") for w in result.config.workloads]
    return config


def to_json(result: SweepResult, analysis: Analysis) -> dict[str, Any]:
    k = result.config.time_scale
    return {
        "config": _config(result),
        "clock": clock(k),
        "curves": [
            {
                "label": c.label,
                "model": c.model,
                "url": c.url,
                "workload": c.workload,
                "class": c.cls,
                "kind": c.kind,
                "levels": [{"load": load, **asdict(s)} for load, s in c.levels],
            }
            for c in analysis.curves
        ],
        "normalised": {
            "references": analysis.normalised.references,
            "throughput": analysis.normalised.throughput,
            "e2e_p95": analysis.normalised.e2e_p95,
        },
        "jumps": [asdict(f) for f in analysis.jumps],
        "knees": {
            label: {**asdict(k), "snippet": analysis.snippets[label]}
            for label, k in analysis.knees.items()
        },
        "series": [
            {
                "model": s.target.model,
                "url": s.target.url,
                "workload": s.workload.name,
                "levels": [
                    {
                        "load": result.config.reported_load(load),
                        "duration_s": run.duration_s * k,
                        "requests": [_clocked(request_row(r, k), k) for r in run.records],
                    }
                    for load, run in s.levels
                ],
            }
            for s in result.series
        ],
    }


def _write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)


def level_table(curve: Curve, time_scale: float = 1.0) -> list[str]:
    sim = time_scale != 1
    unit = "users" if curve.kind == "users" else ("arrivals/sim s" if sim else "arrivals/s")
    s_ = "sim s" if sim else "s"
    lines = [
        f"| {unit} | sent | completed | failed | unfinished | completion | req/{s_} | out tok/{s_}"
        f" | {'TPM sim' if sim else 'TPM'} | E2E P50 / P95 / P99 {s_} | TTFT P50 / P95 / P99 {s_}"
        f" | TPOT P50 / P95 / P99 {'sim ms' if sim else 'ms'} | ISL exact |",
        "|---:" * 13 + "|",
    ]

    def q3(q: Any, scale: float = 1.0, digits: int = 2) -> str:
        return " / ".join(
            _n(None if v is None else v * scale, digits) for v in (q.p50, q.p95, q.p99)
        )

    for load, s in curve.levels:
        failed = ", ".join(f"{k}: {v}" for k, v in sorted(s.failed.items())) or "0"
        exact = f"{s.isl_exact}/{s.completed}"
        lines.append(
            f"| {load:g} | {s.sent} | {s.completed} | {failed} | {s.unfinished}"
            f" | {s.completion_rate:.1%} | {s.rps:.2f} | {s.output_tps:.0f} | {s.tpm:,.0f}"
            f" | {q3(s.e2e)} | {q3(s.ttft)} | {q3(s.tpot, 1000, 1)} | {exact} |"
        )
    return lines


def normalised_table(n: Normalised, values: dict[str, dict[float, float | None]]) -> list[str]:
    lines = ["| load | " + " | ".join(n.labels) + " |", "|---" + "|---:" * len(n.labels) + "|"]
    for load in n.loads:
        cells = [_n(values[label].get(load)) for label in n.labels]
        lines.append(f"| {load:g} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {label}: relative to {ref}" for label, ref in n.references.items()]
    return lines


def markdown(result: SweepResult, analysis: Analysis) -> str:
    config = result.config
    k = config.time_scale
    if config.rates:
        assert config.duration_s is not None
        rates = ", ".join(f"{config.reported_load(r):g}" for r in config.rates)
        loop = f"open loop, Poisson arrivals at {rates}/s for {config.duration_s * k:g}s"
    else:
        loop = "closed loop (each user sends its next request when the last one ends)"
    out = [
        "# Load test report",
        "",
        f"- clock: {clock(k)}, for every time and rate below, in the CSV files and in the plots",
        f"- targets: {', '.join(f'{t.model} at {t.url}' for t in config.targets)}",
        f"- workloads: {', '.join(w.name for w in config.workloads)}; {loop}",
        f"- streaming: {'yes' if config.stream else 'no (no TTFT / TPOT)'};"
        f" bounded by {config.max_seconds_per_level * k:g}s per level",
        "",
        "## Per level",
        "",
    ]
    for curve in analysis.curves:
        out += [f"### {curve.label}", "", *level_table(curve, k), ""]
    if single_level(result):
        out += ["## Plots", "", "Each class's requests over time (completions, refusals) and its"]
        out += ["latency over time and distribution, from a single level.", ""]
        out += ["![throughput](throughput.png)", "", "![latency](latency.png)", ""]
        return "\n".join(out)
    out += ["## Normalised throughput (requests/s relative to the reference)", ""]
    out += [*normalised_table(analysis.normalised, analysis.normalised.throughput), ""]
    out += ["## Normalised P95 end-to-end latency", ""]
    out += [*normalised_table(analysis.normalised, analysis.normalised.e2e_p95), ""]
    out += ["## Throughput jumps to check before trusting them", ""]
    out += [
        f"- **{f.label}**, {f.load_from:g} -> {f.load_to:g}: " + "; ".join(f.reasons)
        for f in analysis.jumps
    ] or ["None: every rise is backed by completed requests, output tokens and completion rate."]
    out += ["", "## Knee and recommended per-replica cap", ""]
    for label, snippet in analysis.snippets.items():
        out += [f"### {label}", "", "```yaml", snippet.rstrip(), "```", ""]
    if not analysis.snippets:
        out += [
            "Open-loop sweeps have no concurrency levels: run a closed-loop sweep for a cap.",
            "",
        ]
    out += ["## Plots", "", "![throughput](throughput.png)", "", "![latency](latency.png)", ""]
    return "\n".join(out)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on CI or servers
    import matplotlib.pyplot as plt

    return plt


def plot(curves: Sequence[Curve], out: Path, time_scale: float = 1.0) -> list[Path]:
    """A sweep's curves: each metric against the load, one line per curve."""
    plt = _pyplot()
    sim = time_scale != 1
    s_ = "simulated s" if sim else "s"

    def axis(
        ax: Any, ylabel: str, title: str, curve_values: list[tuple[Curve, list[float | None]]]
    ) -> None:
        for curve, values in curve_values:
            xs = [load for load, _ in curve.levels]
            ax.plot(
                xs,
                [float("nan") if v is None else v for v in values],
                marker="o",
                label=curve.label,
            )
        loads = sorted({load for c in curves for load, _ in c.levels})
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [f"{x:g}" for x in loads])
        ax.set_xlabel("users" if curves[0].kind == "users" else f"arrivals per {s_}")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")

    def series(get: Any) -> list[tuple[Curve, list[float | None]]]:
        return [(c, [get(s) for _, s in c.levels]) for c in curves]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    axis(ax, f"completed requests per {s_}", "Throughput by load", series(lambda s: s.rps))
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)

    fig, (e2e, tpot) = plt.subplots(1, 2, figsize=(12, 4.5))
    axis(e2e, f"P95 end-to-end latency ({s_})", "P95 E2E by load", series(lambda s: s.e2e.p95))
    axis(
        tpot,
        f"P95 time per output token ({'simulated ms' if sim else 'ms'})",
        "P95 TPOT by load",
        series(lambda s: None if s.tpot.p95 is None else s.tpot.p95 * 1000),
    )
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)
    return [out / "throughput.png", out / "latency.png"]


@dataclass(frozen=True)
class Mark:
    """A latency a class is held to, drawn on its plots: an SLO, or the queue's longest wait."""

    label: str
    seconds: float  # in the report's clock


def plot_level(
    result: SweepResult, out: Path, marks: Mapping[str, Mark] | None = None
) -> list[Path]:
    """A single level, per class: what arrived, completed and was refused over time, and each
    request's latency over time and as a distribution. `marks` is keyed by class name."""
    plt = _pyplot()
    k = result.config.time_scale
    s_ = "simulated s" if k != 1 else "s"
    marks = marks or {}
    panels: list[tuple[str, str, list[RequestRecord]]] = []
    for s in result.series:
        records = s.levels[0][1].records
        names = [c.name for c in s.workload.classes]
        prefix = f"{s.target.model} " if len(result.series) > 1 else ""
        for name in names:
            title = prefix + (name if len(names) > 1 else s.workload.name)
            panels.append((name, title, [r for r in records if r.cls == name]))

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, (_, title, recs) in zip(axes[0], panels, strict=True):
        arrived = sorted(r.start_s * k for r in recs)
        done = sorted((r.start_s + (r.e2e_s or 0)) * k for r in recs if r.ok)
        refused = sorted((r.start_s + (r.e2e_s or 0)) * k for r in recs if r.status == 429)
        others = sorted(
            (r.start_s + (r.e2e_s or 0)) * k for r in recs if not r.ok and r.status != 429
        )
        for times, label, style in (
            (arrived, "arrived", {"color": "tab:gray"}),
            (done, "completed", {"color": "tab:blue"}),
            (refused, "refused (429)", {"color": "tab:red"}),
            (others, "failed or unfinished", {"color": "black"}),
        ):
            if times:
                ax.step([0, *times], range(len(times) + 1), where="post", label=label, **style)
        ax.set_title(f"{title}: {len(done)} of {len(recs)} completed, {len(refused)} refused (429)")
        ax.set_xlabel(f"time ({s_} since the start)")
        ax.set_ylabel("requests so far")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(panels), 2, figsize=(13, 4.2 * len(panels)), squeeze=False)
    for (over_time, spread), (name, title, recs) in zip(axes, panels, strict=True):
        ok = [r for r in recs if r.ok]
        refused = [r for r in recs if r.status == 429]
        mark = marks.get(name)
        top = 0.0
        for get, label, color in (
            (attrgetter("e2e_s"), "E2E", "tab:blue"),
            (attrgetter("ttft_s"), "TTFT", "tab:orange"),
        ):
            points = [(r.start_s * k, v * k) for r in ok if (v := get(r)) is not None]
            if not points:
                continue
            values = sorted(v for _, v in points)
            top = max(top, values[-1])
            p50, p95 = percentile(values, 50), percentile(values, 95)
            legend = f"{label} (P50 {p50:.2f}, P95 {p95:.2f} {s_})"
            over_time.scatter(*zip(*points, strict=True), s=10, color=color, label=legend)
            shares = [(i + 1) / len(values) for i in range(len(values))]
            spread.step([0, *values], [0, *shares], where="post", color=color, label=legend)
        if refused:
            took = [(r.e2e_s or 0) * k for r in refused]
            top = max(top, *took)
            over_time.scatter(
                [r.start_s * k for r in refused],
                took,
                marker="x",
                color="tab:red",
                label=f"refused (429), {len(refused)}: time to the refusal",
            )
        # Far above the data the mark would squash every point to the floor: name it instead.
        if mark and mark.seconds <= 1.5 * max(top, 1e-9):
            over_time.axhline(mark.seconds, color="tab:red", ls="--", label=mark.label)
            spread.axvline(mark.seconds, color="tab:red", ls="--", label=mark.label)
            top = max(top, mark.seconds)
        elif mark:
            for ax in (over_time, spread):
                ax.text(0.99, 0.02, f"{mark.label}: off the scale", ha="right",
                        transform=ax.transAxes, fontsize="small", color="tab:red")  # fmt: skip
        over_time.set_title(f"{title}: latency of each request by arrival time")
        over_time.set_xlabel(f"arrival time ({s_} since the start)")
        over_time.set_ylabel(f"latency ({s_})")
        spread.set_title(f"{title}: latency distribution of completed requests")
        spread.set_xlabel(f"latency ({s_})")
        spread.set_ylabel("share of completed requests at or below")
        spread.set_ylim(0, 1.02)
        # Headroom above the highest point keeps the legend off the data.
        over_time.set_ylim(0, 1.45 * max(top, 1e-3))
        for ax in (over_time, spread):
            ax.set_xlim(left=0)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small", loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)
    return [out / "throughput.png", out / "latency.png"]


def write_report(
    result: SweepResult, out: str | Path, marks: Mapping[str, Mark] | None = None
) -> list[Path]:
    """Write every output file into `out` (created if needed); returns their paths. `marks`
    (by class name) are latencies drawn on a single level's plots."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    analysis = analyse(result)
    k = result.config.time_scale
    paths = [out / "results.json", out / "levels.csv", out / "requests.csv", out / "report.md"]
    paths[0].write_bytes(
        orjson.dumps(
            to_json(result, analysis), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
        )
    )
    load_column = "users" if result.config.kind == "users" else "arrivals_per_s"
    _write_csv(
        paths[1],
        [
            _clocked(
                {
                    "curve": c.label,
                    "model": c.model,
                    "workload": c.workload,
                    "class": c.cls or "",
                    load_column: load,
                    **s.flat(),
                },
                k,
            )
            for c in analysis.curves
            for load, s in c.levels
        ],
    )
    _write_csv(
        paths[2],
        [
            _clocked(
                {
                    "model": s.target.model,
                    "workload": s.workload.name,
                    load_column: result.config.reported_load(load),
                    **request_row(r, k),
                },
                k,
            )
            for s in result.series
            for load, run in s.levels
            for r in run.records
        ],
    )
    paths[3].write_text(markdown(result, analysis))
    if single_level(result):
        return paths + plot_level(result, out, marks)
    return paths + plot(analysis.curves, out, k)


def summary_text(result: SweepResult) -> str:
    """What the command prints when it ends: the normalised table, jumps and policy snippets
    (none of which a single level has)."""
    if single_level(result):
        return f"One level: see report.md ({clock(result.config.time_scale)})."
    analysis = analyse(result)
    n = analysis.normalised
    lines = ["Normalised throughput:", *normalised_table(n, n.throughput), ""]
    lines += [
        f"JUMP {f.label} {f.load_from:g}->{f.load_to:g}: " + "; ".join(f.reasons)
        for f in analysis.jumps
    ]
    lines += [snippet for snippet in analysis.snippets.values()]
    return "\n".join(lines)
