"""Per-turn input lengths of session workloads: how the prompt grows as the history does.

A session turn's ISL is its whole prompt, counted when the turn is sent (runner.py), so it is
known only from the records; this table is what `sweep` and `compare` print for them:

    | run | turn | requests | completed | ISL P50 | ISL max | P95 TTFT s |
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from loadtest.loadgen.runner import RequestRecord
from loadtest.loadgen.stats import Quantiles, percentile


def turn_table(runs: Mapping[str, Iterable[RequestRecord]], time_scale: float = 1.0) -> str:
    """One row per run and turn number; empty when no run has session turns."""
    rows = []
    for name, records in runs.items():
        by_turn: dict[int, list[RequestRecord]] = {}
        for rec in records:
            if rec.turn is not None:
                by_turn.setdefault(rec.turn, []).append(rec)
        for turn, recs in sorted(by_turn.items()):
            isl = percentile([float(r.isl) for r in recs], 50)
            ttft = Quantiles.of(r.ttft_s for r in recs if r.ok).p95
            rows.append(
                f"| {name} | {turn} | {len(recs)} | {sum(r.ok for r in recs)} | {isl:.0f}"
                f" | {max(r.isl for r in recs)} | "
                + ("-" if ttft is None else f"{ttft * time_scale:.2f}")
                + " |"
            )
    if not rows:
        return ""
    header = "| run | turn | requests | completed | ISL P50 | ISL max | P95 TTFT s |"
    return "\n".join([header, "|---|" + "---:|" * 6, *rows])
