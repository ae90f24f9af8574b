"""An OTLP/HTTP traces endpoint on a thread, for vLLM's exporter and the gateway's: what each
sent, by its `service.name`."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


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
