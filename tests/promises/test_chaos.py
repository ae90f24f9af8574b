"""Chaos, bounded and on loopback: faults on every side, and afterwards nothing hangs or leaks.

3,000 mixed requests through the gateway to simulated replicas while 10% of clients leave at a
random moment (queued, before the first token, mid-stream), 5% of upstream streams are reset,
5% of upstream answers are 500s, and one replica is killed and later restarted.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass

import aiohttp

from loadtest.sim import Faults, ReplicaOptions, load_profile, start_replica
from tests.conftest import eventually

REQUESTS = 3000
USERS = 48
TIME_SCALE = 400  # simulated seconds per wall second: the fleet is fast, the gateway is the test


@dataclass
class Outcome:
    status: int | None = None  # None: the client left before an answer
    stream_error: bool = False
    left: bool = False


def policy(urls: list[str]) -> dict:
    health = {"interval_s": 0.1, "timeout_s": 0.5, "consecutive_failures": 3, "ejection_s": 0.5}
    pool = {"model": "gemma-3-12b-it", "max_concurrency": 8, "health": health,
            "queue": {"max_depth": 64, "max_wait_s": 5}}  # fmt: skip
    return {
        "models": {"gemma-3-12b-it": {"tokenizer": "estimate", "max_model_len": 128000}},
        "pools": {
            "classify": {**pool, "replicas": urls[:1]},
            "generate": {**pool, "replicas": urls[1:]},
        },
        "classes": [
            {
                "name": "prefill_heavy",
                "when": {"input_tokens": {"gte": 1000}, "output_tokens": {"lte": 64}},
            },
            {"name": "decode_heavy"},
        ],
        "routes": [
            {"match": {"model": "gemma-3", "class": "prefill_heavy"}, "pool": "classify"},
            {"match": {"model": "gemma-3"}, "pool": "generate"},
        ],
    }


def body(rng: random.Random) -> dict:
    if rng.random() < 0.5:  # classification: ~1,500 tokens in, 5 out
        words, max_tokens = 1500, 5
    else:  # generation: ~100 in, 40 out
        words, max_tokens = 100, 40
    return {
        "model": "gemma-3",
        "messages": [{"role": "user", "content": "word " * words}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": rng.random() < 0.7,
    }


async def one(http: aiohttp.ClientSession, url: str, i: int, rng: random.Random) -> Outcome:
    outcome = Outcome()
    leave_after = rng.uniform(0, 0.05) if rng.random() < 0.10 else None
    payload = body(rng)

    async def request() -> None:
        headers = {"x-request-id": f"chaos-{i}"}
        async with http.post(f"{url}/v1/chat/completions", json=payload, headers=headers) as resp:
            outcome.status = resp.status
            data = await resp.read()
            outcome.stream_error = resp.status == 200 and b'"error"' in data

    task = asyncio.create_task(request())
    if leave_after is None:
        await asyncio.wait_for(task, 60)  # none hang
    else:
        done, _ = await asyncio.wait({task}, timeout=leave_after)
        if not done:  # the client leaves: its connection closes mid-request
            task.cancel()
            outcome.left = True
            outcome.status = None
            await asyncio.gather(task, return_exceptions=True)
        else:
            task.result()
    return outcome


async def test_chaos(gateway_factory, http) -> None:
    profile = load_profile("gemma-3-12b-tpu-v6e-2x2")
    faulty = Faults(error_rate=0.05, reset_after_chunks=1, reset_rate=0.05)
    options = ReplicaOptions(time_scale=TIME_SCALE, faults=faulty, seed=1, stream_interval_ms=2)
    replicas = [await start_replica(profile, options) for _ in range(3)]
    try:
        gw = await gateway_factory(policy([r.url for r in replicas]))
        victim = replicas[2]  # one of the two generation replicas
        rng = random.Random(7)
        outcomes: dict[int, Outcome] = {}
        jobs: asyncio.Queue[int] = asyncio.Queue()
        for i in range(REQUESTS):
            jobs.put_nowait(i)
        killed = asyncio.Event()

        async def chaos_monkey() -> None:
            await eventually(lambda: len(outcomes) >= REQUESTS // 3, within_s=120)
            await victim.close()
            killed.set()
            await eventually(lambda: len(outcomes) >= 2 * REQUESTS // 3, within_s=120)
            replicas[2] = await start_replica(profile, options, port=victim.port)

        async def user() -> None:
            while not jobs.empty():
                i = jobs.get_nowait()
                outcomes[i] = await one(http, gw.url, i, rng)

        monkey = asyncio.create_task(chaos_monkey())
        async with asyncio.timeout(240):
            await asyncio.gather(*(user() for _ in range(USERS)))
            await monkey
        assert killed.is_set()

        # Nothing left behind: slots, tokens, queues.
        await eventually(
            lambda: gw.inflight() == 0 and gw.inflight_tokens() == 0 and gw.waiting() == 0
        )
        # The killed replica was ejected, then readmitted once it answered again.
        pool = gw.gateway.slots["generate"]
        assert any(url == victim.url for url, _ in pool.ejections)
        await eventually(lambda: all(r.up for r in pool.replicas), within_s=30)

        # Every request was accounted for once, and the gateway says what the clients saw.
        lines = [json.loads(x) for x in gw.access_log.getvalue().splitlines()]
        logged = {x["request_id"]: x for x in lines}
        assert len(logged) == len(lines)  # once each
        seen: Counter[int | None] = Counter()
        for i, outcome in outcomes.items():
            if outcome.left:  # cut off (499), answered just before it left, or never sent at all
                continue
            line = logged[f"chaos-{i}"]
            assert line["status"] == outcome.status, (i, line, outcome)
            if outcome.status == 200:  # a break after the first byte: an SSE error event
                broken = line["reason"] in ("upstream_error", "upstream_timeout")
                assert broken == outcome.stream_error, (i, line, outcome)
            seen[outcome.status] += 1
        assert sum(o.left for o in outcomes.values()) > REQUESTS * 0.02  # many left mid-request
        assert seen[200] > REQUESTS * 0.6
        assert any(o.stream_error for o in outcomes.values())  # resets mid-stream happened
        assert seen[500] > 0  # and the replica's 500s reached the clients intact
    finally:
        for replica in replicas:
            await replica.close()
