"""Traces into real vLLM: the gateway forwards its upstream span's context, and vLLM's own span
(`--otlp-traces-endpoint`, exported over OTLP/HTTP to the session's `receiver`) is that span's
child, in the client's trace. The same vLLM (the session's second, `vllm_lora`) reports its
prefix-cache hits (`--enable-prompt-tokens-details`): the gateway logs what it says."""

from __future__ import annotations

from typing import Any

import orjson

from tests_vllm.conftest import eventually, vllm_policy

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
RULES = "You label product reviews as positive or negative. " * 30


async def test_vllms_span_is_a_child_of_the_gateways_upstream_span(
    vllm_lora, receiver, gateway_factory, http, monkeypatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    policy = vllm_policy(vllm_lora)
    policy["tracing"] = {"endpoint": receiver.url, "service_name": "gateway"}
    gw = await gateway_factory(policy)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"traceparent": f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        await resp.read()

    def upstream() -> list[Any]:
        return [s for s in receiver.named("gateway") if s.name == "upstream"]

    def in_trace() -> list[Any]:  # vLLM's own start-up spans are in traces of their own
        return [s for s in receiver.named("vllm") if s.trace_id.hex() == CLIENT_TRACE]

    await eventually(lambda: upstream() and in_trace(), within_s=30)
    (sent,) = upstream()
    ours = in_trace()
    assert all(s.parent_span_id == sent.span_id for s in ours), [
        (s.name, s.parent_span_id.hex()) for s in ours
    ]
    print(f"vLLM's spans in the client's trace: {[s.name for s in ours]}")


async def test_cached_tokens_are_what_vllm_reports(vllm_lora, gateway_factory, http) -> None:
    gw = await gateway_factory(vllm_policy(vllm_lora))
    reported = []
    for question in ("Is the kettle good?", "Is the toaster good?"):
        messages = [{"role": "system", "content": RULES}, {"role": "user", "content": question}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 2}
        async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            answer = await resp.json()
        reported.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    await eventually(lambda: gw.access_log.getvalue().count(b"\n") == 2)
    logged = [orjson.loads(line)["cached_tokens"] for line in gw.access_log.getvalue().splitlines()]
    assert logged == reported
    print(f"cached tokens reported by vLLM: {reported}")
