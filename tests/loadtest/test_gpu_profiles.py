"""The GPU fleets' simulated replicas (Llama 3.1 8B and 70B on H100 and H200): their figures
follow from the published specs by the roofline, as the TPU profiles' do, and a replica of each
serves requests."""

from __future__ import annotations

import pytest

from loadtest.sim import ReplicaOptions, load_profile, start_replica
from loadtest.sim.profiles import bundled_profiles, cache_geometry
from loadtest.sim.roofline import Roofline

GPU = {
    "llama-3.1-8b-h100": "llama-3.1-8b-h200",
    "llama-3.1-70b-h100-tp4": "llama-3.1-70b-h200-tp4",
}


def test_the_gpu_profiles_are_bundled_and_their_models_sized_as_published() -> None:
    assert set(GPU) | set(GPU.values()) <= set(bundled_profiles())
    # Untied heads: Llama holds its input embedding and its output head, 2 x 128,256 x hidden.
    assert round(load_profile("llama-3.1-8b-h100").model.total_params / 1e9, 2) == 8.03
    assert round(load_profile("llama-3.1-70b-h100-tp4").model.total_params / 1e9, 1) == 70.6


@pytest.mark.parametrize(("h100", "h200"), GPU.items())
def test_h200_decodes_faster_by_its_bandwidth_and_holds_more_kv(h100: str, h200: str) -> None:
    slow, fast = load_profile(h100), load_profile(h200)
    # A decode step is memory bound: without the fixed per-step overhead, its time scales
    # with 1 / HBM bandwidth (3.35 TB/s against 4.8).
    ratio = slow.hardware.hbm_bandwidth_per_chip / fast.hardware.hbm_bandwidth_per_chip
    for batch in (1, 64):
        steps = [
            Roofline(p).decode_time(batch, batch * 1500, 0) - p.hardware.step_overhead_s
            for p in (slow, fast)
        ]
        assert steps[1] / steps[0] == pytest.approx(ratio, rel=0.02)
    # KV capacity is HBM x 0.9 less the weights and the activation reserve: 141 GB a GPU
    # against 80 more than doubles what is left for the cache.
    kv = [cache_geometry(p).kv_budget_bytes for p in (slow, fast)]
    weights = slow.model.total_params * slow.model.dtype_bytes
    hbm = slow.hardware.chips * slow.hardware.hbm_bytes_per_chip
    assert kv[0] == pytest.approx(hbm * 0.9 - weights - slow.serving.activation_reserve_bytes)
    assert kv[1] > 2 * kv[0]


async def test_a_simulated_h100_replica_serves_a_chat(http) -> None:
    profile = load_profile("llama-3.1-8b-h100")
    replica = await start_replica(profile, ReplicaOptions(time_scale=1000))
    try:
        body = {
            "model": profile.served_model_name,
            "messages": [{"role": "user", "content": "hello " * 100}],
            "max_tokens": 8,
            "ignore_eos": True,
        }
        async with http.post(f"{replica.url}/v1/chat/completions", json=body) as resp:
            answer = await resp.json()
        assert answer["usage"]["completion_tokens"] == 8
    finally:
        await replica.close()
