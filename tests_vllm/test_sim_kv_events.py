"""The simulator's KV-cache events against real vLLM's: the same prompt to each, both started
with the same `--kv-events-config`, and the same framing, batch layout, event types, keys and
value types, so a consumer built on the simulator (the `precise_prefix` scorer) reads vLLM's.
With the model's own tokenizer and vLLM's block size, the stored blocks' token ids agree too."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest.sim import ReplicaOptions, load_profile, start_replica
from loadtest.sim.kv_events import KVEventsConfig
from loadtest.vllm_server import SERVED_NAME, VLLMServer, serve_vllm
from tests.loadtest.test_sim_kv_events import Message, events_of, received, subscriber
from tests_vllm.conftest import EAGER

PROMPT = "the seller lists a lamp with a lithium battery and no certificate. " * 40
VLLM_QUIET_S = 2.0  # vLLM publishes from its engine process's own thread


@pytest.fixture(scope="module")
def vllm_events(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMServer, str]]:
    """A vLLM of its own for this module, publishing its KV-cache events on an ipc endpoint."""
    python, model_dir = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_MODEL_DIR")
    if not python or not model_dir:
        pytest.fail("VLLM_PYTHON and VLLM_MODEL_DIR must be set: run `make test-vllm`")
    base = tmp_path_factory.mktemp("vllm-kv")
    endpoint = f"ipc://{base / 'kv'}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": ""}
    flags = [EAGER, "--kv-events-config", json.dumps(config)]
    with serve_vllm(
        python, Path(model_dir).resolve(), base / "vllm.log", extra_args=flags
    ) as server:
        yield server, endpoint


async def events_for(url: str, model: str, endpoint: str, quiet_s: float) -> list[Message]:
    async with subscriber(endpoint) as sub, aiohttp.ClientSession() as http:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
        return await received(sub, quiet_s)


def shape(event: dict[str, Any]) -> dict[str, str]:
    """An event's keys and the type of each value (a list: of its first item)."""
    return {
        key: f"list[{type(value[0]).__name__}]" if isinstance(value, list) and value
        else type(value).__name__
        for key, value in event.items()
    }  # fmt: skip


async def test_simulator_events_are_framed_and_shaped_as_vllms(
    vllm_events: tuple[VLLMServer, str], tmp_path: Path
) -> None:
    server, endpoint = vllm_events
    real = await events_for(server.url, SERVED_NAME, endpoint, VLLM_QUIET_S)
    assert real, "vLLM published nothing"
    block_size = events_of(real)[0]["block_size"]
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path / 'kv'}")
    profile = load_profile("gemma-3-12b-tpu-v6e-2x2").with_serving(block_size=block_size)
    options = ReplicaOptions(tokenizer=server.model_dir, served_model_names=(SERVED_NAME,),
                             kv_events_config=config)  # fmt: skip
    sim = await start_replica(profile, options)
    try:
        simulated = await events_for(sim.url, SERVED_NAME, config.endpoint, VLLM_QUIET_S)
        async with aiohttp.ClientSession() as http:
            sources = {}
            for url in (server.url, sim.url):
                async with http.get(f"{url}/kv_event_sources") as resp:
                    sources[url] = await resp.json()
    finally:
        await sim.close()
    assert simulated, "the simulator published nothing"
    for messages in (real, simulated):
        assert [seq for _, seq, _ in messages] == list(range(len(messages)))
        assert {topic for topic, _, _ in messages} == {b""}
        for _, _, batch in messages:
            ts, events, rank = batch  # [ts, events, data_parallel_rank]
            assert isinstance(ts, float) and isinstance(events, list) and rank == 0
    real_events, sim_events = events_of(real), events_of(simulated)
    assert {e["type"] for e in real_events} == {"BlockStored"}  # nothing evicted, nothing reset
    assert {e["type"] for e in sim_events} == {"BlockStored"}
    # Each side's first event holds the prompt's full blocks (vLLM may store a block of output
    # later, which the simulator cannot: it does not know those tokens).
    first_real, first_sim = real_events[0], sim_events[0]
    assert shape(first_sim) == shape(first_real), (first_sim, first_real)
    assert (first_sim["parent_block_hash"], first_real["parent_block_hash"]) == (None, None)
    assert first_sim["block_size"] == block_size and first_sim["token_ids"]
    assert first_sim["token_ids"] == first_real["token_ids"][: len(first_sim["token_ids"])]
    assert sources[sim.url]["0"].keys() == sources[server.url]["0"].keys()
    assert sources[server.url]["0"]["endpoint"] == endpoint
