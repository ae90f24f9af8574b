"""A sweep's results on disk: JSON (everything), CSV (levels, requests), Markdown with PNG plots.

Files written into the output directory:

    OUT/results.json   config, per-request records, per-level stats, normalised tables, jumps, knees
    OUT/levels.csv     one row per curve and level
    OUT/requests.csv   one row per request
    OUT/report.md      the tables and plots a person reads
    OUT/throughput.png, OUT/latency.png
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from loadtest.loadgen.knee import Knee, find_knee, policy_snippet
from loadtest.loadgen.stats import Curve, JumpFlag, Normalised, jump_flags, normalise
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


def _config(result: SweepResult) -> dict[str, Any]:
    config = asdict(result.config)
    config["workloads"] = [w.model_dump(mode="json") for w in result.config.workloads]
    return config


def to_json(result: SweepResult, analysis: Analysis) -> dict[str, Any]:
    return {
        "config": _config(result),
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
                        "load": load,
                        "duration_s": run.duration_s,
                        "requests": [r.row() for r in run.records],
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


def level_table(curve: Curve) -> list[str]:
    unit = "users" if curve.kind == "users" else "req/s in"
    lines = [
        f"| {unit} | sent | completed | failed | unfinished | completion | req/s | out tok/s | TPM"
        " | E2E P50 / P95 / P99 s | TTFT P50 / P95 / P99 s | TPOT P50 / P95 / P99 ms | ISL exact |",
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
    loop = (
        f"open loop, Poisson arrivals at {', '.join(f'{r:g}' for r in config.rates)}/s"
        f" for {config.duration_s:g}s"
        if config.rates
        else "closed loop (each user sends its next request when the last one ends)"
    )
    out = [
        "# Load test report",
        "",
        f"- targets: {', '.join(f'{t.model} at {t.url}' for t in config.targets)}",
        f"- workloads: {', '.join(w.name for w in config.workloads)}; {loop}",
        f"- streaming: {'yes' if config.stream else 'no (no TTFT / TPOT)'};"
        f" bounded by {config.max_seconds_per_level:g}s per level",
    ]
    if config.time_scale != 1:
        out.append(
            f"- time scale {config.time_scale:g}: times and rates are in simulated time"
            " (wall clock x the factor)"
        )
    out += ["", "## Per level", ""]
    for curve in analysis.curves:
        out += [f"### {curve.label}", "", *level_table(curve), ""]
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


def plot(curves: Sequence[Curve], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on CI or servers
    import matplotlib.pyplot as plt

    def axis(ax: Any, ylabel: str, curve_values: list[tuple[Curve, list[float | None]]]) -> None:
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
        ax.set_xlabel("users" if curves[0].kind == "users" else "arrivals / s")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")

    def series(get: Any) -> list[tuple[Curve, list[float | None]]]:
        return [(c, [get(s) for _, s in c.levels]) for c in curves]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    axis(ax, "completed requests / s", series(lambda s: s.rps))
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)

    fig, (e2e, tpot) = plt.subplots(1, 2, figsize=(12, 4.5))
    axis(e2e, "P95 end-to-end latency (s)", series(lambda s: s.e2e.p95))
    axis(
        tpot,
        "P95 time per output token (ms)",
        series(lambda s: None if s.tpot.p95 is None else s.tpot.p95 * 1000),
    )
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)
    return [out / "throughput.png", out / "latency.png"]


def write_report(result: SweepResult, out: str | Path) -> list[Path]:
    """Write every output file into `out` (created if needed); returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    analysis = analyse(result)
    paths = [out / "results.json", out / "levels.csv", out / "requests.csv", out / "report.md"]
    paths[0].write_bytes(
        orjson.dumps(
            to_json(result, analysis), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
        )
    )
    _write_csv(
        paths[1],
        [
            {
                "curve": c.label,
                "model": c.model,
                "workload": c.workload,
                "class": c.cls or "",
                "load": load,
                **s.flat(),
            }
            for c in analysis.curves
            for load, s in c.levels
        ],
    )
    _write_csv(
        paths[2],
        [
            {"model": s.target.model, "workload": s.workload.name, "load": load, **r.row()}
            for s in result.series
            for load, run in s.levels
            for r in run.records
        ],
    )
    paths[3].write_text(markdown(result, analysis))
    return paths + plot(analysis.curves, out)


def summary_text(result: SweepResult) -> str:
    """What the command prints when it ends: the normalised table, jumps and policy snippets."""
    analysis = analyse(result)
    n = analysis.normalised
    lines = ["Normalised throughput:", *normalised_table(n, n.throughput), ""]
    lines += [
        f"JUMP {f.label} {f.load_from:g}->{f.load_to:g}: " + "; ".join(f.reasons)
        for f in analysis.jumps
    ]
    lines += [snippet for snippet in analysis.snippets.values()]
    return "\n".join(lines)
