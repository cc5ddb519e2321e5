"""Real OTLP endpoints in the test process, decoding every export with the
OpenTelemetry protocol's own definitions (opentelemetry-proto), as a collector would:

- `OtlpReceiver`: an HTTP server on 127.0.0.1 (port 0) taking POSTs to /v1/traces in
  protobuf (``application/x-protobuf``) or OTLP/JSON (``application/json``);
- `GrpcOtlpReceiver`: the collector's gRPC ``TraceService`` on 127.0.0.1 (port 0).

Both keep each span as the OTLP/JSON mapping spells it (hex ids, times as decimal
strings, ``parentSpanId`` absent on a root) with plain ``attributes`` and its
``"resource"``, so a test reads them the same whatever the protocol; ``posts`` holds
each export's path (or gRPC method), headers (lowercase names) and content type."""

from __future__ import annotations

import base64
import json
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

Request = trace_service_pb2.ExportTraceServiceRequest
_IDS = ("traceId", "spanId", "parentSpanId")


class _Spans:
    """The spans and exports one receiver has taken (thread-safe)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        #: (path or method, headers, content type) of each export
        self.posts: list[tuple[str, dict[str, str], str]] = []
        self._lock = threading.Lock()

    def _keep(self, path: str, headers: dict[str, str], content_type: str, request: Any) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    spans.append({**_span(span), "scope": scope.scope.name, "resource": resource})
        with self._lock:
            self.posts.append((path, headers, content_type))
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["traceId"] == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 20.0) -> list[dict]:
        """The spans of ``trace_id`` once every name in ``names`` has arrived."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


class OtlpReceiver(_Spans):
    """OTLP/HTTP, protobuf or JSON bodies (by the request's Content-Type)."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                content_type = self.headers.get("Content-Type", "")
                if content_type == "application/x-protobuf":
                    request = Request.FromString(body)
                elif content_type == "application/json":
                    request = _from_otlp_json(body)
                else:
                    self.send_response(415)
                    self.end_headers()
                    return
                headers = {k.lower(): v for k, v in self.headers.items()}
                receiver._keep(self.path, headers, content_type, request)
                reply = trace_service_pb2.ExportTraceServiceResponse()
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.end_headers()
                self.wfile.write(reply.SerializeToString() if "protobuf" in content_type else b"{}")

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcOtlpReceiver(_Spans):
    """OTLP/gRPC: the ``opentelemetry.proto.collector.trace.v1.TraceService``."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
                headers = {k.lower(): v for k, v in context.invocation_metadata()}
                receiver._keep("TraceService/Export", headers, "application/grpc", request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.stop(grace=None).wait()


def _from_otlp_json(body: bytes) -> Any:
    """An OTLP/JSON body as the protobuf message: the JSON mapping is proto3's, but for
    the ids, which are hex where proto3's JSON has base64 (the OTLP specification)."""
    data = json.loads(body)
    for resource_spans in data.get("resourceSpans", []):
        for scope in resource_spans.get("scopeSpans", []):
            for span in scope.get("spans", []):
                for key in _IDS:
                    if span.get(key):
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return json_format.ParseDict(data, Request())


def _span(span: Any) -> dict[str, Any]:
    """One protobuf span in the OTLP/JSON mapping's names and forms."""
    out: dict[str, Any] = {
        "traceId": span.trace_id.hex(),
        "spanId": span.span_id.hex(),
        "name": span.name,
        "kind": span.kind,
        "startTimeUnixNano": str(span.start_time_unix_nano),
        "endTimeUnixNano": str(span.end_time_unix_nano),
        "attributes": _attributes(span.attributes),
        "status": {"code": span.status.code},
        "flags": span.flags,
    }
    if span.parent_span_id:
        out["parentSpanId"] = span.parent_span_id.hex()
    return out


def _attributes(attributes: Any) -> dict[str, Any]:
    return {a.key: _plain(a.value) for a in attributes}


def _plain(value: AnyValue) -> Any:
    """An OTLP AnyValue as a Python value."""
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None
