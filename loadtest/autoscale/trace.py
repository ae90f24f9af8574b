"""Arrival-rate traces: what the autoscaling loop's load follows, in simulated seconds.

A trace is, per workload, a piecewise-linear rate (requests per simulated second) through
points `(t_s, rate_rps)`; it ends at its last point. Two points at the same time make a step.

Built-ins (`NAME:key=value,...`):
    step:base=0.5,peak=5,start=60,end=240,duration=720   base, peak from start to end, base
    ramp:from=0.2,to=2,duration=600                       linear from one rate to the other
    diurnal:min=0.2,max=2,period=600,duration=720         a day compressed into `period`:
                                                          a cosine from min (t=0) to max
    bursts:base=1,peak=3,start=60,every=120,length=30,duration=600
                                                          base, with a burst to peak for
                                                          `length` every `every` from `start`

A CSV file (`t_s,rate_rps[,workload]`, a header row optional) gives the points; rows without a
workload use the run's default workload. `WORKLOAD=SPEC` gives one workload its own built-in, so
several workloads can follow different curves in one run (`load_traces`). `from_access_log` builds one from a gateway access log.
"""

from __future__ import annotations

import bisect
import csv
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIURNAL_STEP_S = 15.0  # points of a built-in curve: one per HPA sync period is smooth enough


@dataclass(frozen=True)
class Trace:
    """Per workload name, points `(t_s, rate_rps)` sorted by time."""

    series: dict[str, tuple[tuple[float, float], ...]]

    @property
    def duration_s(self) -> float:
        return max(points[-1][0] for points in self.series.values())

    def rate(self, t_s: float, workload: str | None = None) -> float:
        """The rate at `t_s` of one workload, or of all of them."""
        names = [workload] if workload is not None else list(self.series)
        return sum(_at(self.series[n], t_s) for n in names)

    def arrivals(self, rng: random.Random, limit: int) -> dict[str, list[float]]:
        """Poisson arrival times (simulated seconds) per workload, by thinning: candidates at
        the series' peak rate, each kept with probability rate(t) / peak. More than `limit` in
        all is an error, never a silently shortened trace."""
        out: dict[str, list[float]] = {}
        for name, points in self.series.items():
            peak = max(rate for _, rate in points)
            times: list[float] = []
            if peak > 0:
                t = rng.expovariate(peak)
                while t < points[-1][0] and len(times) <= limit:
                    if rng.random() * peak < _at(points, t):
                        times.append(t)
                    t += rng.expovariate(peak)
            out[name] = times
        total = sum(len(t) for t in out.values())
        if total > limit:
            raise ValueError(f"the trace plans {total} requests, more than the limit {limit}")
        return out

    def rows(self) -> list[dict[str, Any]]:
        return [
            {"t_s": t, "rate_rps": rate, "workload": name}
            for name, points in self.series.items()
            for t, rate in points
        ]


def _at(points: tuple[tuple[float, float], ...], t_s: float) -> float:
    if t_s < points[0][0] or t_s > points[-1][0]:
        return 0.0
    times = [p[0] for p in points]
    i = bisect.bisect_right(times, t_s)
    if i >= len(points):
        return points[-1][1]
    (t0, r0), (t1, r1) = points[i - 1], points[i]
    return r0 if t1 == t0 else r0 + (r1 - r0) * (t_s - t0) / (t1 - t0)


def _params(text: str, defaults: Mapping[str, float]) -> dict[str, float]:
    out = dict(defaults)
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in defaults:
            raise ValueError(f"unknown trace parameter {key!r}: use {', '.join(defaults)}")
        out[key] = float(value)
    return out


STEP = {"base": 0.5, "peak": 5.0, "start": 60.0, "end": 240.0, "duration": 720.0}
RAMP = {"from": 0.2, "to": 2.0, "duration": 600.0}
DIURNAL = {"min": 0.2, "max": 2.0, "period": 600.0, "duration": 720.0}
BURSTS = {
    "base": 1.0, "peak": 3.0, "start": 60.0, "every": 120.0, "length": 30.0, "duration": 600.0
}  # fmt: skip


def builtin(spec: str) -> list[tuple[float, float]] | None:
    """The points of a built-in trace, or None if `spec` names none."""
    name, _, rest = spec.partition(":")
    if name == "step":
        p = _params(rest, STEP)
        if not 0 <= p["start"] <= p["end"] <= p["duration"]:
            raise ValueError("step needs 0 <= start <= end <= duration")
        return [
            (0.0, p["base"]),
            (p["start"], p["base"]),
            (p["start"], p["peak"]),
            (p["end"], p["peak"]),
            (p["end"], p["base"]),
            (p["duration"], p["base"]),
        ]
    if name == "ramp":
        p = _params(rest, RAMP)
        return [(0.0, p["from"]), (p["duration"], p["to"])]
    if name == "bursts":
        p = _params(rest, BURSTS)
        if not 0 < p["length"] <= p["every"] or p["start"] < 0:
            raise ValueError("bursts needs 0 < length <= every and start >= 0")
        points = [(0.0, p["base"])]
        t = p["start"]
        while t < p["duration"]:
            end = min(t + p["length"], p["duration"])
            points += [(t, p["base"]), (t, p["peak"]), (end, p["peak"]), (end, p["base"])]
            t += p["every"]
        return [*points, (p["duration"], p["base"])]
    if name == "diurnal":
        p = _params(rest, DIURNAL)
        steps = max(1, math.ceil(p["duration"] / DIURNAL_STEP_S))
        points = []
        for k in range(steps + 1):
            t = min(p["duration"], k * DIURNAL_STEP_S)
            phase = (1 - math.cos(2 * math.pi * t / p["period"])) / 2
            points.append((t, p["min"] + (p["max"] - p["min"]) * phase))
        return points
    return None


def load_trace(spec: str | Path, default_workload: str) -> Trace:
    """A built-in by `NAME:params`, or a CSV file."""
    points = builtin(str(spec))
    if points is not None:
        return Trace({default_workload: tuple(points)})
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {str(spec)!r} is neither a file nor step:, ramp:, diurnal:, bursts:"
        )
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with path.open(newline="") as f:
        for number, row in enumerate(csv.reader(f), 1):
            if not row or row[0].startswith("#") or (number == 1 and row[0].strip() == "t_s"):
                continue
            try:
                t, rate = float(row[0]), float(row[1])
            except (IndexError, ValueError):
                raise ValueError(f"{path}:{number}: a row reads t_s,rate_rps[,workload]") from None
            if t < 0 or rate < 0:
                raise ValueError(f"{path}:{number}: times and rates are not negative")
            name = row[2].strip() if len(row) > 2 and row[2].strip() else default_workload
            series[name].append((t, rate))
    if not series:
        raise ValueError(f"{path}: no rows")
    # A stable sort keeps a step's two rows (same time) in file order.
    return Trace({n: tuple(sorted(p, key=lambda x: x[0])) for n, p in series.items()})


def load_traces(specs: Sequence[str], default_workload: str) -> Trace:
    """Several traces as one: each `WORKLOAD=SPEC` (a built-in for that workload) or `SPEC`
    (rows for `default_workload`, or a CSV's own workloads). A workload given twice is an error."""
    series: dict[str, tuple[tuple[float, float], ...]] = {}
    for text in specs:
        head, eq, rest = text.partition("=")
        workload, spec = (head, rest) if eq and ":" not in head else (default_workload, text)
        for name, points in load_trace(spec, workload).series.items():
            if name in series:
                raise ValueError(f"workload {name!r} has two traces")
            series[name] = points
    if not series:
        raise ValueError("no trace given")
    return Trace(series)


def write_trace(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["t_s", "rate_rps", "workload"])
        for row in trace.rows():
            out.writerow([f"{row['t_s']:g}", f"{row['rate_rps']:.4g}", row["workload"]])
    return path


def from_access_log(
    lines: Iterable[Mapping[str, Any]], bin_s: float, workloads: Mapping[str, str]
) -> Trace:
    """A trace of what a gateway served: requests per `bin_s` by their `ts`, from the first one,
    as a constant rate over each bin (two points per bin). `workloads` maps the gateway's class
    names onto load-generator workloads; a class it does not name keeps its own name."""
    counts: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    stamps = [(float(line["ts"]), line.get("class") or "") for line in lines if "ts" in line]
    if not stamps:
        raise ValueError("the access log has no requests")
    first = min(t for t, _ in stamps)
    for t, cls in stamps:
        counts[workloads.get(cls, cls)][int((t - first) // bin_s)] += 1
    bins = max(b for per in counts.values() for b in per) + 1
    series = {}
    for name, per in counts.items():
        points: list[tuple[float, float]] = []
        for b in range(bins):
            rate = per.get(b, 0) / bin_s
            points += [(b * bin_s, rate), ((b + 1) * bin_s, rate)]
        series[name] = tuple(points)
    return Trace(series)
