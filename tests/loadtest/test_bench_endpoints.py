"""`loadtest.bench_endpoints`, tiny: a row for every endpoint the gateway admits, each measured
against the simulated replica directly, request by request, with nothing failed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gateway.api import BY_NAME

ROOT = Path(__file__).resolve().parents[2]


def test_a_row_per_endpoint_each_paired_with_the_replica_directly(tmp_path: Path) -> None:
    out = tmp_path / "endpoints.md"
    argv = [sys.executable, "-m", "loadtest.bench_endpoints", "--rotations", "2", "--block", "3"]
    argv += ["--skip", "1", "--out", str(out)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr

    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert sorted(row["endpoint"] for row in rows) == sorted(BY_NAME)
    for row in rows:
        assert row["path"] == BY_NAME[row["endpoint"]].path
        assert row["pairs"] == 2 * (3 - 1) and row["errors"] == 0
        assert 0 < row["direct_p50_ms"] <= row["direct_p95_ms"]
        assert 0 < row["gateway_p50_ms"] <= row["gateway_p95_ms"]
        assert row["added_p50_ms"] <= row["added_p95_ms"]
        assert row["ratio"] == row["gateway_p50_ms"] / row["direct_p50_ms"]
    table = out.read_text()
    assert all(f"| {name} | `{api.path}` |" in table for name, api in BY_NAME.items())
