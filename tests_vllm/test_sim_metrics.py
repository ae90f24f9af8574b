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


PREFIX_FAMILIES = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens_cached",
)


async def counters(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {
        f.name: sum(s.value for s in f.samples if s.name.endswith("_total"))
        for f in text_string_to_metric_families(text)
        if f.name in PREFIX_FAMILIES
    }


async def test_prefix_cache_counters_are_vllms_and_count_alike(vllm, sim, http) -> None:
    """The prefix cache's families exist on both sides (names, types and labels are checked
    above), and a repeated prompt moves them the same way: every queried token counted, the
    second request's full blocks hit (real vLLM caches prefixes by default, as V1 does; the
    simulated 12B's blocks are 512 tokens, so the prompt is longer than two)."""
    prompt = "the seller lists a lamp with a lithium battery and no certificate. " * 90
    moved = {}
    for url, model in ((vllm.url, "tiny"), (sim.url, sim.state.model_names[0])):
        before = await counters(http, url)
        for _ in range(2):
            body = {"model": model, "prompt": prompt, "max_tokens": 1}
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200
        after = await counters(http, url)
        assert set(after) == set(PREFIX_FAMILIES), (url, sorted(after))
        moved[url] = {name: after[name] - before.get(name, 0.0) for name in PREFIX_FAMILIES}
    for url, delta in moved.items():
        queries, hits = delta["vllm:prefix_cache_queries"], delta["vllm:prefix_cache_hits"]
        assert queries > 0 and 0 < hits < queries / 2 + 1, (url, delta)  # the second's blocks
        assert delta["vllm:prompt_tokens_cached"] == hits, (url, delta)
