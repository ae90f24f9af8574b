"""`llm-gateway serve --workers 2` as the chart runs it: two gateway processes on one port sharing
Redis, under a parent that restarts, reloads, drains and serves the pod's one `/metrics`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.processes import free_port
from tests.conftest import basic_policy, eventually, write_policy
from tests.request.test_tenants import ACME_KEY, BATCH_KEY, hashed

ADMIN_TOKEN = "admin-token-for-the-pod"


@dataclass
class Pod:
    proc: asyncio.subprocess.Process
    url: str
    metrics_url: str
    log: list[str] = field(default_factory=list)  # the parent's and the workers' stderr

    def pids(self) -> dict[int, int]:
        """The running worker of each index, as the parent logged their starts."""
        started = (re.search(r"worker (\d+) started \(pid (\d+)\)", line) for line in self.log)
        return {int(m.group(1)): int(m.group(2)) for m in started if m}

    def listening(self) -> int:
        return sum("listening on" in line for line in self.log)

    async def samples(self, http: aiohttp.ClientSession, name: str) -> dict[str, float]:
        """`name`'s samples in the pod's scrape: its `worker` label (or "" for the parent's
        own) -> the sum of its samples there."""
        async with http.get(f"{self.metrics_url}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name:
                    worker = s.labels.get("worker", "")
                    found[worker] = found.get(worker, 0.0) + s.value
        return found


@contextlib.asynccontextmanager
async def pod(policy_path: Path, metrics_port: int, workers: int = 2) -> AsyncIterator[Pod]:
    """`llm-gateway serve --workers N`, once every worker listens; killed if still running."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--policy", str(policy_path), "--port", "0",
        "--workers", str(workers),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "LLM_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN},
        start_new_session=True,  # its own process group: the teardown kills every worker in it
    )  # fmt: skip
    assert proc.stderr is not None
    running = Pod(proc, "", f"http://127.0.0.1:{metrics_port}")

    async def read() -> None:
        assert proc.stderr is not None
        while line := (await proc.stderr.readline()).decode():
            running.log.append(line)

    reader = asyncio.create_task(read())
    try:
        await eventually(lambda: running.listening() == workers or reader.done(), within_s=60)
        assert not reader.done(), "".join(running.log)
        port = next(m.group(1) for line in running.log if (m := re.search(r":(\d+) \(", line)))
        running.url = f"http://127.0.0.1:{port}"
        yield running
    finally:
        # The whole group, workers included, even one whose start the log does not show yet: a
        # worker left alive holds the parent's stderr open, and the reader would wait on it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        await reader


def pod_policy(
    tokenizer_dir: Path, replica: str, redis_url: str, metrics_port: int
) -> dict[str, Any]:
    policy = basic_policy(tokenizer_dir, [replica], max_concurrency=4, queue={"fail_fast": False})
    policy["tenants"] = {
        "acme": {"keys": [hashed(ACME_KEY)], "rpm": 5},
        "batch": {"keys": [hashed(BATCH_KEY)]},  # no window: only the cap holds it
    }
    # Calls get 2 s: on a loaded machine one that timed out would send a worker to its local
    # share of the windows, and the exact counts below would not hold.
    policy["state"] = {"backend": "redis", "url": redis_url, "timeout_s": 2.0}
    policy["server"] = {"metrics_port": metrics_port, "readiness_delay_s": 0.2}
    policy["admin"] = {"watch_interval_s": 0}  # only a signal reloads
    return policy


BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 40}


async def chat(url: str, key: str = BATCH_KEY) -> tuple[int, dict[str, str]]:
    """One request on a connection of its own: the kernel picks its worker per connection."""
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json=BODY, headers=headers) as resp,
    ):
        await resp.read()
        return resp.status, dict(resp.headers)


async def test_memory_state_or_no_metrics_port_refuses_workers(tokenizer_dir, tmp_path) -> None:
    policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:9"])
    for server, wanted in (({"metrics_port": free_port()}, "state.backend: redis"), ({}, None)):
        policy["server"] = server
        if wanted is None:
            policy["state"] = {"backend": "redis"}
            wanted = "server.metrics_port"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--policy", str(write_policy(tmp_path, policy)),
            "--port", "0", "--workers", "2", stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        assert proc.returncode == 1 and wanted in err.decode(), err.decode()


async def test_two_workers_share_the_port_a_cap_and_a_tenants_window_exactly(
    stub_factory, tokenizer_dir, tmp_path, fresh_redis
) -> None:
    gate = asyncio.Event()
    stub = await stub_factory(gate=gate)
    metrics_port = free_port()
    policy = pod_policy(tokenizer_dir, stub.url, fresh_redis.url, metrics_port)
    async with (
        pod(write_policy(tmp_path, policy), metrics_port) as running,
        aiohttp.ClientSession() as http,
    ):

        async def waiting() -> float:
            return sum((await running.samples(http, "llm_queue_depth")).values())

        async with http.get(f"{running.metrics_url}/readyz") as resp:  # every worker's
            assert resp.status == 200 and (await resp.json())["ready"] is True

        # The tenant's window, 5 requests a minute: a burst of 12 on both workers, held at the
        # replica, takes exactly 5; a window per worker would grant 5 on each.
        burst = [asyncio.create_task(chat(running.url, ACME_KEY)) for _ in range(12)]
        await eventually(lambda: sum(task.done() for task in burst) >= 7, within_s=20)
        assert [t.result()[0] for t in burst if t.done()] == [429] * 7
        async with asyncio.timeout(20):  # the 5 granted reach the replica or wait for a slot
            while stub.stats.running + await waiting() != 5:  # noqa: ASYNC110 - another process
                await asyncio.sleep(0.05)
        gate.set()
        answers = await asyncio.gather(*burst)
        assert sorted(status for status, _ in answers) == [200] * 5 + [429] * 7
        granted = sorted(int(h["x-ratelimit-remaining-requests"]) for s, h in answers if s == 200)
        assert granted == [0, 1, 2, 3, 4]  # one window: each grant saw the one before it

        # The cap: 12 requests held on a replica of 4 slots, from both workers.
        stub.config.gate = gate = asyncio.Event()
        stub.stats.max_running = 0
        held = [asyncio.create_task(chat(running.url)) for _ in range(12)]
        await eventually(lambda: stub.stats.running == 4, within_s=20)
        async with asyncio.timeout(20):
            while await waiting() != 8:  # noqa: ASYNC110 - another process
                await asyncio.sleep(0.05)
        assert stub.stats.max_running == 4  # every request is in a gateway: none took a 5th
        gate.set()
        assert [status for status, _ in await asyncio.gather(*held)] == [200] * 12
        assert stub.stats.max_running == 4
        served = await running.samples(http, "llm_requests_total")
        assert served.keys() == {"0", "1"} and sum(served.values()) == 24, served  # spread


async def test_a_restart_that_dies_before_serving_is_tried_again_and_the_pod_serves_on(
    stub_factory, tokenizer_dir, tmp_path, fresh_redis
) -> None:
    """Only a worker's first start dying before it serves stops the pod (a policy that cannot
    load); a restart killed as it loads (the OOM killer at its load's peak) is tried again."""
    stub = await stub_factory()
    metrics_port = free_port()
    path = write_policy(
        tmp_path, pod_policy(tokenizer_dir, stub.url, fresh_redis.url, metrics_port)
    )
    async with pod(path, metrics_port) as running:
        victim = running.pids()[0]
        os.kill(victim, signal.SIGKILL)
        await eventually(lambda: running.pids()[0] != victim, within_s=30)
        loading = running.pids()[0]
        os.kill(loading, signal.SIGKILL)  # still importing: it has not served
        await eventually(lambda: running.listening() == 3, within_s=60)
        assert running.proc.returncode is None
        assert running.pids()[0] not in (victim, loading)
        assert "before serving: starting it again" in "".join(running.log)
        assert (await chat(running.url))[0] == 200


async def test_a_killed_worker_restarts_a_reload_reaches_both_and_sigterm_drains(
    stub_factory, tokenizer_dir, tmp_path, fresh_redis
) -> None:
    gate = asyncio.Event()
    stub = await stub_factory(gate=gate)
    metrics_port = free_port()
    policy = pod_policy(tokenizer_dir, stub.url, fresh_redis.url, metrics_port)
    path = write_policy(tmp_path, policy)
    async with pod(path, metrics_port) as running, aiohttp.ClientSession() as http:

        async def ready() -> int:
            """The pod's readiness, as the chart's probe reads it with N > 1."""
            async with http.get(f"{running.metrics_url}/readyz") as resp:
                return resp.status

        assert await ready() == 200  # both serve
        victim = running.pids()[0]
        os.kill(victim, signal.SIGKILL)
        await eventually(lambda: running.pids()[0] != victim, within_s=30)
        # While it loads, the other serves every client (the new one listens once it serves).
        assert await ready() == 200
        await eventually(lambda: running.listening() == 3, within_s=60)
        assert running.pids()[0] != victim
        # The new worker opened no "starting" listener: its 503s would reach the other's clients.
        assert "".join(running.log).count("answering probes") == 2
        restarts = await running.samples(http, "llm_gateway_worker_restarts_total")
        assert restarts == {"": 1.0}
        assert await running.samples(http, "llm_gateway_workers") == {"": 2.0}

        async def digests() -> set[str]:
            """The policy each worker runs, by its hash."""
            async with http.get(f"{running.metrics_url}/metrics") as resp:
                text = await resp.text()
            return set(re.findall(r'llm_policy_info\{hash="(\w+)",worker="\d"\}', text))

        async def all_run_one_other_than(before: set[str]) -> None:
            async with asyncio.timeout(30):
                while len(found := await digests()) != 1 or found == before:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)

        # SIGHUP to the parent reaches both workers.
        before = await digests()
        policy["routes"][0]["match"]["model"] = ["tiny", "after-hup"]
        path.write_text(yaml.safe_dump(policy))
        running.proc.send_signal(signal.SIGHUP)
        await all_run_one_other_than(before)
        # `/admin/reload` is answered by one worker; the other reloads too, through the parent.
        before = await digests()
        policy["routes"][0]["match"]["model"] = ["tiny", "after-admin"]
        path.write_text(yaml.safe_dump(policy))
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with http.post(f"{running.url}/admin/reload", headers=admin) as resp:
            assert resp.status == 200
        await all_run_one_other_than(before)

        inflight = [asyncio.create_task(chat(running.url)) for _ in range(4)]
        await eventually(lambda: stub.stats.running == 4, within_s=20)
        running.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)  # readiness off, draining: the held requests still run
        gate.set()
        assert [s for s, _ in await asyncio.gather(*inflight)] == [200] * 4
        assert await asyncio.wait_for(running.proc.wait(), 30) == 0
        assert stub.stats.disconnects == 0
