"""Traces: the built-ins, the CSV format, one built from an access log, Poisson arrivals; and
the command line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loadtest.autoscale.trace import from_access_log, load_trace, load_traces, write_trace
from loadtest.cli import main as loadtest


def test_a_step_holds_its_peak_between_start_and_end() -> None:
    trace = load_trace("step:base=1,peak=4,start=10,end=20,duration=30", "generation")
    assert [trace.rate(t) for t in (0, 9.9, 10, 15, 19.9, 20.1, 30)] == [1, 1, 4, 4, 4, 1, 1]
    assert trace.rate(30.1) == 0 and trace.duration_s == 30


def test_a_ramp_is_linear_and_a_diurnal_curve_peaks_at_half_its_period() -> None:
    ramp = load_trace("ramp:from=0,to=2,duration=100", "generation")
    assert ramp.rate(50) == pytest.approx(1.0)
    day = load_trace("diurnal:min=1,max=3,period=600,duration=600", "generation")
    assert day.rate(0) == pytest.approx(1) and day.rate(300) == pytest.approx(3)


def test_a_csv_trace_has_optional_workloads_and_steps(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(
        "t_s,rate_rps,workload\n0,1\n60,1\n60,3\n120,3\n0,0.5,classification\n120,0.5,classification\n"
    )
    trace = load_trace(path, "generation")
    assert set(trace.series) == {"generation", "classification"}
    assert trace.rate(30, "generation") == 1 and trace.rate(90, "generation") == 3
    assert trace.rate(90) == 3.5
    again = load_trace(write_trace(trace, tmp_path / "copy.csv"), "generation")
    assert again == trace
    bad = tmp_path / "bad.csv"
    bad.write_text("0,fast\n")
    with pytest.raises(ValueError, match=r"bad\.csv:1"):
        load_trace(bad, "generation")


def test_an_access_log_becomes_a_constant_rate_per_bin() -> None:
    lines = [{"ts": 1000.0 + t, "class": "decode_heavy"} for t in (0, 1, 2, 3, 61, 62)]
    lines.append({"ts": 1010.0, "class": "prefill_heavy"})
    trace = from_access_log(lines, 60.0, {"decode_heavy": "generation"})
    assert set(trace.series) == {"generation", "prefill_heavy"}
    assert trace.rate(30, "generation") == pytest.approx(4 / 60)
    assert trace.rate(90, "generation") == pytest.approx(2 / 60)
    assert trace.duration_s == 120


def test_arrivals_follow_the_rate() -> None:
    trace = load_trace("step:base=1,peak=5,start=100,end=200,duration=300", "generation")
    times = trace.arrivals(random.Random(1), 10_000)["generation"]
    low = sum(t < 100 for t in times)
    high = sum(100 <= t < 200 for t in times)
    assert 70 < low < 130 and 420 < high < 580
    with pytest.raises(ValueError, match="more than the limit"):
        trace.arrivals(random.Random(1), 100)


def test_the_command_is_listed_and_every_flag_explains_itself(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert loadtest(["--help"]) == 0
    assert "llm-loadtest autoscale" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        loadtest(["autoscale", "--help"])
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    flags = [line for line in lines if line.startswith("--")]
    assert len(flags) > 30
    for i, line in enumerate(lines):  # help on the flag's line or, if it is long, the next one
        if line.startswith("--") and len(line.split(maxsplit=2)) < 3:
            assert lines[i + 1] and not lines[i + 1].startswith("-"), f"{line}: no help"


def test_each_workload_may_follow_its_own_curve_and_none_twice() -> None:
    trace = load_traces(
        ["classification=step:base=3,peak=9,start=10,end=20,duration=30", "ramp:to=2"],
        "generation",
    )
    assert set(trace.series) == {"classification", "generation"}
    assert trace.rate(15, "classification") == 9 and trace.rate(15) > 9
    with pytest.raises(ValueError, match="two traces"):
        load_traces(["generation=ramp", "ramp"], "generation")
