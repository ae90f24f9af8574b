"""`llm-loadtest seed-latency`: the latency model's seed fitted on the simulator's engine, checked
on the levels it was not fitted on."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from gateway.config.schema import LatencyModelSpec
from loadtest.cli import main
from loadtest.loadgen.seed_latency import DECODE_HEAVY, fit_seed, nonnegative_least_squares
from loadtest.sim import load_profile

# The stated bounds (docs/capacity.md, "SLO admission"): the median prediction of each held-out
# level against its observed median. TPOT only where the requests are decode-heavy: the nine
# decode steps of a classification share their batch with prefills the model has no term for.
TTFT_WITHIN = 0.6
TPOT_WITHIN = 0.25


@pytest.mark.parametrize("profile", ["gemma-3-12b-tpu-v6e-2x2", "llama-3.1-8b-h100"])
def test_the_fit_is_positive_and_predicts_the_held_out_levels(profile: str) -> None:
    seed = fit_seed(load_profile(profile))

    m = seed.model
    coefficients = m.model_dump(exclude={"forgetting"})
    assert all(v >= 0 for v in coefficients.values()), coefficients
    # Every latency has a positive base and grows with the work ahead. (TPOT's batch and context
    # terms move together in a closed loop, so the fit may put all of it on one of them.)
    assert m.ttft_base_ms > 0 and m.ttft_per_1k_prefill_ms > 0 and m.ttft_per_running_ms > 0
    assert m.tpot_base_ms > 0 and m.tpot_per_running_ms + m.tpot_per_1k_context_ms > 0
    assert {(e.workload, e.users) for e in seed.held_out} >= {
        ("classification", 8),
        ("generation", 32),
        ("mixed", 16),
    }
    for e in seed.held_out:
        assert e.ttft_error <= TTFT_WITHIN, e
        if e.workload in DECODE_HEAVY:
            assert e.tpot_error is not None and e.tpot_error <= TPOT_WITHIN, e
    # A busier replica is predicted slower: the fit is not a constant.
    ttft, tpot = (
        sorted(seed.held_out, key=lambda e: e.ttft_observed_ms),
        [e for e in seed.held_out if e.workload == "generation"],
    )
    assert ttft[-1].ttft_predicted_ms > 2 * ttft[0].ttft_predicted_ms
    assert tpot[-1].tpot_predicted_ms > tpot[0].tpot_predicted_ms  # type: ignore[operator]


def test_the_command_prints_a_policy_snippet_the_schema_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["seed-latency", "--profile", "llama-3.1-8b-h100", "--pool", "gen"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("# fitted on llama-3.1-8b-h100")
    snippet = yaml.safe_load(out.out)
    model = LatencyModelSpec.model_validate(snippet["pools"]["gen"]["slo"]["model"])
    assert model.ttft_per_1k_prefill_ms > 0
    assert "| workload | users |" in out.err  # the held-out table


def test_non_negative_least_squares_drops_a_term_that_would_go_negative() -> None:
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(50), rng.uniform(0, 10, 50), rng.uniform(0, 10, 50)])
    y = 5 + 2 * x[:, 1] - 0.5 * x[:, 2]  # the true third coefficient is negative
    free, *_ = np.linalg.lstsq(x, y, rcond=None)
    assert free[2] < 0
    held = nonnegative_least_squares(x, y)
    assert held[2] == 0 and held[1] > 0
    assert np.all(held >= 0)
    assert nonnegative_least_squares(x, 3 + x[:, 1]) == pytest.approx([3, 1, 0], abs=1e-9)
