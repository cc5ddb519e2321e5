"""The gateway's side of tracing: each generation request's span, and GET /debug/traces.

`TraceMiddleware` opens ``gateway.request`` when a POST to a generation route arrives
(as a child of the client's ``traceparent`` when it sends a valid, sampled one: same
trace id, the client's span as parent; else in a new trace) and ends it when the
response has been sent, streams included, with the HTTP status. The handlers find the
span with `request_span` and pass it down (`EngineClient.generate`); the trace id is
``request.state.trace_id`` (the explorer's recent requests link to it) and goes back to
the client as a ``traceparent`` response header. The ended trace enters the
`TraceStore`. With tracing off (no trace buffer, no OTLP endpoint) the middleware is
not installed at all.

Routes (admin keys only, like /debug/cache; each trace is scoped to its tenant too): GET
/debug/traces?limit=N and GET /debug/traces/{trace_id} (shapes: `trace_store`). A
request's span carries its tenant's name (``tenant``), never its key.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.server.query import int_param, only_params
from radixserve.services.gateway.server.trace_store import TraceStore
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.gateway.tenancy.tenants import Principal
from radixserve.tracing import NO_SPAN, Span, Tracer, otlp_exporter, parse_traceparent

MAX_GATEWAY_SPANS = 1024  # per request: its jobs' worker spans included
DEFAULT_LIMIT = 50
MAX_LIMIT = 1 << 16  # the largest trace buffer


def request_span(request: Request) -> Span:
    """The ``gateway.request`` span of ``request`` (`NO_SPAN` when it is not traced)."""
    span: Span = getattr(request.state, "trace_span", NO_SPAN)
    return span


class TraceMiddleware:
    """Wraps the app: a span per generation request (see the module notes)."""

    def __init__(
        self, app: ASGIApp, tracer: Tracer, store: TraceStore, paths: frozenset[str]
    ) -> None:
        self.app = app
        self.tracer = tracer
        self.store = store
        self.paths = paths  # the routes traced (`routes.ROUTES`' traced column)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        client = parse_traceparent(_header(scope, b"traceparent"))
        span = self.tracer.start_request("gateway.request", client, **{"http.route": scope["path"]})
        if not span.recording:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["trace_span"], state["trace_id"] = span, span.trace_id
        status = 0

        async def send_traced(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"traceparent", span.traceparent().encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            span.end(exc, **{"http.status_code": status or 500})
            raise
        finally:
            span.end(None if status < 500 else f"HTTP {status}", **{"http.status_code": status})
            self.store.put(span)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _store(request: Request) -> tuple[TraceStore, Principal]:
    principal: Principal = request.app.state.gateway.authorize_admin(request)
    store: TraceStore = request.app.state.traces
    return store, principal


async def debug_traces(request: Request) -> dict[str, Any]:
    store, principal = _store(request)
    only_params(request, ("limit",), "/debug/traces")
    limit = int_param(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    return {"traces": store.summaries(limit, principal)}


async def debug_trace(request: Request) -> dict[str, Any]:
    store, principal = _store(request)
    trace_id = str(request.path_params["trace_id"])
    body = store.trace(trace_id, principal)
    if body is None:
        raise OpenAIError(404, f"no trace {trace_id[:64]!r} is kept (the gateway keeps the "
                          f"last {store.size})", "trace_id")  # fmt: skip
    return body


def install_tracing(app: FastAPI, settings: GatewaySettings, paths: frozenset[str]) -> Tracer:
    """The trace store and, when tracing is on, the middleware tracing POSTs to ``paths``
    on ``app``; the gateway's tracer, for the caller to close at shutdown."""
    # on when it keeps traces or the OTLP environment names an endpoint
    tracer = Tracer("gateway", otlp_exporter("gateway"), keep=settings.trace_buffer > 0,
                    max_spans=MAX_GATEWAY_SPANS)  # fmt: skip
    store = TraceStore(settings.trace_buffer)
    app.state.traces = store
    if tracer.enabled:
        app.add_middleware(TraceMiddleware, tracer=tracer, store=store, paths=paths)
    return tracer
