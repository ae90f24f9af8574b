"""`llm-gateway serve` as an operator runs it: JSON access log on stdout, SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
import yaml

from tests.conftest import basic_policy, eventually, serving, write_policy


async def test_sigterm_turns_readiness_off_and_drains_in_flight(
    stub_factory, tokenizer_dir, tmp_path
) -> None:
    slow = await stub_factory(delay_s=1.5)
    policy = basic_policy(tokenizer_dir, [slow.url])
    policy["server"] = {"readiness_delay_s": 0.5, "drain_grace_s": 10}
    async with serving(write_policy(tmp_path, policy)) as (proc, url):
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


async def test_sigterm_during_50_open_streams(stub_factory, tokenizer_dir, tmp_path) -> None:
    streaming = await stub_factory(chunk_delay_s=0.02)
    policy = basic_policy(tokenizer_dir, [streaming.url], max_concurrency=64)
    policy["server"] = {"drain_grace_s": 20}
    async with serving(write_policy(tmp_path, policy)) as (proc, url):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 60,
            "stream": True,
        }
        async with aiohttp.ClientSession() as http:

            async def stream() -> bytes:
                async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    return await resp.read()

            streams = [asyncio.create_task(stream()) for _ in range(50)]
            await eventually(lambda: streaming.stats.running == 50, within_s=20)
            proc.send_signal(signal.SIGTERM)
            port = int(url.rsplit(":", 1)[1])

            async def refused() -> bool:
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    return True
                writer.close()
                return False

            async with asyncio.timeout(10):
                while not await refused():  # noqa: ASYNC110 - polling another process
                    await asyncio.sleep(0.02)
            bodies = await asyncio.gather(*streams)
        assert all(b.endswith(b"data: [DONE]\n\n") for b in bodies)
        assert streaming.stats.completed == 50 and streaming.stats.disconnects == 0
        assert await asyncio.wait_for(proc.wait(), 20) == 0


async def test_sighup_reloads_the_policy(stub, tokenizer_dir, tmp_path) -> None:
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["admin"] = {"watch_interval_s": 0}  # only the signal reloads
    path = write_policy(tmp_path, policy)
    async with serving(path) as (proc, url):
        policy["routes"][0]["match"]["model"] = ["tiny", "after-hup"]
        path.write_text(yaml.safe_dump(policy))
        proc.send_signal(signal.SIGHUP)
        async with aiohttp.ClientSession() as http:

            async def served() -> list[str]:
                async with http.get(f"{url}/v1/models") as resp:
                    return [m["id"] for m in (await resp.json())["data"]]

            async with asyncio.timeout(20):
                while "after-hup" not in await served():  # noqa: ASYNC110 - another process
                    await asyncio.sleep(0.05)


async def test_shutdown_past_the_grace_period_closes_upstream(
    stub_factory, tokenizer_dir, tmp_path
) -> None:
    endless = await stub_factory(chunk_delay_s=0.05)
    policy = basic_policy(tokenizer_dir, [endless.url])
    policy["server"] = {"drain_grace_s": 0.5}
    async with serving(write_policy(tmp_path, policy)) as (proc, url):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 2000,
            "stream": True,
        }
        async with aiohttp.ClientSession() as http:
            resp = await http.post(f"{url}/v1/chat/completions", json=body)
            await resp.content.readline()
            proc.send_signal(signal.SIGTERM)
            await eventually(lambda: endless.stats.disconnects == 1, within_s=20)
            resp.close()
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        assert endless.stats.running == 0 and endless.stats.completed == 0
