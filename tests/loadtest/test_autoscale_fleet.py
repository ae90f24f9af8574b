"""Several pools in the autoscaling loop: each with its own HPA, the gateway's routes choosing
among them, spill-over on and off; the fleet file and the four-way compare."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path

import pytest

from loadtest import processes
from loadtest.autoscale import cli, matrix, report
from loadtest.autoscale.loop import (
    AutoscaleConfig,
    PoolConfig,
    free_port,
    policy,
    run_keeping_pace,
)
from loadtest.autoscale.trace import load_traces
from loadtest.loadgen.compare import DEFAULT_SLOS

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "loadtest" / "autoscale" / "fleets" / "gemma3-seed.yaml"


def small_fleet(tmp_path: Path, spill: bool) -> AutoscaleConfig:
    """The seed's fleet, one replica each that cannot grow: classification at 3x what one
    27B replica at cap 2 serves, generation light, so 12B has room."""
    fleet = cli.load_fleet(FLEET)
    pools = tuple(
        PoolConfig(p.name, p.profile, 2 if p.name == "classify-27b" else 16, 1, 1, 1, p.target)
        for p in fleet["pools"]
    )
    return AutoscaleConfig(
        trace=load_traces(
            [
                "classification=ramp:from=12,to=12,duration=60",
                "generation=ramp:from=0.5,to=0.5,duration=60",
            ],
            "generation",
        ),
        tokenizer=None,  # 4 characters a token everywhere: the gateway on `estimate`
        out=tmp_path,
        pools=pools,
        classes=fleet["classes"],
        routes=fleet["routes"],
        spill=spill,
        time_scale=10.0,
        startup_s=30.0,
        queue_wait_s=5.0,
    )


@pytest.mark.parametrize("spill", [True, False])
async def test_classification_spills_to_the_12b_pool_only_when_spill_over_is_on(
    tmp_path: Path, spill: bool
) -> None:
    run = await run_keeping_pace(small_fleet(tmp_path, spill))

    served = Counter(
        (line["pool"], line["spilled_from"]) for line in run.access if line["status"] == 200
    )
    spilled = served[("generate-12b", "classify-27b")]
    if spill:
        assert spilled > 0, served
        assert served[("classify-27b", None)] > 0  # the home pool still serves its share
    else:
        assert spilled == 0, served
        assert "fallback" not in (tmp_path / "policy.yaml").read_text()
    assert {s.pool for s in run.samples} == {"classify-27b", "generate-12b"}  # an HPA each
    assert {m.pool for m in run.members} == {"classify-27b", "generate-12b"}
    summary = report.summarise(run, DEFAULT_SLOS, 10.0)
    assert summary["spilled"] == spilled
    assert summary["pools"]["generate-12b"]["spilled_in"] == spilled
    assert summary["replica_hours"] == pytest.approx(
        sum(p["replica_hours"] for p in summary["pools"].values()), abs=0.002
    )
    paths = report.write(run, summary, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths)


def test_a_fleet_file_is_checked_and_single_pool_flags_do_not_mix_with_it(tmp_path: Path) -> None:
    fleet = cli.load_fleet(FLEET)
    assert [p.name for p in fleet["pools"]] == ["classify-27b", "generate-12b"]
    assert fleet["routes"][0]["fallback"][0]["pool"] == "generate-12b"
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [{name: x, max_replicas: 0}]\n")
    with pytest.raises(SystemExit, match="min_replicas"):
        cli.load_fleet(bad)
    bad.write_text("pools: [{name: x, colour: red}]\n")
    with pytest.raises(SystemExit, match="colour"):
        cli.load_fleet(bad)
    args = cli.parser().parse_args(["--fleet", str(FLEET), "--max-replicas", "3"])
    with pytest.raises(SystemExit, match="--max-replicas"):
        cli.fleet(args, None)


@pytest.mark.parametrize(
    "flags",
    [
        ["--sync-period-s", "0"],
        ["--scrape-interval-s", "-1"],
        ["--target", "0"],
        ["--slo", "x:speed=1"],
    ],
)
def test_flags_that_cannot_work_are_refused_before_anything_starts(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parser().parse_args(flags)


def test_an_hpa_manifest_listing_both_gauges_is_the_max_signal() -> None:
    shipped = cli.load_manifest(str(ROOT / "deploy/base/autoscaling/hpa.yaml") + "#gemma3-27b-gen")
    args = cli.parser().parse_args([])
    assert cli.manifest_signal(shipped, args) == "max"
    assert cli.manifest_signal(None, args) == "reactive"


def summary(bad: int, hours: float) -> dict[str, object]:
    counts = {"requests": 100, "slo_violations": bad, "refused_429": 0, "refused_503": 0}
    return {
        "all": {**counts, "violating_or_refused": bad},
        "replica_hours": hours,
        "spilled": 0,
        "pools": {"p": {"peak_ready": 2}},
    }


def test_the_compare_says_whether_d_met_the_target_against_a() -> None:
    met = matrix.compare({"a": summary(40, 1.0), "d": summary(20, 1.1)}, "step")
    assert "50% fewer" in met and "+10% replica-hours" in met and "is met" in met
    missed = matrix.compare({"a": summary(40, 1.0), "d": summary(21, 1.0)}, "step")
    assert "is not met" in missed
    costly = matrix.compare({"a": summary(40, 1.0), "d": summary(0, 1.2)}, "step")
    assert "is not met" in costly


async def test_a_child_that_ignores_sigterm_is_killed_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(processes, "STOP_WAIT_S", 0.5)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    async with processes.python_process("-c", code, stdout=asyncio.subprocess.PIPE) as proc:
        assert proc.stdout is not None
        assert await proc.stdout.readline() == b"up\n"
    # Killed, so before its 60 s sleep was over: SIGTERM alone it ignores, and waited out it
    # would have exited 0.
    assert proc.returncode == -signal.SIGKILL


async def test_a_gateway_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("pools: {}\n")  # no models, no routes: the gateway refuses to start
    with pytest.raises(RuntimeError, match=r"exited.*gateway\.log"):
        async with processes.gateway(policy, free_port("127.0.0.1"), tmp_path):
            pass
    assert (tmp_path / "gateway.log").read_text()


def test_the_compare_says_more_when_d_did_worse() -> None:
    worse = matrix.compare({"a": summary(40, 1.0), "d": summary(50, 1.0)}, "diurnal")
    assert "25% more SLO-violating" in worse and "is not met" in worse


def test_forecast_flags_reach_every_pool_over_the_fleets_and_the_gateway_gets_them_scaled(
    tmp_path: Path,
) -> None:
    args = cli.parser().parse_args(
        ["--fleet", str(FLEET), "--tokenizer", "estimate", "--forecast", "ceiling=2.5",
         "--forecast", "trend_s=120", "--time-scale", "10"]
    )  # fmt: skip
    config = cli.build_config(args, None)
    assert all(p.forecast == {"ceiling": 2.5, "trend_s": 120} for p in config.pools)
    spec = policy(config, 53, {p.name: 8000 for p in config.pools})
    assert spec["pools"]["classify-27b"]["forecast"] == {
        "level_s": 6.0, "trend_s": 12.0, "damping_s": 30.0, "ceiling": 2.5,
    }  # fmt: skip
    assert spec["pools"]["classify-27b"]["startup_s"] == config.startup_s / 10
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--forecast", "ceiling"])
