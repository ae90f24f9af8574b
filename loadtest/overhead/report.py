"""The Markdown report of a run: its tables, and each ratio against the project's target.

The ratios between targets measured in the same minute are the result; the raw figures only give
them a scale. With several rounds a verdict is the median of the rounds' ratios, each of one
back-to-back pair. A run disturbed by other work on the machine, or with errors, says so.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path

from loadtest.overhead.bodies import STREAM_TOKENS
from loadtest.overhead.counting import (
    ALONE_TEXTS,
    COUNTING_CONNECTIONS,
    ONE_THREAD,
    AloneCost,
    Libraries,
)
from loadtest.overhead.fleet import ROOT, TARGETS
from loadtest.overhead.paired import Paired, added_ratio
from loadtest.overhead.ttfb import TTFB_CONNECTIONS, TtfbResult
from loadtest.overhead.wrk import Run

# The project's targets (docs/benchmarks.md): gateway vs the pass-through, run side by side.
TARGET_RPS_SHORT = 0.6
TARGET_RPS_CLASSIFY = 0.4
TARGET_ADDED_P50 = 2.0
# Issue 15's, for the short path: CPU and req/s at 64 connections, added p50 at one.
TARGET_CPU_SHORT_15, TARGET_RPS_SHORT_15, TARGET_ADDED_P50_15 = 1.5, 0.7, 1.3
OTHER_CPU_WARN = 0.15  # cores used by anything else during a run before the report says so
TARGET_OVER_ALONE = 1.3  # gateway CPU / (the counting backend alone + the pass-through's)
TARGET_THREADS = 1.6  # (f) req/s with 2 tokenizer threads on 2 cores over 1 thread's
CLASSIFY_RPS_PER_REPLICA = 8.6  # one simulated TPU v6e 2x2 replica of Gemma 3 27B (capacity.md)


def machine() -> str:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {model}"


def git_revision() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
            check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "gateway"], cwd=ROOT, capture_output=True,
            text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        return rev + (" (gateway/ modified)" if dirty else "")
    return "unknown"


def _ratio(value: float | None, target: float, at_least: bool) -> tuple[str, str]:
    if value is None:
        return "n/a", "n/a (the pass-through added no measurable latency)"
    ok = value >= target if at_least else value <= target
    return f"{value:.3f}", "met" if ok else "**MISSED**"  # 3 digits: 0.396 must not read as 0.40


def report(
    runs: list[Run],
    paired: list[Paired],
    ttfb: list[TtfbResult],
    header: list[str],
    duration: int,
    rounds: int,
) -> tuple[str, bool]:
    """The Markdown report and whether every run was free of errors."""
    by = {(r.request, r.connections, r.target, r.round): r for r in runs}
    lines = [*header, ""]
    lines += [
        f"Throughput and latency: wrk -t1 -cN -d{duration}s, targets measured back to back per"
        f" row group, in {rounds} round(s). CPU ms/req: user+system CPU of the target's own"
        " process (the stub for direct, the proxy otherwise) per request served. Other CPU:"
        " cores busy with anything but this benchmark during the run (other work on the"
        " machine, and kernel time no process is charged for).",
        "",
        "| request | conns | round | target | req/s | p50 ms | p99 ms | CPU ms/req | req/s vs pass-through | other CPU | errors |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        base = by.get((r.request, r.connections, "pass-through", r.round))
        vs = f"{r.rps / base.rps:.2f}x" if base and base.rps else "-"
        cpu_ms = f"{r.cpu_ms_per_request:.3f}" if r.cpu_ms_per_request is not None else "-"
        lines.append(
            f"| {r.request} | {r.connections} | {r.round + 1 if r.request in 'ab' else '-'} |"
            f" {r.target} | {r.rps:,.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {cpu_ms} | {vs} |"
            f" {r.other_cores:.2f} | {r.errors} |"
        )
    lines += [
        "",
        f"(c) stream, {STREAM_TOKENS} chunks, {TTFB_CONNECTIONS} connections, {duration}s:"
        " time from sending the request to the first chunk of the body (asyncio raw-socket client).",
        "",
        "| target | TTFB p50 ms | TTFB p99 ms | added p50 vs direct | full stream p50 ms | req/s | CPU ms/req | other CPU | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    direct = next((t for t in ttfb if t.target == "direct"), None)
    for t in ttfb:
        extra = f"{t.p50_ms - direct.p50_ms:+.2f} ms" if direct else "-"
        cpu_ms = f"{t.cpu_ms_per_request:.3f}" if t.cpu_ms_per_request is not None else "-"
        lines.append(
            f"| {t.target} | {t.p50_ms:.2f} | {t.p99_ms:.2f} | {extra} | {t.total_p50_ms:.2f} |"
            f" {t.rps:,.0f} | {cpu_ms} | {t.other_cores:.2f} | {t.errors} |"
        )

    lines += [
        "",
        "(a) at one connection again, the three targets side by side (`loadtest.paired_latency`:"
        f" {paired[0].shape if paired else '-'}), once a round: wrk's one-connection runs above come one after another"
        " while the machine's speed drifts.",
        "",
        "| round | direct p50 ms | pass-through p50 ms | gateway p50 ms | requests each | added p50 ratio | other CPU | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, p in enumerate(paired):
        ms = [f"{p.p50_ms[t]:.3f}" if p.p50_ms[t] is not None else "-" for t in TARGETS]
        ratio = p.added()
        lines.append(
            f"| {n + 1} | {' | '.join(ms)} | {p.requests:,} |"
            f" {f'{ratio:.3f}' if ratio is not None else '-'} | {p.other_cores:.2f} | {p.errors} |"
        )

    def rps_ratio(request: str, n: int) -> float | None:
        gw, pt = by.get((request, 64, "gateway", n)), by.get((request, 64, "pass-through", n))
        return gw.rps / pt.rps if gw and pt and pt.rps else None

    def added(n: int) -> float | None:
        runs = (by.get(("a", 1, t, n)) for t in TARGETS)
        return added_ratio(*(r.p50_ms if r else None for r in runs))

    def paired_added(n: int) -> float | None:
        return paired[n].added() if n < len(paired) else None

    def cpu(n: int) -> float | None:
        gw, pt = by.get(("a", 64, "gateway", n)), by.get(("a", 64, "pass-through", n))
        if gw and pt and gw.cpu_ms_per_request and pt.cpu_ms_per_request:
            return gw.cpu_ms_per_request / pt.cpu_ms_per_request
        return None

    def median(ratio: Callable[[int], float | None]) -> tuple[float | None, str]:
        """The median of the rounds' ratios, each of one round's back-to-back pair, and their
        range: a single 5 s pair on a shared machine moves by a third."""
        values = sorted(v for v in map(ratio, range(rounds)) if v is not None)
        if not values:
            return None, ""
        spread = f" ({values[0]:.3f}-{values[-1]:.3f})" if len(values) > 1 else ""
        return statistics.median(values), spread

    rows = [
        ("(a) short: gateway / pass-through req/s at 64 conns", median(partial(rps_ratio, "a")), TARGET_RPS_SHORT, True),
        ("(b) classify: gateway / pass-through req/s at 64 conns", median(partial(rps_ratio, "b")), TARGET_RPS_CLASSIFY, True),
        ("(a) short, 1 conn: (gateway p50 - direct p50) / (pass-through p50 - direct p50)", median(added), TARGET_ADDED_P50, False),
        ("issue 15: (a) short, gateway / pass-through CPU per request at 64 conns", median(cpu), TARGET_CPU_SHORT_15, False),
        ("issue 15: (a) short, gateway / pass-through req/s at 64 conns", median(partial(rps_ratio, "a")), TARGET_RPS_SHORT_15, True),
        ("issue 15: (a) short, 1 conn, side by side: added p50 over the pass-through's", median(paired_added), TARGET_ADDED_P50_15, False),
    ]  # fmt: skip
    kind = f"median of {rounds} rounds (range)" if rounds > 1 else "value"
    lines += ["", f"| ratio | {kind} | target | result |", "|---|---:|---:|---|"]
    for label, (value, spread), target, at_least in rows:
        shown, verdict = _ratio(value, target, at_least)
        sign = ">=" if at_least else "<="
        lines.append(f"| {label} | {shown}{spread} | {sign} {target} | {verdict} |")
    every: list[Run | Paired | TtfbResult] = [*runs, *paired, *ttfb]
    clean = all(r.errors == 0 for r in every)
    disturbed = max((r.other_cores for r in every), default=0.0)
    if disturbed > OTHER_CPU_WARN:
        lines += [
            "",
            f"**Other work used up to {disturbed:.2f} cores during a run: this run was disturbed;"
            " rerun on a quiet machine before trusting its ratios.**",
        ]
    if not clean:
        lines += [
            "",
            "**Some runs had errors (see the errors column): their numbers are suspect.**",
        ]
    return "\n".join(lines) + "\n", clean


def counting_report(
    runs: list[Run],
    own: dict[tuple[str, str], AloneCost],
    libraries: list[Libraries],
    threads_label: str,
    notes: list[str],
) -> list[str]:
    """(d)/(e): the gateway's CPU per request against each library alone plus the pass-through's,
    the verdicts, and (f)."""
    by = {(r.request, r.target): r for r in runs if r.connections == COUNTING_CONNECTIONS}
    lines = [
        "",
        f"Counting on the real tokenizers, {COUNTING_CONNECTIONS} connections, every prompt new:"
        " CPU per request in ms. Gateway: all its threads (of it, the main thread's: the event"
        " loop, serving HTTP and rendering, everything but encoding these long texts, which runs"
        " on the tokenizer threads). Alone: the library's mean thread-CPU per text on"
        f" {ALONE_TEXTS} of the texts the gateway's run sends, rendered by the model's chat"
        f" template, on {threads_label} at once as the gateway counts them, in this process just"
        " before the gateway's run. Pass-through: the same bodies through it. Replicas per core:"
        f" 1,000 / (gateway CPU ms) / {CLASSIFY_RPS_PER_REPLICA} classification req/s of a"
        " simulated 27B replica.",
        "",
        "| request | counted by | tokens per prompt | characters | gateway | of which the event"
        " loop | counting backend alone | tokenizers alone | pass-through | gateway req/s |"
        " other CPU | 27B replicas per gateway core |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = ["", "| ratio | value | target | result |", "|---|---:|---:|---|"]
    for lib in libraries:
        counted, backend = lib.counted, lib.backend
        row = counted.row
        gw, pt = by.get((row, "gateway")), by.get((row, "pass-through"))
        mine, theirs = own.get((row, backend)), own.get((row, "tokenizers"))
        if gw is None or pt is None or mine is None or theirs is None:
            continue
        cpu, loop, base = (
            gw.cpu_ms_per_request or 0,
            gw.loop_ms_per_request or 0,
            pt.cpu_ms_per_request or 0,
        )
        replicas = 1000 / cpu / CLASSIFY_RPS_PER_REPLICA if cpu else None
        lines.append(
            f"| ({row}) {counted.label} | {backend} | {mine.tokens:,.0f} | {mine.chars:,.0f} |"
            f" {cpu:.3f} | {loop:.3f} | {mine.ms:.3f} | {theirs.ms:.3f} | {base:.3f} |"
            f" {gw.rps:,.0f} | {max(gw.other_cores, pt.other_cores):.2f} |"
            f" {'-' if replicas is None else f'{replicas:.0f}'} |"
        )
        name = f"({row}) {counted.label}"
        over, verdict = _ratio(cpu / (mine.ms + base), TARGET_OVER_ALONE, False)
        verdicts.append(
            f"| {name}: gateway / ({backend} alone + pass-through) | {over} |"
            f" <= {TARGET_OVER_ALONE} | {verdict} |"
        )
        shown, verdict = _ratio(replicas, counted.min_replicas, True)
        bound = 1000 / counted.min_replicas / CLASSIFY_RPS_PER_REPLICA
        verdicts.append(
            f"| {name}: 27B classification replicas per gateway core | {shown} |"
            f" >= {counted.min_replicas} (<= {bound:.3f} ms) | {verdict} |"
        )
        if backend != "tokenizers":
            verdicts.append(
                f"| {name}: gateway / (tokenizers alone + pass-through) |"
                f" {cpu / (theirs.ms + base):.3f} | - | - |"
            )
    lines += verdicts
    threads_rows, threads_verdicts = [], []
    for lib in libraries:
        row = lib.counted.row
        many, one = by.get((row, "gateway")), by.get((row, ONE_THREAD))
        if not (many and one and one.rps):
            continue
        threads_rows += [
            f"| ({row}) {lib.counted.label} | {label} | {r.rps:,.0f} | {r.cpu_ms_per_request or 0:.3f} |"
            f" {r.rps * (r.cpu_ms_per_request or 0) / 1000:.2f} | {r.other_cores:.2f} |"
            for label, r in ((threads_label, many), ("1", one))
        ]
        shown, verdict = _ratio(many.rps / one.rps, TARGET_THREADS, True)
        threads_verdicts.append(
            f"| (f) ({row}) req/s with {threads_label} / with 1 | {shown} | >= {TARGET_THREADS} |"
            f" {verdict} |"
        )
    if threads_rows:
        lines += [
            "",
            f"(f) Tokenizer threads: (d) and (e) at {COUNTING_CONNECTIONS} connections on the"
            f" gateway with {threads_label} against the same gateway with one.",
            "",
            "| request | threads | req/s | gateway CPU ms/req | cores the gateway used | other CPU |",
            "|---|---|---:|---:|---:|---:|",
            *threads_rows,
            "",
            "| ratio | value | target | result |",
            "|---|---:|---:|---|",
            *threads_verdicts,
        ]
    if notes:
        lines += ["", *(f"**{note}**" for note in notes)]
    return lines
