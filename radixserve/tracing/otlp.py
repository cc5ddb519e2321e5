"""`OtlpExporter`: finished spans to an OpenTelemetry collector over OTLP/HTTP (JSON).

Why JSON by hand rather than the OpenTelemetry SDK and its protobuf exporter: the
encoding is a few dozen lines of the stable OTLP/JSON mapping
(https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding, accepted at the same
``/v1/traces`` URL as protobuf by the collector, Jaeger, Tempo...), where the SDK would
add five packages (protobuf among them) to every image and a span processor on the
request path costing more than the spans it records.

Off the request path: `submit` appends to a bounded queue (full: the span is dropped
and counted) and a daemon thread posts batches every ``schedule_delay_s`` or as soon as
a batch is full. A collector that is down or slow costs a failed post on that thread
(logged at most once a minute), never a request.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from radixserve.tracing.span import Attribute, Span

logger = logging.getLogger(__name__)

_KIND = {"internal": 1, "server": 2, "client": 3}  # OTLP's SpanKind
_STATUS = {"unset": 0, "ok": 1, "error": 2}  # OTLP's StatusCode
_WARN_EVERY_S = 60.0
SCOPE = {"name": "radixserve"}


def _value(value: Attribute) -> dict[str, Any]:
    """An OTLP AnyValue (int64 as a decimal string, as the JSON mapping has it)."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    return {"stringValue": str(value)}


def _attributes(attributes: Mapping[str, Attribute]) -> list[dict[str, Any]]:
    return [{"key": key, "value": _value(value)} for key, value in attributes.items()]


def otlp_span(span: Span) -> dict[str, Any]:
    """One span in OTLP/JSON (ids in hex, times as decimal strings)."""
    body: dict[str, Any] = {
        "traceId": span.trace_id,
        "spanId": span.span_id,
        "name": span.name,
        "kind": _KIND.get(span.kind, 1),
        "startTimeUnixNano": str(span.start_ns),
        "endTimeUnixNano": str(span.end_ns),
        "attributes": _attributes(span.attributes),
        "status": {"code": _STATUS[span.status]},
    }
    if span.parent_span_id:
        body["parentSpanId"] = span.parent_span_id
    return body


def otlp_request(resource: Mapping[str, str], spans: Sequence[Span]) -> dict[str, Any]:
    """An ExportTraceServiceRequest holding ``spans`` of one resource."""
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": _attributes(resource)},
                "scopeSpans": [{"scope": SCOPE, "spans": [otlp_span(s) for s in spans]}],
            }
        ]
    }


class OtlpExporter:
    """Batches spans and posts them to ``url`` on its own thread (see the module notes)."""

    def __init__(
        self,
        url: str,
        resource: Mapping[str, str],
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        schedule_delay_s: float = 5.0,
        max_queue: int = 2048,
        max_batch: int = 512,
    ) -> None:
        self.url = url
        self.resource = dict(resource)
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.timeout_s = timeout_s
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
        """Post what is queued (within ``timeout_s``) and stop the thread."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.schedule_delay_s)
            self._wake.clear()
            while self._queue:
                self._post(self._batch())
            if self._closing:
                return

    def _batch(self) -> list[Span]:
        batch: list[Span] = []
        while self._queue and len(batch) < self.max_batch:
            batch.append(self._queue.popleft())
        return batch

    def _post(self, batch: list[Span]) -> None:
        data = json.dumps(otlp_request(self.resource, batch), separators=(",", ":")).encode()
        request = urllib.request.Request(self.url, data, self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
            self.exported += len(batch)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            self.failed += len(batch)
            now = time.monotonic()
            if now - self._last_warning >= _WARN_EVERY_S:
                self._last_warning = now
                logger.warning("OTLP export of %d spans to %s failed: %s (%d failed so far)",
                               len(batch), self.url, exc, self.failed)  # fmt: skip
