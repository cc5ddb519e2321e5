"""Request tracing across the cluster: W3C trace context, spans, OTLP export.

`context` parses and formats ``traceparent``; `span` holds a request's spans in one
process (`NO_SPAN` for requests not traced); `tracer` starts them (one `Tracer` per
process); `otlp` exports finished spans to a collector; `settings` reads the standard
OTEL_* variables. How a trace crosses the processes: docs/architecture.md, "Tracing".
"""

from radixserve.tracing.context import TraceContext, format_traceparent, parse_traceparent
from radixserve.tracing.otlp import OtlpExporter
from radixserve.tracing.settings import OtlpSettings
from radixserve.tracing.span import NO_SPAN, RequestTrace, Span
from radixserve.tracing.tracer import Tracer, otlp_exporter

__all__ = [
    "NO_SPAN",
    "OtlpExporter",
    "OtlpSettings",
    "RequestTrace",
    "Span",
    "TraceContext",
    "Tracer",
    "format_traceparent",
    "otlp_exporter",
    "parse_traceparent",
]
