"""`loadtest.paired_latency` against real servers on loopback: what it counts and what it skips."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from loadtest.paired_latency import added, measure
from tests.conftest import _serve


class Target:
    """An answering server that records the order of what it was sent."""

    def __init__(self, name: str, log: list[str], delay_s: float = 0.0, fail_every: int = 0):
        self.name, self.log, self.delay_s, self.fail_every = name, log, delay_s, fail_every
        self.seen = itertools.count(1)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        n = next(self.seen)
        self.log.append(self.name)
        await asyncio.sleep(self.delay_s)
        if self.fail_every and n % self.fail_every == 0:
            return web.json_response({"error": "busy"}, status=503)
        return web.json_response({"echo": body["n"]})


@pytest.fixture
async def targets() -> AsyncIterator[tuple[dict[str, int], list[str]]]:
    log: list[str] = []
    specs = {
        "direct": Target("direct", log),
        "slow": Target("slow", log, delay_s=0.004),
        "flaky": Target("flaky", log, fail_every=4),
    }
    runners = []
    ports = {}
    for name, target in specs.items():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", target.handle)
        runner, url = await _serve(app)
        runners.append(runner)
        ports[name] = int(url.rsplit(":", 1)[1])
    try:
        yield ports, log
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_each_target_gets_whole_blocks_and_the_first_of_each_are_not_counted(
    targets: tuple[dict[str, int], list[str]],
) -> None:
    ports, log = targets
    result = await measure(ports, b'{"n": 1}', rotations=3, block=4, skip=1)

    # 3 rotations x 4 requests, in runs of 4 to one target: each block served back to back.
    assert len(log) == 3 * 3 * 4
    blocks = [log[i : i + 4] for i in range(0, len(log), 4)]
    assert all(len(set(block)) == 1 for block in blocks)
    assert sorted(block[0] for block in blocks) == sorted(list(ports) * 3)
    assert result["direct"]["requests"] == 3 * (4 - 1) and result["direct"]["errors"] == 0
    # Every 4th answer of the flaky one is a 503: counted as an error, never as a latency.
    assert result["flaky"]["errors"] == 3 and result["flaky"]["requests"] == 3 * 2
    # The slow target's 4 ms shows in its p50, beside the others in the same rotations.
    assert result["slow"]["p50_ms"] >= 4.0 > result["direct"]["p50_ms"]


async def test_with_a_baseline_each_counted_request_is_paired_with_the_baselines_in_its_slot(
    targets: tuple[dict[str, int], list[str]],
) -> None:
    ports, _ = targets
    result = await measure(ports, b'{"n": 1}', rotations=3, block=4, skip=1, baseline="direct")
    assert "added" not in result["direct"]
    assert result["slow"]["added"]["pairs"] == 3 * 3
    # The flaky target's failed 4th request of each block has no pair: 2 a rotation are left.
    assert result["flaky"]["added"]["pairs"] == 3 * 2
    assert result["flaky"]["p95_ms"] is not None


def test_added_is_the_median_and_p95_of_the_differences_where_both_answered() -> None:
    target = [0.003, None, 0.010, 0.004, 0.005]
    baseline = [0.001, 0.001, None, 0.001, 0.001]
    assert added(target, baseline) == pytest.approx({"p50_ms": 3.0, "p95_ms": 4.0, "pairs": 3})
    assert added([None], [0.001]) == {"p50_ms": None, "p95_ms": None, "pairs": 0}


async def test_the_time_limit_ends_it_between_rotations(
    targets: tuple[dict[str, int], list[str]],
) -> None:
    ports, log = targets
    result = await measure({"slow": ports["slow"]}, b'{"n": 1}', rotations=1000, block=5, skip=0,
                           limit_s=0.05)  # fmt: skip
    assert 5 <= result["slow"]["requests"] < 1000 * 5
    assert len(log) % 5 == 0


async def test_the_command_prints_how_it_measured(
    targets: tuple[dict[str, int], list[str]], tmp_path: Path
) -> None:
    ports, _ = targets
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"n": 2}))
    argv = [sys.executable, "-m", "loadtest.paired_latency", "--body", str(body)]
    argv += ["--rotations", "2", "--block", "3", "--skip", "1", f"direct={ports['direct']}"]
    argv += [f"slow={ports['slow']}", "--baseline", "direct"]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)  # the servers run on this loop
    assert proc.returncode == 0
    printed = json.loads(out)
    assert printed["targets"]["direct"]["requests"] == 2 * 2
    assert printed["targets"]["slow"]["added"]["pairs"] == 2 * 2
    assert "2 rotations of a block of 3 requests" in printed["shape"]
