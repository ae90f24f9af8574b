"""`llm-gateway serve` as an operator runs it: JSON access log on stdout, SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys

import aiohttp

from tests.conftest import basic_policy, eventually, write_policy


async def start_serve(policy_path) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--policy", str(policy_path), "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    async with asyncio.timeout(60):
        while True:
            line = (await proc.stderr.readline()).decode()
            assert line, "gateway exited before listening"
            if match := re.search(r"listening on (http://\S+)", line):
                return proc, match.group(1)


async def test_sigterm_turns_readiness_off_and_drains_in_flight(
    stub_factory, tokenizer_dir, tmp_path
) -> None:
    slow = await stub_factory(delay_s=1.5)
    policy = basic_policy(tokenizer_dir, [slow.url])
    policy["server"] = {"readiness_delay_s": 0.5, "drain_grace_s": 10}
    proc, url = await start_serve(write_policy(tmp_path, policy))
    try:
        async with aiohttp.ClientSession() as http:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "slow one"}],
                "max_tokens": 3,
            }
            inflight = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=body))
            await eventually(lambda: slow.stats.running == 1)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            async with http.get(f"{url}/readyz") as resp:
                assert resp.status == 503
            resp = await inflight
            assert resp.status == 200 and (await resp.json())["choices"]
            resp.release()
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        assert proc.stdout is not None
        lines = [json.loads(line) for line in (await proc.stdout.read()).splitlines()]
        served = [x for x in lines if x["status"] == 200]
        assert len(served) == 1 and served[0]["pool"] == "main" and served[0]["replica"] == slow.url
        assert set(served[0]) >= {"request_id", "model", "class", "input_tokens", "expected_output_tokens",
                                  "output_tokens", "estimate_source", "queue_wait_s", "ttft_s", "e2e_s", "reason"}  # fmt: skip
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
