"""The autoscaling loop end to end on loopback: the real gateway subprocess discovering a
simulated pool through the loopback DNS server, the HPA model reading its /metrics."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from loadtest.autoscale import report
from loadtest.autoscale.hpa import ScalingPolicy, ScalingRules
from loadtest.autoscale.loop import (
    FORECAST,
    REACTIVE,
    TAIL_S,
    AutoscaleConfig,
    PoolConfig,
    hpa_metrics,
    parse_gauges,
    run_keeping_pace,
)
from loadtest.autoscale.trace import load_trace
from loadtest.loadgen.compare import DEFAULT_SLOS

STARTUP_S = 40.0


async def test_a_step_adds_replicas_after_their_start_up_and_the_gateway_uses_them(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    config = AutoscaleConfig(
        # 0.5 req/s, 4 req/s for 100 s, back: one replica (cap 8) cannot hold the step.
        trace=load_trace("step:base=0.5,peak=4,start=10,end=110,duration=200", "generation"),
        tokenizer=str(tokenizer_dir),
        out=tmp_path,
        time_scale=20.0,  # 200 simulated seconds in ~10 wall seconds, slower on a busy machine
        startup_s=STARTUP_S,
        pools=(PoolConfig(max_concurrency=8, max_replicas=4),),
        scale_down=ScalingRules(0.0, (ScalingPolicy("Pods", 1, 15.0),)),
    )
    run = await run_keeping_pace(config)

    added = [m for m in run.members if m.asked_s > 0]
    assert added, f"no replica was added: {run.samples}"
    started = [m for m in added if m.started_s is not None]
    assert started, "no added replica came up"
    for m in started:  # serving only once its start-up has passed, never before
        assert m.started_s is not None and m.started_s >= m.asked_s + STARTUP_S
    served = Counter(line["replica"] for line in run.access if line["status"] == 200)
    new_urls = [u for u, host in run.url_of.items() if host in {m.host for m in started}]
    assert sum(served[u] for u in new_urls) > 0, served
    assert max(s.ready for s in run.samples) >= 2
    removed = [m for m in run.members if m.removed_s is not None]
    assert removed, "the step ended 90 s before the trace and nothing was removed"
    for m in removed:  # stopped after it left DNS, not before
        assert m.gone_s is not None and m.removed_s is not None and m.gone_s >= m.removed_s
    # Drained, not cut off: whatever the gateway sent a replica completed; the rest was refused.
    assert {line["status"] for line in run.access if line["replica"]} == {200}
    assert {r.outcome for r in run.records} <= {"ok", "429"}
    assert run.end_s < config.trace.duration_s + TAIL_S  # it stopped when its load was done

    summary = report.summarise(run, DEFAULT_SLOS, 20.0)
    paths = report.write(run, summary, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths)
    assert summary["replica_hours"] > 200 / 3600  # the first replica alone served 200 s


EXPOSITION = """\
# HELP llm_pool_desired_replicas Replicas the pool's demand needs.
# TYPE llm_pool_desired_replicas gauge
llm_pool_desired_replicas{pool="generate-27b"} 2.5
llm_pool_desired_replicas{pool="other"} 9.0
# HELP llm_pool_desired_replicas_forecast Forecast.
# TYPE llm_pool_desired_replicas_forecast gauge
llm_pool_desired_replicas_forecast{pool="generate-27b"} 4.25
"""


def test_the_signal_picks_the_series_and_falls_back_to_the_reactive_one_when_absent(
    tmp_path: Path,
) -> None:
    both = {REACTIVE, FORECAST}
    gauges = parse_gauges(EXPOSITION, both)
    assert gauges == {"generate-27b": {REACTIVE: 2.5, FORECAST: 4.25}, "other": {REACTIVE: 9.0}}
    trace = load_trace("ramp", "generation")

    def names(signal: str, have_forecast: bool) -> tuple[tuple[str, ...], list[str]]:
        config = AutoscaleConfig(trace, "tok", tmp_path, signal=signal)  # type: ignore[arg-type]
        return hpa_metrics(config, "generate-27b", have_forecast)

    assert names("reactive", True) == ((REACTIVE,), [])
    assert names("forecast", True) == ((FORECAST,), [])
    assert names("max", True) == ((REACTIVE, FORECAST), [])  # the HPA takes the larger
    for signal in ("forecast", "max"):
        used, notes = names(signal, False)
        assert used == (REACTIVE,) and "fell back" in notes[0]
    custom = AutoscaleConfig(trace, "tok", tmp_path, metric="my_gauge")
    assert hpa_metrics(custom, "generate-27b", False) == (("my_gauge",), [])
