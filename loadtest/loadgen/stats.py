"""Per-level statistics, the article's normalised table, and the check on throughput jumps.

Definitions (docs/loadgen.md explains them at more length):
- `sent` counts requests the server answered or failed; `unfinished` ones (cut by the level's
  deadline) are neither and are reported apart. `completion_rate = completed / sent`.
- Rates divide by the level's duration: first request sent to last request ended, or the
  deadline when the level was cut. TPM counts input + output tokens of completed requests.
- Latency percentiles are over completed requests, interpolated linearly between closest ranks
  (numpy's default), never a mean.
- With `time_scale` K (a simulator running K times faster than real time) every duration is
  multiplied and every rate divided by K, so numbers read in simulated time.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from loadtest.loadgen.runner import RequestRecord

LoadKind = Literal["users", "rate"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks; `None` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Quantiles:
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Quantiles:
        known = sorted(v for v in values if v is not None)
        return cls(percentile(known, 50), percentile(known, 95), percentile(known, 99))


@dataclass(frozen=True)
class LevelStats:
    sent: int
    completed: int
    failed: dict[str, int]  # by HTTP status or transport error kind
    unfinished: int
    completion_rate: float
    duration_s: float
    rps: float  # completed requests per second
    output_tps: float
    tpm: float  # input + output tokens per minute
    input_tokens: int
    output_tokens: int
    isl_exact: int  # completed requests whose server-counted input equals the planned ISL
    mean_inflight: float  # Little's law: the concurrency the level actually held
    e2e: Quantiles
    ttft: Quantiles
    tpot: Quantiles

    def flat(self) -> dict[str, Any]:
        """One flat mapping (CSV columns)."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if key == "failed":
                out[key] = ";".join(f"{k}:{v}" for k, v in sorted(value.items()))
            elif isinstance(value, dict):
                out |= {f"{key}_{q}": v for q, v in value.items()}
            else:
                out[key] = value
        return out


def summarize(
    records: Sequence[RequestRecord], duration_s: float, time_scale: float = 1.0
) -> LevelStats:
    done = [r for r in records if r.ok]
    failed = Counter(r.outcome for r in records if not r.ok and not r.unfinished)
    unfinished = sum(r.unfinished for r in records)
    sent = len(done) + sum(failed.values())
    duration = duration_s * time_scale
    per_s = 1 / duration if duration > 0 else 0.0
    input_tokens = sum(r.input_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens or 0 for r in done)

    def scaled(values: Iterable[float | None]) -> Quantiles:
        return Quantiles.of(None if v is None else v * time_scale for v in values)

    return LevelStats(
        sent=sent,
        completed=len(done),
        failed=dict(failed),
        unfinished=unfinished,
        completion_rate=len(done) / sent if sent else 0.0,
        duration_s=duration,
        rps=len(done) * per_s,
        output_tps=output_tokens * per_s,
        tpm=(input_tokens + output_tokens) * per_s * 60,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        isl_exact=sum(r.input_tokens == r.isl for r in done),
        mean_inflight=sum(r.e2e_s or 0.0 for r in records) / duration_s if duration_s else 0.0,
        e2e=scaled(r.e2e_s for r in done),
        ttft=scaled(r.ttft_s for r in done),
        tpot=scaled(r.tpot_s for r in done),
    )


@dataclass(frozen=True, slots=True)
class Point:
    """What the knee finder and the jump check read of one level."""

    load: float  # users (closed loop) or arrivals per second (open loop)
    rps: float
    output_tps: float
    completed: int
    completion_rate: float
    e2e_p95: float | None
    tpot_p95: float | None

    @classmethod
    def of(cls, load: float, s: LevelStats) -> Point:
        return cls(load, s.rps, s.output_tps, s.completed, s.completion_rate, s.e2e.p95, s.tpot.p95)


@dataclass
class Curve:
    """One line of the report: a model, a workload, and optionally one class of its mix."""

    model: str
    url: str
    workload: str
    cls: str | None  # None: every class of the workload together
    kind: LoadKind
    levels: list[tuple[float, LevelStats]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.model} {self.workload}" + (f"/{self.cls}" if self.cls else "")

    @property
    def key(self) -> tuple[str, str | None]:
        """What is comparable across models: the same workload (and class)."""
        return (self.workload, self.cls)

    def points(self) -> list[Point]:
        return [Point.of(load, stats) for load, stats in self.levels]


@dataclass(frozen=True)
class Normalised:
    """The article's table: each curve's value over its reference's value at the baseline load.

    The reference of a curve is the first curve (in sweep order) of the same workload and class,
    so with targets listed 12B first, 27B generation reads relative to 12B generation at 16 users,
    as in the article.
    """

    loads: list[float]
    labels: list[str]
    references: dict[str, str]  # label -> "model workload @ load" it is relative to
    throughput: dict[str, dict[float, float | None]]
    e2e_p95: dict[str, dict[float, float | None]]


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def normalise(curves: Sequence[Curve], baseline: float) -> Normalised:
    """Normalise each curve to its reference's level `baseline` (its lowest, if not swept)."""
    references: dict[tuple[str, str | None], Curve] = {}
    for curve in curves:
        references.setdefault(curve.key, curve)
    loads = sorted({load for c in curves for load, _ in c.levels})
    throughput: dict[str, dict[float, float | None]] = {}
    e2e: dict[str, dict[float, float | None]] = {}
    named: dict[str, str] = {}
    for curve in curves:
        ref = dict(references[curve.key].levels)
        base_load = baseline if baseline in ref else min(ref)
        base = ref[base_load]
        named[curve.label] = f"{references[curve.key].label} @ {base_load:g}"
        throughput[curve.label] = {load: ratio(s.rps, base.rps) for load, s in curve.levels}
        e2e[curve.label] = {load: ratio(s.e2e.p95, base.e2e.p95) for load, s in curve.levels}
    return Normalised(loads, [c.label for c in curves], named, throughput, e2e)


@dataclass(frozen=True)
class JumpFlag:
    label: str
    load_from: float
    load_to: float
    reasons: list[str]


def jump_flags(
    label: str, points: Sequence[Point], kind: LoadKind, tolerance: float = 0.1
) -> list[JumpFlag]:
    """Throughput rises between consecutive levels that the rest of the data does not back.

    The article's warning: a sudden jump at high concurrency must be checked against completed
    requests, failures and output tokens before anyone trusts it. A rise is flagged when:
    - it is more than proportional to the load (by Little's law, latency would have to fall as
      load rises: suspect measurement, not capacity);
    - output tokens/s rose less than requests/s (requests got shorter: truncated outputs);
    - the completion rate fell (failures are rising under the "faster" level);
    - (closed loop) fewer requests completed than there are users: the rate is a start-up
      transient, not a steady state.
    """
    flags = []
    for a, b in itertools.pairwise(points):
        rise = ratio(b.rps, a.rps)
        if rise is None or rise <= 1 + tolerance:
            continue
        reasons = []
        load = b.load / a.load
        if rise > load * (1 + tolerance):
            reasons.append(
                f"throughput x{rise:.2f} for x{load:.2f} load: more than proportional, so"
                " latency would have to fall as load rises"
            )
        tokens = ratio(b.output_tps, a.output_tps)
        if tokens is not None and tokens < rise * (1 - tolerance):
            reasons.append(f"output tokens/s only x{tokens:.2f}: requests got shorter")
        if b.completion_rate < a.completion_rate - 0.01:
            reasons.append(
                f"completion rate fell from {a.completion_rate:.1%} to {b.completion_rate:.1%}"
            )
        if kind == "users" and b.completed < b.load:
            reasons.append(
                f"only {b.completed} completed requests for {b.load:g} users: a start-up transient"
            )
        if reasons:
            flags.append(JumpFlag(label, a.load, b.load, reasons))
    return flags
