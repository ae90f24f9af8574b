"""`profile`: the article's step 1 — real ISL, OSL and concurrency distributions, from the
gateway's own access log, written as a workload file that `sweep` replays.

Each access-log line (gateway/request/account.py) ends a request at `ts` after `e2e_s`, so its interval
is [ts - e2e_s, ts]. Per route (pool) and class:
- ISL: `input_tokens` of every request the gateway classified (rejected ones too: they are demand);
- OSL: `output_tokens` of the completed ones, else the gateway's `expected_output_tokens`;
- concurrency: the number of overlapping request intervals, time-weighted over the log's span
  (P95 = the level exceeded 5% of the time). This is client-side concurrency, queue included,
  which is what a closed-loop user models: a user is someone with a request outstanding.
The workload has one class per (pool, class), weighted by its share of requests, with empirical
distributions (or lognormal fits), and suggests the overall concurrency P50/P95/P99 as levels.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from loadtest.loadgen.stats import Quantiles
from loadtest.loadgen.workloads import (
    Distribution,
    Empirical,
    Fixed,
    LogNormal,
    Workload,
    WorkloadClass,
)

Fit = Literal["empirical", "lognormal"]
MAX_VALUES = 1000  # an empirical list keeps at most this many evenly spaced order statistics


def read_access_log(path: str | Path) -> list[dict[str, Any]]:
    """The JSON lines of an access log; other lines (a stray log message) are skipped."""
    out = []
    for line in Path(path).read_bytes().splitlines():
        if line.startswith(b"{"):
            out.append(orjson.loads(line))
    return out


def weighted_percentile(weights: dict[int, float], q: float) -> int:
    """The smallest value whose cumulative weight reaches q% of the total."""
    total = sum(weights.values())
    running = 0.0
    for value in sorted(weights):
        running += weights[value]
        if running >= total * q / 100 - 1e-12:
            return value
    return max(weights)


def concurrency(intervals: Iterable[tuple[float, float]]) -> Quantiles:
    """Time-weighted quantiles of how many intervals overlap, over their whole span."""
    events = sorted(
        (t, delta) for start, end in intervals for t, delta in ((start, 1), (end, -1))
    )  # at equal times -1 sorts first: a request ending as another starts is not overlap
    if not events:
        return Quantiles(None, None, None)
    time_at: dict[int, float] = defaultdict(float)
    level, last = 0, events[0][0]
    for t, delta in events:
        time_at[level] += t - last
        level, last = level + delta, t
    if not any(time_at.values()):  # zero-length intervals: count them as instants
        return Quantiles(0, 0, 0)
    return Quantiles(*(weighted_percentile(time_at, q) for q in (50, 95, 99)))


@dataclass(frozen=True)
class Group:
    pool: str
    cls: str
    endpoint: str
    isl_values: list[int]
    osl_values: list[int]
    concurrency: Quantiles

    @property
    def requests(self) -> int:
        return len(self.isl_values)

    @property
    def isl(self) -> Quantiles:
        return Quantiles.of(self.isl_values)

    @property
    def osl(self) -> Quantiles:
        return Quantiles.of(self.osl_values)


@dataclass(frozen=True)
class Profile:
    groups: list[Group]
    concurrency: Quantiles  # every request of the log together
    span_s: float

    def to_workload(self, name: str, fit: Fit = "empirical") -> Workload:
        classes = [
            WorkloadClass(
                name=f"{g.pool}/{g.cls}",
                weight=g.requests,
                endpoint=g.endpoint if g.endpoint in ("completions", "embeddings") else "chat",
                isl=_fit(g.isl_values, fit),
                # a replay asks at least one token (vLLM's `max_tokens` floor); pooling: unused
                osl=_fit([max(1, v) for v in g.osl_values], fit),
            )
            for g in self.groups
        ]
        levels = [self.concurrency.p50, self.concurrency.p95, self.concurrency.p99]
        users = sorted({max(1, round(v)) for v in levels if v is not None})
        return Workload(name=name, classes=classes, users=users or None, source=self.summary())

    def summary(self) -> dict[str, Any]:
        def q(x: Quantiles) -> dict[str, float | None]:
            return {"p50": x.p50, "p95": x.p95, "p99": x.p99}

        return {
            "span_s": round(self.span_s, 3),
            "concurrency": q(self.concurrency),
            "groups": [
                {
                    "pool": g.pool,
                    "class": g.cls,
                    "requests": g.requests,
                    "isl": q(g.isl),
                    "osl": q(g.osl),
                    "concurrency": q(g.concurrency),
                }
                for g in self.groups
            ],
        }


def _fit(values: Sequence[int], fit: Fit) -> Distribution:
    ordered = sorted(values)
    if ordered[0] == ordered[-1]:
        return Fixed(value=ordered[0])
    if fit == "lognormal":
        logs = [math.log(v) for v in ordered]
        return LogNormal(
            median=math.exp(statistics.fmean(logs)),
            sigma=statistics.pstdev(logs),
            min=ordered[0],
            max=ordered[-1],
        )
    if len(ordered) > MAX_VALUES:
        step = (len(ordered) - 1) / (MAX_VALUES - 1)
        ordered = [ordered[round(i * step)] for i in range(MAX_VALUES)]
    return Empirical(values=ordered)


def _interval(r: dict[str, Any]) -> tuple[float, float] | None:
    if r.get("ts") is None or r.get("e2e_s") is None:
        return None
    return (r["ts"] - r["e2e_s"], r["ts"])


def build_profile(records: Sequence[dict[str, Any]]) -> Profile:
    by_group: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("pool") and r.get("class") and r.get("input_tokens"):
            by_group[(r["pool"], r["class"])].append(r)
    groups = []
    for (pool, cls), rows in sorted(by_group.items()):
        osl = [_osl(r) for r in rows]
        outputs = any(r.get("output_tokens") or r.get("expected_output_tokens") for r in rows)
        endpoint = Counter(r.get("endpoint") or "chat" for r in rows).most_common(1)[0][0]
        groups.append(
            Group(
                pool=pool,
                cls=cls,
                endpoint=endpoint,
                isl_values=[r["input_tokens"] for r in rows],
                # a pooling request produces none: 0, so a class of them keeps its place
                osl_values=[v for v in osl if v is not None] or ([0] if not outputs else []),
                concurrency=concurrency(i for r in rows if (i := _interval(r))),
            )
        )
    intervals = [i for r in records if (i := _interval(r))]
    span = max((e for _, e in intervals), default=0.0) - min((s for s, _ in intervals), default=0.0)
    return Profile([g for g in groups if g.osl_values], concurrency(intervals), span)


def _osl(r: dict[str, Any]) -> int | None:
    """What a completed request produced, 0 included (pooling work; a stop at once); else what
    the gateway expected of it."""
    if r.get("status") == 200 and r.get("output_tokens") is not None:
        return int(r["output_tokens"])
    expected = r.get("expected_output_tokens")
    return int(expected) if expected else None


def table(p: Profile) -> str:
    """The per-route, per-class summary `profile` prints."""

    def q(x: Quantiles) -> str:
        return " / ".join("-" if v is None else f"{v:g}" for v in (x.p50, x.p95, x.p99))

    lines = [
        "| pool | class | requests | ISL P50 / P95 / P99 | OSL P50 / P95 / P99"
        " | concurrency P50 / P95 / P99 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for g in p.groups:
        lines.append(
            f"| {g.pool} | {g.cls} | {g.requests} | {q(g.isl)} | {q(g.osl)} | {q(g.concurrency)} |"
        )
    lines.append(f"| all | | {sum(g.requests for g in p.groups)} | | | {q(p.concurrency)} |")
    return "\n".join(lines)
