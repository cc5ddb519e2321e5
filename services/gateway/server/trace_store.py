"""The gateway's in-memory traces: the last ``size`` requests' spans, for GET
/debug/traces and the explorer's timelines, with no tracing backend.

A trace enters when its request's span at the gateway (``gateway.request``) ends; it
holds that span's whole `RequestTrace`: the gateway's spans and those the decode worker
carried back on the request's last chunk (its own and the prefill worker's). Requests
that share a trace id (a client sending one ``traceparent`` for several calls) share
an entry. The store is the only owner of finished traces at the gateway; everything
runs on the event loop.

JSON shapes (a contract with the explorer page):

- `summaries`: ``[{"trace_id", "request_id", "root_name", "start_ns", "duration_ms",
  "span_count"}]``, newest first;
- `trace`: ``{"trace_id", "client_span_id", "spans": [{"span_id", "parent_span_id",
  "name", "service", "start_ns", "end_ns", "status", "attributes"}]}`` by start time;
  the request span's ``parent_span_id`` is null (the client's span, outside the store,
  is ``client_span_id``).
"""

from __future__ import annotations

import collections
from typing import Any

from radixserve.services.gateway.tenancy.tenants import Principal
from radixserve.tracing import Span

MAX_ROOTS_PER_TRACE = 16  # requests of one trace id kept together


class TraceStore:
    """The last ``size`` traces (0: none kept)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._traces: collections.OrderedDict[str, list[Span]] = collections.OrderedDict()

    def put(self, root: Span) -> None:
        """Keep the trace of the ended request span ``root`` (newest)."""
        if not self.size or not root.recording:
            return
        roots = self._traces.pop(root.trace_id, [])
        if len(roots) < MAX_ROOTS_PER_TRACE:
            roots.append(root)
        self._traces[root.trace_id] = roots
        while len(self._traces) > self.size:
            self._traces.popitem(last=False)

    def _visible(self, roots: list[Span], caller: Principal) -> bool:
        """Whether ``caller`` may see a trace: an admin, or the tenant of every request
        in it (a request refused before admission carries no tenant: admins only)."""
        return caller.is_admin or all(r.attributes.get("tenant") == caller.tenant for r in roots)

    def summaries(self, limit: int, caller: Principal) -> list[dict[str, Any]]:
        """The newest ``limit`` traces ``caller`` may see, newest first (see the module
        notes)."""
        out = []
        seen = [t for t in reversed(self._traces) if self._visible(self._traces[t], caller)]
        for trace_id in seen[:limit]:
            roots = self._traces[trace_id]
            first, start = roots[0], min(r.start_ns for r in roots)
            end = max(r.end_ns for r in roots)
            out.append({
                "trace_id": trace_id,
                "request_id": first.attributes.get("request_id"),
                "root_name": first.name,
                "start_ns": start,
                "duration_ms": round((end - start) / 1e6, 3),
                "span_count": sum(len(r.trace.spans) for r in roots),
            })  # fmt: skip
        return out

    def trace(self, trace_id: str, caller: Principal) -> dict[str, Any] | None:
        """Every span of trace ``trace_id``; None if it is not kept or not ``caller``'s."""
        roots = self._traces.get(trace_id)
        if roots is None or not self._visible(roots, caller):
            return None
        root_ids = {r.span_id for r in roots}
        spans = sorted((s for r in roots for s in r.trace.spans), key=lambda s: s.start_ns)
        return {
            "trace_id": trace_id,
            "client_span_id": roots[0].parent_span_id,
            "spans": [_span_json(s, s.span_id in root_ids) for s in spans],
        }


def _span_json(span: Span, is_root: bool) -> dict[str, Any]:
    return {
        "span_id": span.span_id,
        "parent_span_id": None if is_root else span.parent_span_id,
        "name": span.name,
        "service": span.service,
        "start_ns": span.start_ns,
        "end_ns": span.end_ns,
        "status": span.status,
        "attributes": dict(span.attributes),
    }
