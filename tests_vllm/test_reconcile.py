"""Slot reconciliation reads real vLLM's own figures: a forced leak is detected and corrected."""

from __future__ import annotations

from tests_vllm.conftest import eventually, scrape, vllm_policy


async def test_drift_against_real_vllm_is_detected_and_corrected(
    vllm, gateway_factory, http
) -> None:
    policy = vllm_policy(vllm)
    policy["pools"]["main"]["health"] = {"reconcile_interval_s": 0.1}
    gw = await gateway_factory(policy)
    replica = gw.gateway.slots["main"].replicas[0]
    await eventually(lambda: replica.observed == 0, within_s=10)  # it read vLLM's gauges
    replica.inflight += 2  # a forced leak: counted here, held by nobody, unknown to vLLM
    await eventually(lambda: replica.inflight == 0, within_s=10)
    assert await scrape(http, gw.url, "llm_slot_drift_total") >= 2
    body = {"model": "tiny", "prompt": "the", "max_tokens": 3, "ignore_eos": True}
    async with http.post(f"{gw.url}/v1/completions", json=body) as resp:
        assert resp.status == 200  # the slots are whole again
