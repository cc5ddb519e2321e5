"""`Tracer`: one per process; where a request's spans begin and where they go.

Tracing is on at the gateway when it keeps traces in memory (its ``trace_buffer``) or
exports them (an OTLP endpoint, `OtlpSettings`); off, `Tracer.start_request` returns
`NO_SPAN` and nothing else runs. The gateway then sends no ``traceparent`` in its
messages, so the workers record nothing either: a worker records a request's spans
exactly when the request carries a sampled ``traceparent`` (`Tracer.join`), carries
them back on its replies, and exports them itself when it has an endpoint.
"""

from __future__ import annotations

from radixserve.protocol.fields import Role
from radixserve.tracing.context import TraceContext, new_trace_id, parse_traceparent
from radixserve.tracing.otlp import OtlpExporter
from radixserve.tracing.settings import OtlpSettings
from radixserve.tracing.span import NO_SPAN, Attribute, RemoteSpan, RequestTrace, Span


class Tracer:
    """Starts spans for requests of a process of ``service`` (its role). ``exporter``:
    where this process's finished spans go (None: nowhere); ``keep``: requests are
    traced even without one (the gateway's in-memory traces); ``max_spans``: spans one
    request's trace holds in this process."""

    def __init__(
        self,
        service: Role,
        exporter: OtlpExporter | None = None,
        *,
        keep: bool = False,
        max_spans: int = 64,
    ) -> None:
        self.service: Role = service
        self.exporter = exporter
        self.enabled = keep or exporter is not None
        self.max_spans = max_spans

    def start_request(
        self, name: str, parent: TraceContext | None = None, **attributes: Attribute
    ) -> Span:
        """A request's first span in this process, as a child of the caller's span
        ``parent`` (same trace) or in a new trace; `NO_SPAN` when tracing is off or
        the caller did not sample it."""
        if not self.enabled or (parent is not None and not parent.sampled):
            return NO_SPAN
        trace_id = parent.trace_id if parent is not None else new_trace_id()
        trace = self._trace(trace_id)
        parent_id = parent.span_id if parent is not None else None
        return Span(trace, name, parent_id, attributes=dict(attributes), kind="server",
                    remote_parent=parent is not None)  # fmt: skip

    def join(self, traceparent: str) -> Span:
        """The remote span a request's ``traceparent`` names, to start this process's
        spans under (it is never ended here); `NO_SPAN` if absent, malformed or not
        sampled."""
        parent = parse_traceparent(traceparent)
        if parent is None or not parent.sampled:
            return NO_SPAN
        remote = RemoteSpan(self._trace(parent.trace_id), "remote", None, start_ns=0)
        remote.span_id = parent.span_id
        return remote

    def close(self) -> None:
        """Export what is queued and stop the exporter's thread."""
        if self.exporter is not None:
            self.exporter.close()

    def _trace(self, trace_id: str) -> RequestTrace:
        export = self.exporter.submit if self.exporter is not None else None
        return RequestTrace(trace_id, self.service, export, self.max_spans)


def otlp_exporter(role: Role, settings: OtlpSettings | None = None) -> OtlpExporter | None:
    """The exporter the OTEL_* environment asks for in a process of ``role`` (None: no
    endpoint, or export disabled); `ValueError` naming a variable that is refused (a
    protocol not spoken among them), endpoint or not."""
    settings = settings if settings is not None else OtlpSettings.load()
    url = settings.traces_url()
    if url is None:
        return None
    return OtlpExporter(
        url,
        settings.resource(role),
        protocol=settings.protocol(),
        headers=settings.headers(),
        timeout_s=settings.timeout_s(),
        schedule_delay_s=settings.bsp_schedule_delay / 1000.0,
        max_queue=settings.bsp_max_queue_size,
        max_batch=settings.bsp_max_export_batch_size,
    )
