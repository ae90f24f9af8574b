"""While `llm-gateway serve` loads its policy and tokenizers, its listener answers the probes:
alive, not ready, every other request refused 503 `starting`; ready only once loaded and warm.

The load is held still deterministically: the policy's tenant keys file is a FIFO, which the
policy's compilation (on a thread, after the listener opened) reads only once the test writes
the key into it."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import aiohttp

from tests.conftest import Stub, basic_policy, write_policy

KEY = "sk-starting-test-key"


async def line_matching(stream: asyncio.StreamReader, pattern: str) -> re.Match[str]:
    async with asyncio.timeout(60):
        while True:
            line = (await stream.readline()).decode()
            assert line, "the gateway exited"
            if match := re.search(pattern, line):
                return match


async def test_probes_answer_during_the_load_and_readiness_waits_for_it(
    tmp_path: Path, tokenizer_dir: Path, stub: Stub, http: aiohttp.ClientSession
) -> None:
    keys = tmp_path / "keys"
    os.mkfifo(keys)
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["tenants"] = {"team": {"keys_file": "keys"}}
    path = write_policy(tmp_path, policy)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", "0",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        url = (await line_matching(proc.stderr, r"answering probes on (http://\S+)")).group(1)
        async with http.get(f"{url}/healthz") as resp:
            assert resp.status == 200  # alive: a liveness probe passes however long the load
        async with http.get(f"{url}/readyz") as resp:
            assert (resp.status, (await resp.json())["starting"]) == (503, True)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {KEY}"}
        async with http.post(f"{url}/v1/chat/completions", json=chat, headers=headers) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "starting"
        async with http.post(f"{url}/v1/messages", json=chat, headers=headers) as resp:
            body = await resp.json()  # Anthropic's shape on its path
            assert (resp.status, body["type"], body["error"]["type"]) == (503, "error", "api_error")
        assert stub.stats.requests == 0  # nothing reached a replica

        await asyncio.to_thread(keys.write_text, KEY + "\n")  # the load goes on
        served = (await line_matching(proc.stderr, r"listening on (http://\S+)")).group(1)
        assert served == url  # the same port, `--port 0` or not
        async with http.get(f"{url}/readyz") as resp:
            assert resp.status == 200
        async with http.post(f"{url}/v1/chat/completions", json=chat, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
    finally:
        proc.kill()
        await proc.wait()


async def test_a_policy_that_fails_to_load_ends_the_process(tmp_path: Path) -> None:
    """The listener opened for the probes closes with it: the pod restarts, as before."""
    policy = basic_policy(tmp_path / "no-tokenizer", ["http://127.0.0.1:9"])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--policy", str(write_policy(tmp_path, policy)),
        "--port", "0", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(60):
        _, err = await proc.communicate()
    assert proc.returncode == 1
    assert "models.tiny.tokenizer: tokenizer directory" in err.decode()
