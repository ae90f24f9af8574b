"""The output-length estimator: what it learns, and what it keeps."""

from __future__ import annotations

from gateway.estimate import RollingQuantileEstimator


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
