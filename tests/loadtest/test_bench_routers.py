"""`loadtest.bench_routers` against the real stub, pass-through and gateway on loopback: a router
that is absent is skipped and said so, and what is there is measured."""

from __future__ import annotations

from loadtest.bench_routers import run


def test_absent_routers_are_skipped_and_said_so_and_the_rest_is_measured() -> None:
    lines = run(1, 2, {"nginx": None, "vllm-router": None})
    assert any(line.startswith("- nginx: not found, skipped") for line in lines)
    assert any(line.startswith("- vllm-router: not found, skipped") for line in lines)
    header = next(line for line in lines if line.startswith("| round |"))
    assert header == "| round | pass-through | gateway | other CPU |"
    row = next(line for line in lines if line.startswith("| 1 |"))
    assert row.count("µs") == 2
    assert not any("target gateway" in line for line in lines)  # no router, no verdict
