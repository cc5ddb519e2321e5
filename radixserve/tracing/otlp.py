"""`OtlpExporter`: finished spans to an OpenTelemetry collector over OTLP, encoded and
sent by the OpenTelemetry SDK's own exporters, over the protocol the standard
``OTEL_EXPORTER_OTLP_PROTOCOL`` names:

- ``http/protobuf`` (the specification's default): opentelemetry-exporter-otlp-proto-http;
- ``http/json``: opentelemetry-exporter-otlp-json-http;
- ``grpc``: opentelemetry-exporter-otlp-proto-grpc.

Only the SDK's exporters are used, not its tracer or span processor: spans are made by
`radixserve.tracing.span` (plain objects, no context propagation through contextvars)
and batched here. Off the request path: `submit` appends to a bounded queue (full: the
span is dropped and counted) and a daemon thread converts each batch to the SDK's
`ReadableSpan` and exports it every ``schedule_delay_s``, or as soon as a batch is full.
A collector that is down or slow costs that thread a failed export (the SDK retries
within ``timeout_s``; logged here at most once a minute), never a request. The SDK's
exporter modules are imported when an exporter is made, so a process that exports
nothing never imports them (grpc alone takes ~0.2 s).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from radixserve.tracing.span import Span

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger(__name__)

PROTOCOLS = ("http/protobuf", "http/json", "grpc")
DEFAULT_PROTOCOL = "http/protobuf"
SCOPE_NAME = "radixserve"
_WARN_EVERY_S = 60.0


def sdk_exporter(
    protocol: str, url: str, headers: Mapping[str, str], timeout_s: float
) -> SpanExporter:
    """The OpenTelemetry SDK's span exporter for ``protocol``, sending to ``url`` (the
    full traces URL for HTTP, ``http(s)://host:port`` for gRPC: http = no TLS)."""
    # gRPC metadata keys must be lowercase; HTTP header names are case-insensitive
    headers = {key.lower(): value for key, value in headers.items()}
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=url, headers=headers, timeout=timeout_s)
    if protocol == "http/json":
        from opentelemetry.exporter.otlp.json.http.trace_exporter import (
            OTLPSpanExporter as JsonSpanExporter,
        )

        return JsonSpanExporter(endpoint=url, headers=headers, timeout=timeout_s)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter(
            endpoint=url, insecure=url.startswith("http://"), headers=headers, timeout=timeout_s
        )
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol} is not supported: "
        f"use one of {', '.join(PROTOCOLS)}"
    )


class SpanConverter:
    """Our finished `Span` as the SDK's `ReadableSpan`, under one resource and scope."""

    def __init__(self, resource: Mapping[str, str]) -> None:
        from opentelemetry import trace as api
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self._readable = ReadableSpan
        self._context = api.SpanContext
        self._sampled = api.TraceFlags(api.TraceFlags.SAMPLED)
        self.resource = _hashed_once(resource)
        self.scope = InstrumentationScope(SCOPE_NAME)
        self._kinds = {"internal": api.SpanKind.INTERNAL, "server": api.SpanKind.SERVER,
                       "client": api.SpanKind.CLIENT}  # fmt: skip
        self._statuses = {name: api.Status(code) for name, code in (
            ("unset", api.StatusCode.UNSET), ("ok", api.StatusCode.OK),
            ("error", api.StatusCode.ERROR))}  # fmt: skip

    def __call__(self, span: Span) -> ReadableSpan:
        trace_id = int(span.trace_id, 16)
        parent = None
        if span.parent_span_id:
            parent = self._context(trace_id, int(span.parent_span_id, 16), span.remote_parent,
                                   self._sampled)  # fmt: skip
        return self._readable(
            span.name,
            context=self._context(trace_id, int(span.span_id, 16), False, self._sampled),
            parent=parent,
            resource=self.resource,
            attributes=span.attributes,
            kind=self._kinds.get(span.kind, self._kinds["internal"]),
            status=self._statuses[span.status],
            start_time=span.start_ns,
            end_time=span.end_ns,
            instrumentation_scope=self.scope,
        )


def _hashed_once(attributes: Mapping[str, str]) -> Any:
    """The SDK's `Resource` of ``attributes``, hashed once: its encoders group a batch's
    spans by resource, and `Resource.__hash__` runs json.dumps each time (a quarter of
    the protobuf encoding's cost per span, measured)."""
    from opentelemetry.sdk.resources import Resource

    class HashedResource(Resource):
        def __init__(self, attributes: Mapping[str, str]) -> None:
            super().__init__(dict(attributes))
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash

    return HashedResource(attributes)


class OtlpExporter:
    """Batches spans and exports them over ``protocol`` to ``url`` on its own thread
    (see the module notes); ``exporter``: an SDK exporter to use instead of the one
    ``protocol`` names."""

    def __init__(
        self,
        url: str,
        resource: Mapping[str, str],
        *,
        protocol: str = DEFAULT_PROTOCOL,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        schedule_delay_s: float = 5.0,
        max_queue: int = 2048,
        max_batch: int = 512,
        exporter: SpanExporter | None = None,
    ) -> None:
        self.url = url
        self.protocol = protocol
        self._sdk = exporter or sdk_exporter(protocol, url, headers or {}, timeout_s)
        self._convert = SpanConverter(resource)
        self.schedule_delay_s = schedule_delay_s
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.exported = self.dropped = self.failed = 0  # spans
        self._queue: collections.deque[Span] = collections.deque()
        self._wake = threading.Event()
        self._closing = False
        self._last_warning = float("-inf")
        self._thread = threading.Thread(target=self._run, name="otlp-exporter", daemon=True)
        self._thread.start()

    def submit(self, span: Span) -> None:
        """Queue a finished span (from any thread); dropped when the queue is full."""
        if len(self._queue) >= self.max_queue:
            self.dropped += 1
            return
        self._queue.append(span)
        if len(self._queue) >= self.max_batch:
            self._wake.set()

    def close(self, timeout_s: float = 2.0) -> None:
        """Export what is queued (within ``timeout_s``: then an export still retrying is
        cut short) and stop the thread."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._sdk.shutdown()  # ends the SDK's retry waits; later exports fail at once
        self._thread.join(0.5)

    def readable(self, spans: Sequence[Span]) -> list[ReadableSpan]:
        """``spans`` as the SDK exports them."""
        return [self._convert(span) for span in spans]

    def _run(self) -> None:
        while True:
            self._wake.wait(self.schedule_delay_s)
            self._wake.clear()
            while self._queue:
                self._export(self._batch())
            if self._closing:
                return

    def _batch(self) -> list[Span]:
        return [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch))]

    def _export(self, batch: list[Span]) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        problem: Any = None
        try:
            if self._sdk.export(self.readable(batch)) is SpanExportResult.SUCCESS:
                self.exported += len(batch)
                return
        except Exception as exc:  # the SDK's exporters report failures; never kill the thread
            problem = exc
        self.failed += len(batch)
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            logger.warning("OTLP export (%s) of %d spans to %s failed%s (%d failed so far)",
                           self.protocol, len(batch), self.url,
                           f": {problem}" if problem else "", self.failed)  # fmt: skip
