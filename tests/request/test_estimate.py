"""The output-length estimator: what it learns, and what it keeps."""

from __future__ import annotations

import math
import random

from gateway.request.estimate import RollingQuantileEstimator


def test_the_estimator_learns_a_p90_and_keeps_one_offs_cheap() -> None:
    est = RollingQuantileEstimator(RollingQuantileEstimator.Params(min_samples=10, max_keys=3))
    key = (None, "chat", "m", 1)
    for tokens in range(1, 11):  # 1..10
        est.observe(key, tokens)
    assert est.estimate(key) == 9  # the p90 of 1..10
    for other in range(100):  # a hundred prompts seen once each
        est.observe((None, "chat", "m", 1000 + other), 5)
    table = est._tables[None]
    assert est.estimate(key) == 9 and len(table.windows) == 1 and len(table.first) == 3


def test_the_quantile_is_that_of_the_last_window_samples() -> None:
    """The window keeps a sorted copy instead of sorting per read: same answer as sorting."""
    params = RollingQuantileEstimator.Params(quantile=0.9, window=50, min_samples=5)
    est = RollingQuantileEstimator(params)
    key = (None, "chat", "m", 1)
    rng = random.Random(7)
    seen: list[int] = []
    for _ in range(400):
        tokens = rng.choice([rng.randint(1, 20), rng.randint(1, 4000)])  # duplicates and spread
        est.observe(key, tokens)
        seen.append(tokens)
        last = sorted(seen[-params.window :])
        want = None if len(seen) < params.min_samples else last[math.ceil(0.9 * len(last)) - 1]
        assert est.estimate(key) == want
