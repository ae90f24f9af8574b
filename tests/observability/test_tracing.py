"""Traces: the gateway's spans, exported over OTLP/HTTP to a receiver here (decoded with
opentelemetry-proto, as a collector decodes them), continue the client's `traceparent`, and the
replica gets the upstream span's context, so its own spans join the trace."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.conftest import _serve, accounted, basic_policy, eventually, serving, write_policy
from tests.request.test_tenants import hashed

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
KEY = "sk-tenant-traced-0123456789"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


@dataclass
class Receiver:
    url: str
    spans: list[Any] = field(default_factory=list)

    def named(self, name: str) -> list[Any]:
        return [s for s in self.spans if s.name == name]


@pytest.fixture
async def receiver(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Receiver]:
    """An OTLP/HTTP traces endpoint; the SDK's batches are sent every 50 ms."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    got = Receiver("")

    async def export(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest.FromString(await request.read())
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                got.spans.extend(scope.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    runner, url = await _serve(app)
    got.url = f"{url}/v1/traces"
    yield got
    await runner.cleanup()


def traced(policy: dict[str, Any], receiver: Receiver, **tracing: Any) -> dict[str, Any]:
    return {**policy, "tracing": {"endpoint": receiver.url, **tracing}}


def attributes(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


async def test_a_request_continues_the_clients_trace_into_the_replica(
    receiver, stub, gateway_factory, tokenizer_dir, http
) -> None:
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["tenants"] = {"acme": {"keys": [hashed(KEY)]}}
    gw = await gateway_factory(traced(policy, receiver))
    headers = {
        "Authorization": f"Bearer {KEY}",
        "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
        "tracestate": "vendor=abc",
    }
    async with http.post(
        f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
    ) as resp:
        assert resp.status == 200
        await resp.read()
    await accounted(gw, 0)
    await eventually(lambda: len(receiver.spans) >= 5, within_s=10)
    (server,) = receiver.named("POST /v1/chat/completions")
    (upstream,) = receiver.named("upstream")
    assert server.trace_id.hex() == CLIENT_TRACE and server.parent_span_id.hex() == CLIENT_SPAN
    for name in ("count", "queue", "upstream", "stream"):
        (child,) = receiver.named(name)
        assert child.trace_id == server.trace_id and child.parent_span_id == server.span_id
        assert server.start_time_unix_nano <= child.start_time_unix_nano
        assert child.end_time_unix_nano <= server.end_time_unix_nano
    # The replica was told the upstream span is its parent, in the client's trace.
    sent = stub.stats.headers[-1]
    assert sent["traceparent"] == f"00-{CLIENT_TRACE}-{upstream.span_id.hex()}-01"
    assert sent["tracestate"] == "vendor=abc"
    seen = attributes(server)
    assert seen["gen_ai.request.model"] == "tiny" and seen["gen_ai.operation.name"] == "chat"
    assert seen["gen_ai.usage.output_tokens"] == 3 and seen["gen_ai.usage.input_tokens"] > 0
    assert seen["llm_gateway.tenant"] == "acme" and seen["llm_gateway.pool"] == "main"
    assert seen["llm_gateway.replica"] == stub.url and seen["http.response.status_code"] == 200
    assert not any(KEY in str(v) for span in receiver.spans for v in attributes(span).values())


async def test_a_refusal_is_an_error_span_with_its_code(
    receiver, stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(traced(basic_policy(tokenizer_dir, [stub.url]), receiver))
    async with http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "model": "nope"}) as resp:
        assert resp.status == 404
    await eventually(lambda: len(receiver.spans) >= 1, within_s=10)
    (server,) = receiver.spans
    assert server.status.code == server.status.STATUS_CODE_ERROR
    assert attributes(server)["llm_gateway.refusal"] == "model_not_found"
    assert server.parent_span_id == b""  # no traceparent: a new trace


async def test_sampling_is_the_parents_else_the_ratio(
    receiver, stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(
        traced(basic_policy(tokenizer_dir, [stub.url]), receiver, sample_ratio=0.0)
    )
    unsampled = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"}
    sampled = {"traceparent": f"00-{'1' * 32}-{CLIENT_SPAN}-01"}
    for headers in ({}, unsampled, sampled):
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
            assert resp.status == 200
    await accounted(gw, 2)
    await eventually(lambda: len(receiver.spans) >= 4, within_s=10)
    await asyncio.sleep(0.2)  # what else there was to export has been
    assert {span.trace_id.hex() for span in receiver.spans} == {"1" * 32}
    # Unsampled, the replica gets the client's context as it came, marked unsampled.
    assert stub.stats.headers[1]["traceparent"].startswith(f"00-{CLIENT_TRACE}-")
    assert stub.stats.headers[1]["traceparent"].endswith("-00")


async def test_without_tracing_a_clients_traceparent_passes_through(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    async with http.post(
        f"{gw.url}/v1/chat/completions", json=CHAT, headers={"traceparent": traceparent}
    ) as resp:
        assert resp.status == 200
    assert stub.stats.headers[-1]["traceparent"] == traceparent
    assert gw.gateway.tracing is None


async def test_latency_histograms_carry_the_trace_as_an_exemplar(
    receiver, stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(traced(basic_policy(tokenizer_dir, [stub.url]), receiver))
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200
    await accounted(gw, 0)
    openmetrics = {"Accept": "application/openmetrics-text; version=1.0.0"}
    async with http.get(f"{gw.metrics_url}/metrics", headers=openmetrics) as resp:
        assert resp.content_type == "application/openmetrics-text"
        text = await resp.text()
    e2e = [line for line in text.splitlines() if line.startswith("llm_request_e2e_seconds_bucket")]
    assert any(f'# {{trace_id="{CLIENT_TRACE}"}}' in line for line in e2e), e2e
    async with http.get(f"{gw.metrics_url}/metrics") as resp:  # Prometheus's text format has none
        assert "trace_id" not in await resp.text()


@dataclass
class Hanging:
    """An OTLP endpoint that accepts, reads what it is sent, and never answers."""

    url: str
    heard: asyncio.Event


@pytest.fixture
async def hanging(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Hanging]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # inherited by a gateway process too
    heard = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(65536):
            heard.set()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield Hanging(f"http://127.0.0.1:{port}/v1/traces", heard)
    for writer in held:
        writer.close()
    server.close()


def hung_policy(tokenizer_dir: Any, stub: Any, collector: Hanging) -> dict[str, Any]:
    # The exporter's own time-out well past the close's bound: the SDK would wait it out.
    policy = basic_policy(tokenizer_dir, [stub.url])
    return {**policy, "tracing": {"endpoint": collector.url, "timeout_s": 60}}


async def test_a_reload_does_not_wait_for_a_collector_that_never_answers(
    hanging, stub, gateway_factory, tokenizer_dir, tmp_path, http
) -> None:
    gw = await gateway_factory(hung_policy(tokenizer_dir, stub, hanging))
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    await asyncio.wait_for(hanging.heard.wait(), 10)  # its spans are being exported, for ever
    write_policy(tmp_path, basic_policy(tokenizer_dir, [stub.url]))  # tracing off
    async with asyncio.timeout(10):  # the SDK waits on the exporter for 30 s
        await gw.gateway.reload()
    assert gw.gateway.tracing is None


async def test_a_stop_with_nothing_in_flight_does_not_wait_for_the_collector(
    hanging, stub, tokenizer_dir, tmp_path, http
) -> None:
    """SIGTERM, nothing in flight: the gateway's close flushed the spans under a 30 s wait that
    a pod's grace period ends in SIGKILL; now the flush has `CLOSE_S`."""
    path = write_policy(tmp_path, hung_policy(tokenizer_dir, stub, hanging))
    async with serving(path) as (proc, url):
        async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
        await asyncio.wait_for(hanging.heard.wait(), 10)
        proc.terminate()
        async with asyncio.timeout(15):
            assert await proc.wait() == 0


async def test_bad_trace_context_headers_are_logged_rate_limited_and_never_quoted(
    receiver, stub, gateway_factory, tokenizer_dir, http, caplog
) -> None:
    """OpenTelemetry warns of every `traceparent` over its length and every malformed
    `tracestate` member, quoting the member: one request each made a log line, with whatever
    the client put there."""
    gw = await gateway_factory(traced(basic_policy(tokenizer_dir, [stub.url]), receiver))
    secret = "sk-live-0123456789abcdef"
    long_parent = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01" + "0" * 600}
    bad_state = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": f"{secret} x"}
    with caplog.at_level(logging.WARNING, logger="opentelemetry"):
        for headers in [long_parent] * 25 + [bad_state] * 25:
            async with http.post(
                f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers
            ) as resp:
                assert resp.status == 200
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry.trace")]
    assert 2 <= len(lines) <= 20, lines  # each kind within its burst of 10 a minute
    assert any("maximum length of 512" in line for line in lines)
    assert not any(secret in line for line in lines)
