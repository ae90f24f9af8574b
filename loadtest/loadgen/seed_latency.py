"""`llm-loadtest seed-latency`: the gateway's latency model seed, fitted on the simulator's engine.

The gateway predicts each request's latency on each replica with a small linear model
(`LatencyModelSpec` in gateway/config/schema.py) that it trains online from what it measures;
this fits where that training starts. The simulator's scheduler (loadtest/sim, no HTTP: the
closed-loop driver of sim/closed_loop.py) is swept over closed-loop concurrencies with the
article's two workloads, alone and mixed, and each request's features are read as the gateway
would read them when it sends the request:

    TTFT = base + per_1k_prefill x prefill tokens / 1000 + per_running x running
    TPOT = base + per_running x batch + per_1k_context x context tokens / 1000

(prefill tokens: its own prompt and those of the requests in flight without a first token;
running: those past it; batch: everything in flight, itself included; context: their prompts
and outputs so far). Each is fitted by least squares on relative errors (a 20 ms TTFT missed
by 20 ms is as wrong as a 2 s one missed by 2 s) with coefficients held non-negative (a
negative one would promise a faster answer on a busier replica), on every other level of each
workload; the levels in between are held out and their error is reported, so the seed is
checked on loads it was not fitted on. TPOT's errors are weighted by the tokens they cover: a
classification's nine decode steps share their batch with other requests' prefills, which the
model has no term for, and they are not what a TPOT objective is about.

The model is linear in the work ahead: past a replica's KV-cache wall a request waits for
memory, not for prefill, and the prediction falls short (27B generation at 128 users on v6e).

Times are simulated milliseconds: a gateway in front of replicas at time scale K reads them
over K (loadtest/autoscale/loop.py `wall_slo`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import yaml

from gateway.config.schema import LatencyModelSpec
from loadtest.loadgen.workloads import BUILTIN, Fixed, Workload
from loadtest.sim import load_profile
from loadtest.sim.closed_loop import Observed, observe_closed_loop
from loadtest.sim.profiles import Profile

# Closed-loop users per workload: prefill-bound classification saturates a replica within a few
# requests in flight; decode-bound generation gains up to a hundred or more.
LEVELS: dict[str, tuple[int, ...]] = {
    "classification": (1, 2, 4, 8, 16, 32),
    "generation": (1, 4, 16, 32, 64, 128),
    "mixed": (2, 4, 8, 16, 32, 64, 96),
}
# Where TPOT is what matters and what the model can see: a classification's few decode steps
# share their batch with prefills, which it has no term for.
DECODE_HEAVY = ("generation", "mixed")
REQUESTS_PER_USER = 4  # after the first wave; at least MIN_REQUESTS a level
MIN_REQUESTS = 48

TTFT_TERMS = ("ttft_base_ms", "ttft_per_1k_prefill_ms", "ttft_per_running_ms")
TPOT_TERMS = ("tpot_base_ms", "tpot_per_running_ms", "tpot_per_1k_context_ms")


def ttft_features(o: Observed) -> tuple[float, float, float]:
    return 1.0, o.prefill_tokens / 1000, float(o.decoding)


def tpot_features(o: Observed) -> tuple[float, float, float]:
    return 1.0, float(o.batch), o.context_tokens / 1000


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |x b - y| with b >= 0, exactly (weights are the caller's, folded into x and y): the best unconstrained fit over every subset of the
    columns whose coefficients all come out non-negative (the others at 0). Three terms make
    eight subsets, so no solver is needed."""
    best, best_error = np.zeros(x.shape[1]), float(np.sum(y**2))
    for size in range(1, x.shape[1] + 1):
        for columns in itertools.combinations(range(x.shape[1]), size):
            coef, *_ = np.linalg.lstsq(x[:, columns], y, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(x.shape[1])
            full[list(columns)] = coef
            error = float(np.sum((x @ full - y) ** 2))
            if error < best_error:
                best, best_error = full, error
    return best


@dataclass(frozen=True)
class LevelError:
    """One held-out level: the model's median TTFT against the observed median, and its TPOT
    per output token (each request's weighted by its decode steps) against the observed."""

    workload: str
    users: int
    requests: int
    ttft_observed_ms: float
    ttft_predicted_ms: float
    tpot_observed_ms: float | None
    tpot_predicted_ms: float | None

    @property
    def ttft_error(self) -> float:
        return abs(self.ttft_predicted_ms - self.ttft_observed_ms) / self.ttft_observed_ms

    @property
    def tpot_error(self) -> float | None:
        if self.tpot_observed_ms is None or self.tpot_predicted_ms is None:
            return None
        return abs(self.tpot_predicted_ms - self.tpot_observed_ms) / self.tpot_observed_ms


@dataclass(frozen=True)
class Seed:
    profile: str
    model: LatencyModelSpec
    fitted_on: int  # requests
    held_out: list[LevelError]

    def worst(self) -> tuple[float, float]:
        """The largest held-out relative error of TTFT, and of TPOT on decode-heavy levels."""
        ttft = max(e.ttft_error for e in self.held_out)
        tpot = max(
            (t for e in self.held_out if e.workload in DECODE_HEAVY and (t := e.tpot_error)),
            default=0.0,
        )
        return ttft, tpot


def shapes(workload: Workload) -> list[tuple[int, int]]:
    """The (prompt, output) shapes of a workload of fixed-length classes, one per class."""
    out = []
    for c in workload.classes:
        if not isinstance(c.isl, Fixed) or not isinstance(c.osl, Fixed):
            raise ValueError(f"class {c.name} is not of fixed lengths")
        out.append((c.isl.value, c.osl.value))
    return out


def sweep(profile: Profile, seed: int) -> dict[tuple[str, int], list[Observed]]:
    """Every level of every workload: (workload, users) -> its requests."""
    out = {}
    for name, levels in LEVELS.items():
        mix = shapes(BUILTIN[name])
        for users in levels:
            requests = max(MIN_REQUESTS, REQUESTS_PER_USER * users)
            out[name, users] = observe_closed_loop(
                profile, users, mix, requests=requests, seed=seed
            )
    return out


def _fit(
    rows: list[Observed],
    features: Callable[[Observed], tuple[float, ...]],
    target: str,
    weight: Callable[[Observed], float],
) -> np.ndarray:
    """Least squares of the relative error, each row weighted by `weight`."""
    kept = [o for o in rows if getattr(o, target)]
    y = np.array([getattr(o, target) * 1000 for o in kept])
    scale = np.sqrt([weight(o) for o in kept]) / y
    x = np.array([features(o) for o in kept]) * scale[:, None]
    return nonnegative_least_squares(x, y * scale)


def _per_token(tpots: Sequence[float], weights: Sequence[float]) -> float | None:
    """A level's TPOT as its tokens saw it: each request's weighted by its decode steps."""
    return float(np.average(tpots, weights=weights)) if tpots else None


def fit_seed(profile: Profile, seed: int = 0) -> Seed:
    """Fit on every other level of each workload (the first, third, ...), check on the rest."""
    levels = sweep(profile, seed)
    train: list[Observed] = []
    test: dict[tuple[str, int], list[Observed]] = {}
    for name, levels_of in LEVELS.items():
        for i, u in enumerate(levels_of):
            (train.extend if i % 2 == 0 else test.setdefault((name, u), []).extend)(levels[name, u])
    ttft = _fit(train, ttft_features, "ttft_s", lambda o: 1.0)
    tpot = _fit(train, tpot_features, "tpot_s", lambda o: o.output_tokens - 1.0)
    model = LatencyModelSpec(
        **{
            n: round(float(v), 4)
            for n, v in zip(TTFT_TERMS + TPOT_TERMS, [*ttft, *tpot], strict=True)
        }
    )
    held = []
    for (name, users), rows in test.items():
        decoded = [o for o in rows if o.tpot_s]
        weights = [o.output_tokens - 1.0 for o in decoded]
        held.append(
            LevelError(
                name,
                users,
                len(rows),
                statistics.median(o.ttft_s * 1000 for o in rows),
                statistics.median(float(np.dot(ttft, ttft_features(o))) for o in rows),
                _per_token([o.tpot_s * 1000 for o in decoded if o.tpot_s], weights),
                _per_token([float(np.dot(tpot, tpot_features(o))) for o in decoded], weights),
            )
        )
    return Seed(profile.name, model, len(train), held)


def snippet(seed: Seed, pool: str) -> str:
    """The pool's `slo.model:` for the policy, ready to paste (under `pools:`)."""
    ttft, tpot = seed.worst()
    entry = {"pools": {pool: {"slo": {"model": seed.model.model_dump(exclude={"forgetting"})}}}}
    reason = (
        f"# fitted on {seed.profile} ({seed.fitted_on} simulated requests, simulated ms);"
        f" held-out levels within {ttft:.0%} (TTFT) and {tpot:.0%} (TPOT, decode-heavy)"
    )
    return f"{reason}\n" + yaml.safe_dump(entry, sort_keys=False)


def table(seed: Seed) -> str:
    lines = [
        "| workload | users | requests | TTFT observed ms | predicted | error"
        " | TPOT observed ms | predicted | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in seed.held_out:
        tpot = (
            f"{e.tpot_observed_ms:.2f} | {e.tpot_predicted_ms:.2f} | {e.tpot_error:.0%}"
            if e.tpot_observed_ms is not None and e.tpot_predicted_ms is not None
            else "- | - | -"
        )
        lines.append(
            f"| {e.workload} | {e.users} | {e.requests} | {e.ttft_observed_ms:.1f}"
            f" | {e.ttft_predicted_ms:.1f} | {e.ttft_error:.0%} | {tpot} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="llm-loadtest seed-latency",
        description="Fit the gateway's latency model seed (`slo.model:`) on a simulated profile.",
    )
    p.add_argument("--profile", required=True, help="a bundled profile name or a profile YAML")
    p.add_argument("--pool", help="the pool's name in the snippet (default: the served model)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(list(argv)[1:] if argv is not None else None)
    profile = load_profile(args.profile)
    seed = fit_seed(profile, args.seed)
    print(table(seed), file=sys.stderr)
    print(snippet(seed, args.pool or profile.served_model_name))
    return 0
