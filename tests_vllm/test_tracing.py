"""Traces into real vLLM: the gateway forwards its upstream span's context, and vLLM's own span
(`--otlp-traces-endpoint`, exported over OTLP/HTTP to a receiver here) is that span's child, in
the client's trace. The same vLLM reports its prefix-cache hits (`--enable-prompt-tokens-details`):
the gateway logs what it says."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from loadtest.vllm_server import VLLMServer
from tests_vllm.conftest import eventually, started_vllm, vllm_policy

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
RULES = "You label product reviews as positive or negative. " * 30


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP traces endpoint on a thread: vLLM exports to it before any test's loop runs."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (service.name, span)
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Export)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def named(self, service: str) -> list[Any]:
        with self.lock:
            return [span for name, span in self.spans if name == service]


class _Export(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        message = ExportTraceServiceRequest.FromString(
            self.rfile.read(int(self.headers["Content-Length"]))
        )
        for resource in message.resource_spans:
            service = next(
                (a.value.string_value for a in resource.resource.attributes
                 if a.key == "service.name"), ""
            )  # fmt: skip
            with self.server.lock:
                self.server.spans += [
                    (service, s) for scope in resource.scope_spans for s in scope.spans
                ]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def traced_vllm(
    tmp_path_factory: pytest.TempPathFactory, receiver: Receiver
) -> Iterator[VLLMServer]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        env.setenv("OTEL_SERVICE_NAME", "vllm")
        flags = ["--otlp-traces-endpoint", receiver.url, "--enable-prompt-tokens-details"]
        yield from started_vllm(tmp_path_factory, "vllm-traced", flags)


async def test_vllms_span_is_a_child_of_the_gateways_upstream_span(
    traced_vllm, receiver, gateway_factory, http, monkeypatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    policy = vllm_policy(traced_vllm)
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


async def test_cached_tokens_are_what_vllm_reports(traced_vllm, gateway_factory, http) -> None:
    gw = await gateway_factory(vllm_policy(traced_vllm))
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
