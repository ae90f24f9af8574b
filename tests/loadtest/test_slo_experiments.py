"""The SLO experiments' runner end to end in its smallest configuration (one simulated replica,
a minute of simulated arrivals, the real gateway), and the tables' figures from known records."""

from __future__ import annotations

import math
import re
from pathlib import Path

import orjson
import pytest

from loadtest.loadgen.compare import SLO, goodput_per_replica_hour, objective_slos
from loadtest.loadgen.runner import RequestRecord
from loadtest.loadgen.workloads import load_workload
from loadtest.slo_experiments import (
    TIERS,
    Setup,
    Variant,
    VariantRun,
    minute_rows,
    overload_rows,
    prediction_rows,
    run_experiment,
    write,
)


def _cells(table: str) -> list[list[str]]:
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


async def test_the_goodput_experiment_runs_end_to_end_and_its_table_is_finite(
    tmp_path: Path,
) -> None:
    setup = Setup(
        "goodput", "gemma-3-12b-tpu-v6e-2x2", replicas=1, time_scale=20.0, seed=0,
        out=tmp_path, duration_s=45.0, load=0.25,
    )  # fmt: skip
    result = await run_experiment(setup)
    write(result, tmp_path)

    header, *rows = _cells(result["table"].split("\n\n")[1])
    assert header[:4] == ["variant", "cap", "requests", "met objectives"]
    assert [r[0] for r in rows] == ["static", "slo", "slo+adaptive"]
    assert all(len(r) == len(header) for r in rows)
    for row in rows:
        for cell in row[1:]:
            number = float(re.sub(r"[%x]$", "", cell))
            assert math.isfinite(number), row
    knee = result["knee"]
    assert [r[1] for r in rows] == [str(knee["cap"])] * 2 + [str(2 * knee["cap"])]
    # Both variants got the same arrivals, and the classes' objectives went out as headers.
    sent = result["requests"]
    assert len(sent["static"]) == len(sent["slo"]) > 0
    assert {r["priority"] for r in sent["slo"]} == set(TIERS)
    policies = {v: (tmp_path / v / "policy.yaml").read_text() for v in ("static", "slo")}
    adaptive = (tmp_path / "slo+adaptive" / "policy.yaml").read_text()
    assert "slo:" not in policies["static"]
    assert "slo:" in policies["slo"] and "adaptive:" not in policies["slo"]
    assert "adaptive:" in adaptive
    saved = orjson.loads((tmp_path / "results.json").read_bytes())
    assert saved["table"] == result["table"] == (tmp_path / "table.md").read_text()


def _record(i: int, priority: str, status: int = 200, **times: float) -> RequestRecord:
    rec = RequestRecord(i, "generation", "chat", 500, 1000, times.pop("start_s", 0.0))
    rec.status, rec.priority = status, priority
    if status == 200:
        rec.ttft_s, rec.e2e_s, rec.output_tokens = times["ttft_s"], times["e2e_s"], 1000
        rec.predicted_ttft_s = times.get("predicted_ttft_s")
    else:
        rec.code = "slo_unreachable"
    return rec


def test_the_figures_read_simulated_time_from_the_records() -> None:
    # Time scale 10: a wall TTFT of 0.1 s is 1 simulated second; TPOT (e2e - ttft) / 999.
    slos = {"generation": SLO(ttft_s=2.0, tpot_s=0.05)}
    records = [
        _record(0, "critical", ttft_s=0.1, e2e_s=2.1, predicted_ttft_s=0.12),  # met (TPOT 20 ms)
        _record(1, "critical", ttft_s=0.3, e2e_s=2.3, start_s=7.0),  # TTFT 3 s: missed
        _record(2, "sheddable", 429, start_s=7.0),
        _record(3, "standard", ttft_s=0.1, e2e_s=9.1, predicted_ttft_s=0.05),  # TPOT 90 ms
        _record(4, "standard", ttft_s=0.1, e2e_s=2.1, start_s=12.5),  # met, sent late: 125 s
    ]
    access = [  # the gateway's log: TTFT from arrival, its queue wait; a refusal predicts nothing
        {"status": 200, "ttft_s": 0.15, "queue_wait_s": 0.05, "e2e_s": 2.15, "output_tokens": 1001,
         "predicted_ttft_s": 0.12, "predicted_tpot_s": 0.003},
        {"status": 429, "ttft_s": None, "predicted_ttft_s": None, "predicted_tpot_s": None},
    ]  # fmt: skip
    run = VariantRun(
        Variant("slo", 8), records, 10.0, 120.0, replica_hours=0.5, slip_s=0.0, access=access
    )
    assert goodput_per_replica_hour(records, slos, 10.0, 0.5) == 4.0  # two met in half an hour

    (overload,) = overload_rows([run], slos)
    assert overload["critical"] == 2 and overload["critical_ttft_attainment"] == 0.5
    assert overload["refused_429_by_tier"] == {"critical": 0.0, "standard": 0.0, "sheddable": 1.0}
    assert overload["codes_429"] == {"slo_unreachable": 1}

    (minutes,) = minute_rows([run], slos)
    # Sent at 0, 70 and 125 simulated seconds of a 120 s trace: the late one counts in its last.
    assert minutes["per_minute"] == [1, 1]

    client, logged = prediction_rows([run])
    assert client["observed by"] == "client" and client["ttft"]["requests"] == 2
    # |0.12 - 0.1| and |0.05 - 0.1| wall seconds, times 10, in ms
    assert client["ttft"]["p50_ms"] == pytest.approx(350.0)
    assert client["tpot"]["requests"] == 0 and client["tpot"]["p50_ms"] is None
    # From the grant: 0.15 - 0.05 s against 0.12 s predicted; TPOT 2 s / 1000 against 3 ms.
    assert logged["ttft"]["requests"] == 1 and logged["ttft"]["p50_ms"] == pytest.approx(200)
    assert logged["tpot"]["p50_ms"] == pytest.approx(10.0)


def test_the_workload_objectives_are_what_goodput_counts() -> None:
    slos = objective_slos(load_workload("slo-mixed"))
    assert slos == {
        "classification": SLO(ttft_s=1.5),
        "generation": SLO(ttft_s=2.0, tpot_s=0.05),
    }
