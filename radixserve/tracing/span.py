"""Spans and the trace of one request in one process.

A `Span` is one timed step of a request (``decode.admission``, ``prefill.compute``...):
its ids, its parent, the service (role) that ran it, start and end in unix nanoseconds,
attributes (token counts, worker names: never prompt text) and a status. Spans are made
from a parent (`Span.child`); ending one hands it to the process's exporter and keeps it
in its `RequestTrace`, which also adopts the finished spans other processes carried
back on their replies, so the decode worker can forward the prefill worker's spans and
the gateway holds the whole request.

A request that is not traced gets `NO_SPAN`, whose methods do nothing: code on the
request path calls the same methods either way, and an untraced request costs a method
call per step, not a branch per call site.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Literal

from radixserve.protocol.fields import MAX_NAME_CHARS, Role
from radixserve.protocol.messages import (
    MAX_SPAN_LABELS,
    MAX_SPANS_PER_MESSAGE,
    SpanLabel,
    SpanRecord,
)
from radixserve.tracing.context import format_traceparent, new_span_id

Attribute = str | int | float | bool
Status = Literal["unset", "ok", "error"]


class RequestTrace:
    """One request's finished spans in this process (its own and those adopted from
    other processes), at most ``max_spans``; ``export`` gets each span this process
    ends (the OTLP exporter), or is None."""

    __slots__ = ("trace_id", "service", "spans", "max_spans", "dropped", "export")

    def __init__(
        self,
        trace_id: str,
        service: Role,
        export: Callable[[Span], None] | None = None,
        max_spans: int = MAX_SPANS_PER_MESSAGE,
    ) -> None:
        self.trace_id = trace_id
        self.service = service
        self.export = export
        self.max_spans = max_spans
        self.spans: list[Span] = []
        self.dropped = 0  # spans past max_spans, not kept (still exported)

    def keep(self, span: Span) -> None:
        if len(self.spans) < self.max_spans:
            self.spans.append(span)
        else:
            self.dropped += 1

    def adopt(self, records: Iterable[SpanRecord]) -> None:
        """Keep spans another process finished (not exported again: that one did)."""
        for r in records:
            attributes: dict[str, Attribute] = dict(r.values)
            attributes.update((label.key, label.value) for label in r.labels)
            span = Span(self, r.name, r.parent_span_id, r.start_ns, attributes, r.service)
            span.span_id, span.end_ns, span.status = r.span_id, r.end_ns, r.status  # type: ignore[assignment]
            self.keep(span)

    def records(self) -> tuple[SpanRecord, ...]:
        """The finished spans with a parent, for a reply (at most the message's bound)."""
        return tuple(s.record() for s in self.spans[:MAX_SPANS_PER_MESSAGE] if s.parent_span_id)


class Span:
    """One step of a traced request; see the module notes."""

    __slots__ = ("trace", "span_id", "parent_span_id", "name", "service", "start_ns",
                 "end_ns", "attributes", "status", "kind", "remote_parent")  # fmt: skip

    def __init__(
        self,
        trace: RequestTrace,
        name: str,
        parent_span_id: str | None,
        start_ns: int | None = None,
        attributes: dict[str, Attribute] | None = None,
        service: Role | None = None,
        kind: str = "internal",
        remote_parent: bool = False,
    ) -> None:
        self.trace = trace
        self.span_id = new_span_id()
        self.parent_span_id = parent_span_id
        self.name = name
        self.service: Role = service or trace.service
        self.start_ns = time.time_ns() if start_ns is None else start_ns
        self.end_ns = 0  # 0 until it ends
        self.attributes: dict[str, Attribute] = attributes or {}
        self.status: Status = "unset"
        self.kind = kind  # "server" for the request's span at the gateway
        self.remote_parent = remote_parent  # the parent is another process's span

    @property
    def recording(self) -> bool:
        return True

    @property
    def trace_id(self) -> str:
        return self.trace.trace_id

    def child(self, name: str, start_ns: int | None = None, **attributes: Attribute) -> Span:
        """A new span under this one, started now (or at ``start_ns``)."""
        return Span(self.trace, name, self.span_id, start_ns, attributes)

    def set(self, **attributes: Attribute) -> None:
        self.attributes.update(attributes)

    def end(self, error: BaseException | str | None = None, **attributes: Attribute) -> None:
        """Finish the span now (once: later calls do nothing), with ``error`` if it
        failed; export it and keep it in its trace."""
        if self.end_ns:
            return
        self.end_ns = max(time.time_ns(), self.start_ns)
        self.attributes.update(attributes)
        if error is not None:
            self.status = "error"
            self.attributes["error"] = (str(error) or type(error).__name__)[:MAX_NAME_CHARS]
        self.trace.keep(self)
        if self.trace.export is not None:
            self.trace.export(self)

    def traceparent(self) -> str:
        """The ``traceparent`` that makes another process's spans children of this one."""
        return format_traceparent(self.trace.trace_id, self.span_id)

    def adopt(self, records: Iterable[SpanRecord]) -> None:
        """Keep another process's finished spans of this request in its trace."""
        self.trace.adopt(records)

    def records(self) -> tuple[SpanRecord, ...]:
        """Every finished span of the trace, for a reply (`RequestTrace.records`)."""
        return self.trace.records()

    def record(self) -> SpanRecord:
        """This (finished) span on the wire: numbers as values, text as labels."""
        values: dict[str, int | float] = {}
        labels: list[SpanLabel] = []
        for key, value in self.attributes.items():
            if isinstance(value, str):
                if len(labels) < MAX_SPAN_LABELS:
                    labels.append(SpanLabel(key[:MAX_NAME_CHARS], value[:MAX_NAME_CHARS]))
            else:
                values[key[:MAX_NAME_CHARS]] = int(value) if isinstance(value, bool) else value
        return SpanRecord(self.span_id, self.parent_span_id or "", self.name, self.service,
                          self.start_ns, self.end_ns, self.status, values, tuple(labels))  # fmt: skip


class RemoteSpan(Span):
    """Another process's span, which a request's ``traceparent`` names: this process's
    spans start under it (`Tracer.join`); never ended here."""

    __slots__ = ()

    def child(self, name: str, start_ns: int | None = None, **attributes: Attribute) -> Span:
        return Span(self.trace, name, self.span_id, start_ns, attributes, remote_parent=True)


class _NoSpan(Span):
    """The span of a request that is not traced: every method does nothing."""

    __slots__ = ()

    def __init__(self) -> None:
        self.trace = RequestTrace("0" * 32, "gateway", max_spans=0)
        self.span_id = self.name = ""
        self.parent_span_id = None
        self.service = "gateway"
        self.start_ns = self.end_ns = 0
        self.attributes = {}
        self.status = "unset"
        self.kind = "internal"
        self.remote_parent = False

    @property
    def recording(self) -> bool:
        return False

    def child(self, name: str, start_ns: int | None = None, **attributes: Attribute) -> Span:
        return self

    def set(self, **attributes: Attribute) -> None:
        return None

    def end(self, error: BaseException | str | None = None, **attributes: Attribute) -> None:
        return None

    def traceparent(self) -> str:
        return ""

    def adopt(self, records: Iterable[SpanRecord]) -> None:
        return None

    def records(self) -> tuple[SpanRecord, ...]:
        return ()


NO_SPAN: Span = _NoSpan()
"""The span of every untraced request (see the module notes)."""
