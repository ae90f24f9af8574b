"""The simulator's /metrics against real vLLM's: for every `vllm:` family the simulator imitates,
real vLLM exposes the same name, type and label names, so dashboards and alerts built on the
simulator work on vLLM unchanged."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.sim import Replica, ReplicaOptions, load_profile, start_replica
from tests_vllm.conftest import vllm_policy

Shape = dict[str, tuple[str, frozenset[frozenset[str]]]]


async def exposition(http: aiohttp.ClientSession, url: str) -> Shape:
    """Per `vllm:` family: its type and the label-name sets of its samples (`le` aside)."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {
        f.name: (f.type, frozenset(frozenset(s.labels) - {"le"} for s in f.samples))
        for f in text_string_to_metric_families(text)
        if f.name.startswith("vllm:")
    }


@pytest.fixture
async def sim() -> AsyncIterator[Replica]:
    replica = await start_replica(load_profile("gemma-3-12b-tpu-v6e-2x2"), ReplicaOptions())
    yield replica
    await replica.close()


async def test_simulator_families_match_real_vllm(vllm, sim, gateway_factory, http) -> None:
    # One request through the gateway first, so every histogram on both sides has samples.
    gw = await gateway_factory(vllm_policy(vllm))
    body = {"model": "tiny", "prompt": "the seller", "max_tokens": 3}
    async with http.post(f"{gw.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
    served = sim.state.model_names[0]
    async with http.post(f"{sim.url}/v1/completions", json={**body, "model": served}) as resp:
        assert resp.status == 200
    simulated, real = await exposition(http, sim.url), await exposition(http, vllm.url)
    assert simulated, "the simulator exposes no vllm: family"
    missing = sorted(set(simulated) - set(real))
    differ = {
        name: {"sim": shape, "vllm": real[name]}
        for name, shape in simulated.items()
        if name in real and shape != real[name]
    }
    assert not missing and not differ, (missing, differ)
