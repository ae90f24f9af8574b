"""`make demo`'s entry point runs to the end: simulated replicas, the gateway, a mixed load
(classification, generation, retrieval, an agent), a report, all in one clock (simulated seconds),
the gateway on a copy of the policy scaled to the wall clock."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_demo_runs_and_reports_each_workload_in_its_pool(tmp_path, tokenizer_dir) -> None:
    policy = yaml.safe_load((ROOT / "policies" / "demo.yaml").read_text())
    for model in policy["models"].values():
        model["tokenizer"] = str(tokenizer_dir)
    for pool in policy["pools"].values():
        pool["replicas"] = [f"http://127.0.0.1:{free_port()}" for _ in pool["replicas"]]
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(policy))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "loadtest.demo", "--policy", str(path), "--port", str(free_port()),
         "--rate", "1.5", "--duration", "40", "--out", str(out)],
        capture_output=True, text=True, timeout=170, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = (out / "demo.md").read_text()
    rows = {line.split(" | ")[0][2:]: line for line in report.splitlines() if line.startswith("| ")}
    # Each workload of the mix in the pool its class goes to: the article's two, retrieval
    # (prefill only, whatever its length) and the agent's calls beside classification, the
    # agent's conversation turns (150 out) beside generation.
    for workload, route in {
        "classification": "prefill_heavy -> classify-27b",
        "generation": "decode_heavy -> generate-12b",
        "retrieval": "prefill_only -> classify-27b",
        "agent-calls": "prefill_heavy -> classify-27b",
        "agent-turns": "decode_heavy -> generate-12b",
    }.items():
        assert f" | {route} | " in rows[workload], rows
    assert "retrieval: " in result.stdout and "completed in pool classify-27b" in result.stdout
    assert {p.name for p in out.iterdir()} >= {
        "report.md", "results.json", "access.jsonl", "throughput.png", "latency.png"
    }  # fmt: skip
    assert "Traceback" not in result.stderr

    # One clock: the policy's times, the rate and every figure printed are simulated seconds; only
    # the gateway's copy of the policy is on the wall clock (time scale 10).
    assert "in simulated seconds" in result.stdout and "wall" not in result.stdout
    assert (
        "sending 1.5 req/s of classification, generation, retrieval and agent traffic for 40s"
        in result.stdout
    )
    assert "| generation | " in result.stdout and "| 4 x 1 | 30.00s |" in result.stdout
    assert "completed in pool generate-12b" in result.stdout
    copy = yaml.safe_load((out / "gateway-policy.yaml").read_text())
    for name, pool in policy["pools"].items():
        assert copy["pools"][name]["queue"]["max_wait_s"] == pool["queue"]["max_wait_s"] / 10
    assert "Normalised" not in (out / "report.md").read_text()


def test_the_gateways_copy_rebases_relative_paths_and_leaves_estimate_alone(tmp_path) -> None:
    from loadtest.demo import ensure_tokenizers, gateway_policy

    source = tmp_path / "policies" / "mine.yaml"
    policy = {
        "models": {"m": {"tokenizer": "estimate"}, "n": {"max_model_len": 8}},
        "pools": {"p": {"queue": {"max_wait_s": 30}}},
        "tenants": {"t": {"keys_file": "keys.txt"}},
    }
    assert ensure_tokenizers(policy, source.parent) is None  # nothing to build
    copy = yaml.safe_load(gateway_policy(policy, source, 10.0, tmp_path / "copy.yaml").read_text())
    assert copy["models"] == {"m": {"tokenizer": "estimate"}, "n": {"max_model_len": 8}}
    assert copy["tenants"]["t"]["keys_file"] == str(source.parent.resolve() / "keys.txt")
    assert copy["pools"]["p"]["queue"]["max_wait_s"] == 3.0
