"""The sweep report keeps one clock: with a time scale, every time and rate a person reads is in
simulated seconds and says so; a single level gets plots of its own and no sweep-only sections."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from loadtest.loadgen import (
    Mark,
    RequestRecord,
    SweepConfig,
    SweepResult,
    Target,
    load_workload,
    write_report,
)
from loadtest.loadgen.runner import LevelRun
from loadtest.loadgen.sweep import Series, level_line

K = 10.0  # the simulator's time scale


def records() -> list[RequestRecord]:
    """Wall-clock records of a 2-second level: classification flows, generation queues (TTFT
    2.5 s wall = 25 s simulated) and two generation requests are refused at once."""
    out = []
    for i in range(20):
        start = i * 0.1
        if i % 2:
            rec = RequestRecord(i, "classification", "chat", 4000, 10, start, 200)
            rec.ttft_s, rec.e2e_s, rec.input_tokens, rec.output_tokens = 0.1, 0.12, 4000, 10
        elif i in (6, 8):
            rec = RequestRecord(i, "generation", "chat", 500, 1000, start, 429)
            rec.error, rec.e2e_s = "queue_wait_too_long", 0.004
        else:
            rec = RequestRecord(i, "generation", "chat", 500, 1000, start, 200)
            rec.ttft_s, rec.e2e_s, rec.input_tokens, rec.output_tokens = 2.5, 3.2, 500, 1000
        out.append(rec)
    return out


def result(rates: tuple[float, ...]) -> SweepResult:
    config = SweepConfig(
        targets=(Target("http://127.0.0.1:1", "gemma-3"),),
        workloads=(load_workload("mixed"),),
        rates=rates,
        duration_s=2.0,
        time_scale=K,
    )
    runs = [(rate, LevelRun(records(), duration_s=5.2)) for rate in rates]
    return SweepResult(config, [Series(config.targets[0], config.workloads[0], runs)])


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_single_level_reads_in_simulated_seconds_with_its_own_plots(tmp_path: Path) -> None:
    marks = {"generation": Mark("queue max wait 30 s (simulated)", 30.0)}
    paths = write_report(result((10.0,)), tmp_path, marks)

    requests = rows(tmp_path / "requests.csv")
    assert {"start_sim_s", "ttft_sim_s", "e2e_sim_s", "arrivals_per_sim_s"} <= set(requests[0])
    assert not {"start_s", "ttft_s", "e2e_s", "load"} & set(requests[0])
    generation = [r for r in requests if r["class"] == "generation" and r["status"] == "200"]
    assert float(generation[0]["ttft_sim_s"]) == pytest.approx(25.0)  # 2.5 s wall x 10
    assert float(requests[19]["start_sim_s"]) == pytest.approx(19.0)  # 1.9 s wall x 10
    assert float(requests[0]["arrivals_per_sim_s"]) == pytest.approx(1.0)  # 10/s wall / 10

    levels = rows(tmp_path / "levels.csv")
    assert {"duration_sim_s", "rps_sim", "e2e_p95_sim_s", "ttft_p50_sim_s"} <= set(levels[0])
    assert not {"duration_s", "rps", "e2e_p95"} & set(levels[0])
    assert float(levels[0]["duration_sim_s"]) == pytest.approx(52.0)
    # 18 completed over 52 simulated seconds, not over 5.2 wall-clock ones
    assert float(levels[0]["rps_sim"]) == pytest.approx(18 / 52)

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["clock"] == "simulated seconds (wall x 10)"
    level = results["series"][0]["levels"][0]
    assert level["load"] == pytest.approx(1.0) and level["duration_s"] == pytest.approx(52.0)

    report = (tmp_path / "report.md").read_text()
    assert "clock: simulated seconds (wall x 10)" in report
    assert "Poisson arrivals at 1/s for 20s" in report
    assert "| arrivals/sim s |" in report and "E2E P50 / P95 / P99 sim s" in report
    assert "Normalised" not in report and "knee" not in report.lower()
    assert "closed-loop sweep" not in report and "jumps" not in report

    assert {p.name for p in paths} >= {"throughput.png", "latency.png"}
    for png in ("throughput.png", "latency.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_a_sweep_of_several_levels_keeps_its_sweep_sections_in_simulated_rates(
    tmp_path: Path,
) -> None:
    write_report(result((10.0, 20.0)), tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "## Normalised throughput" in report and "at 1, 2/s for 20s" in report
    assert [r["arrivals_per_sim_s"] for r in rows(tmp_path / "levels.csv")][:2] == ["1.0", "2.0"]
    for png in ("throughput.png", "latency.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_the_progress_line_has_one_clock() -> None:
    line = level_line(LevelRun(records(), duration_s=5.2), K)
    # 52 simulated seconds next to simulated latencies; never the 5.2 wall-clock ones
    assert "completed in 52.0s" in line and "5.2s" not in line and "wall" not in line
    assert line.endswith("(simulated seconds, time scale 10)")
