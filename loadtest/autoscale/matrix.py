"""`llm-loadtest autoscale-matrix`: one autoscaling run four ways, side by side.

    llm-loadtest autoscale-matrix --out DIR [--only a,d] -- AUTOSCALE FLAGS...

The same trace, fleet and seed (every flag after `--` goes to `llm-loadtest autoscale`) with
the HPAs on (a) the reactive signal, spill-over off; (b) the forecast signal with the reactive
one as its floor (`--signal max`, as deploy/'s HPAs), spill-over off; (c) the reactive signal,
spill-over on; (d) both. Each run's report is in DIR/a ... DIR/d; DIR/matrix.md compares them:
SLO-violating or refused requests and replica-hours, each against (a).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest.autoscale import cli

VARIANTS = {
    "a": ("reactive signal, no spill-over", ("--signal", "reactive", "--no-spill")),
    "b": ("forecast signal (reactive floor), no spill-over", ("--signal", "max", "--no-spill")),
    "c": ("reactive signal, spill-over", ("--signal", "reactive")),
    "d": ("forecast signal and spill-over", ("--signal", "max")),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llm-loadtest autoscale-matrix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", type=Path, required=True, help="one directory per variant, and the compare"
    )
    p.add_argument("--only", default=",".join(VARIANTS), help="variants to run (default a,b,c,d)")
    p.add_argument("--title", default="", help="the compare's heading")
    p.add_argument(
        "autoscale", nargs=argparse.REMAINDER, help="-- then llm-loadtest autoscale's flags"
    )
    return p


def _pct(value: float, base: float) -> str:
    return "-" if not base else f"{100 * (value - base) / base:+.0f}%"


def compare(runs: dict[str, dict[str, Any]], title: str) -> str:
    """The Markdown table of the runs' summaries, each against (a) when it ran."""
    base = runs.get("a")
    out = [
        f"## {title}" if title else "## Autoscaling compare",
        "",
        "| run | requests | SLO-violating | refused | violating or refused | vs (a)"
        " | replica-hours | vs (a) | spilled | peak ready per pool |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, s in runs.items():
        a = s["all"]
        bad = a["violating_or_refused"]
        hours = s["replica_hours"]
        peaks = ", ".join(f"{pool} {p['peak_ready']}" for pool, p in s["pools"].items())
        out.append(
            f"| ({name}) {VARIANTS[name][0]} | {a['requests']} | {a['slo_violations']}"
            f" | {a['refused_429'] + a['refused_503']} | {bad}"
            f" | {_pct(bad, base['all']['violating_or_refused']) if base else '-'}"
            f" | {hours:g} | {_pct(hours, base['replica_hours']) if base else '-'}"
            f" | {s['spilled']} | {peaks} |"
        )
    if base and "d" in runs:
        d, b = runs["d"], base["all"]["violating_or_refused"]
        fewer = 1 - d["all"]["violating_or_refused"] / b if b else 0.0
        more = d["replica_hours"] / base["replica_hours"] - 1 if base["replica_hours"] else 0.0
        verdict = (
            "met" if fewer >= 0.5 and round(more, 6) <= 0.10 else "not met"
        )  # 1.1 / 1.0 - 1 > 0.1
        change = f"{100 * fewer:.0f}% fewer" if fewer >= 0 else f"{-100 * fewer:.0f}% more"
        out += [
            "",
            f"(d) against (a): {change} SLO-violating or refused requests at"
            f" {100 * more:+.0f}% replica-hours; the target (at least 50% fewer at no more than"
            f" +10%) is {verdict}.",
        ]
    return "\n".join(out) + "\n"


def plot(runs: dict[str, dict[str, Any]], title: str, path: Path) -> None:
    """Ready replicas (all pools) and bad requests per window, one line per run."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on CI or servers
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, s in runs.items():
        ready: dict[float, int] = {}
        for sample in s["timeline"]:
            ready[sample["t_s"]] = ready.get(sample["t_s"], 0) + sample["ready"]
        top.step(list(ready), list(ready.values()), where="post", label=f"({name})")
        windows = s["bad_by_window"]
        bottom.plot([t for t, _ in windows], [n for _, n in windows], marker=".",
                    label=f"({name}) {VARIANTS[name][0]}")  # fmt: skip
    top.set_ylabel("ready replicas, all pools")
    top.set_title(title or "autoscaling compare")
    bottom.set_ylabel(f"violating or refused\nper {runs[next(iter(runs))]['window_s']:g} s")
    bottom.set_xlabel("time since the load began (simulated seconds)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="x-small")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str]) -> int:
    """`argv[0]` is `autoscale-matrix`, as loadtest/cli.py passes it."""
    args = parser().parse_args(list(argv)[1:])
    passed = [a for a in args.autoscale if a != "--"]
    chosen = [v for v in args.only.split(",") if v]
    if unknown := set(chosen) - set(VARIANTS):
        raise SystemExit(f"llm-loadtest autoscale-matrix: no variant {sorted(unknown)}")
    if any(flag in passed for flag in ("--signal", "--no-spill", "--out")):
        raise SystemExit(
            "llm-loadtest autoscale-matrix: the variants set --signal, --no-spill, --out"
        )
    runs: dict[str, dict[str, Any]] = {}
    for name in chosen:
        out = args.out / name
        print(f"({name}) {VARIANTS[name][0]}", flush=True)
        cli.main(["autoscale", *passed, *VARIANTS[name][1], "--out", str(out)])
        runs[name] = orjson.loads((out / "autoscale.json").read_bytes())
    text = compare(runs, args.title)
    (args.out / "matrix.md").write_text(text + "\n![compare](matrix.png)\n")
    plot(runs, args.title, args.out / "matrix.png")
    print(text)
    return 0
