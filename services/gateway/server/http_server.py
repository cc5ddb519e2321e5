"""The gateway's HTTP server: uvicorn over h11, bounded against clients that hold it.

`server_config(app)` is the uvicorn configuration `serve` (and the tests) run the app
with. Its `GatewayProtocol` adds, per connection, what uvicorn leaves open:

* **header timeout**: a connection must send a whole request head within
  ``header_timeout_s`` of opening or of its last response, else it is closed (a client
  that sends a header byte a second holds nothing for long);
* **connection cap**: past ``max_connections`` open connections, a new one is answered
  503 and closed at once; the open ones are served as before;
* **write stall**: a connection whose send buffer stays full (its client reads nothing)
  for ``stream_idle_timeout_s`` is cut. Its request sees the client disconnect, and the
  response's close aborts it in the engine (`server.streaming`), returning its slot and pages.

The request head is bounded by ``max_header_bytes`` (h11's incomplete-event limit); the
body's read timeout is the app's (`gateway.Gateway.read_json`), where a 408 can be sent.
Each cut is counted in ``radixserve_gateway_cut_connections_total{reason}``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from radixserve.metrics import ServingMetrics
from radixserve.services.gateway.server.errors import RETRY_AFTER_S, error_body
from radixserve.services.gateway.settings import GatewaySettings

__all__ = ["GatewayProtocol", "server_config"]


def _refusal(message: str) -> bytes:
    """A whole 503 response with an OpenAI error body, written before any request."""
    body = json.dumps(error_body(503, message)).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {RETRY_AFTER_S}\r\n"
            "connection: close\r\n\r\n")  # fmt: skip
    return head.encode() + body


class GatewayProtocol(H11Protocol):
    """uvicorn's h11 protocol with the gateway's connection limits (module notes)."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        settings: GatewaySettings,
        on_cut: Callable[[str], None],
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._settings = settings
        self._on_cut = on_cut
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        _no_delay(transport)
        super().connection_made(transport)
        limit = self._settings.max_connections
        if len(self.connections) > limit:
            self._on_cut("over_limit")
            transport.write(_refusal(f"too many connections (the bound is {limit}); retry "
                                     "shortly"))  # fmt: skip
            transport.close()
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer = _cancelled(self._head_timer)
        self._stall_timer = _cancelled(self._stall_timer)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
            self._head_timer = _cancelled(self._head_timer)  # a request's head is in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # the next request's head (none pipelined)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            delay = self._settings.stream_idle_timeout_s
            self._stall_timer = self.loop.call_later(delay, self._cut, "write_stalled")

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stall_timer = _cancelled(self._stall_timer)

    def _arm_head_timer(self) -> None:
        _cancelled(self._head_timer)
        delay = self._settings.header_timeout_s
        self._head_timer = self.loop.call_later(delay, self._cut, "header_timeout")

    def _cut(self, reason: str) -> None:
        """Close the connection at once, its buffered output dropped; uvicorn then tells
        the request in flight, if any, that its client disconnected."""
        self._head_timer = _cancelled(self._head_timer)
        self._stall_timer = None
        if not self.transport.is_closing():
            self._on_cut(reason)
            self.transport.abort()


def _no_delay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on a TCP connection: a response is written in pieces (the head, then
    each body chunk or streamed event), and with Nagle's algorithm on, a piece waits for
    the client's ACK of the one before, which a client delays up to 40 ms. asyncio sets
    it only where the listening socket was made with proto TCP; an inherited one may not
    have been."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _cancelled(timer: asyncio.TimerHandle | None) -> asyncio.TimerHandle | None:
    """Cancel ``timer`` if set; None, its new value."""
    if timer is not None:
        timer.cancel()
    return None


def server_config(
    app: Any, settings: GatewaySettings, metrics: ServingMetrics | None = None, **options: Any
) -> uvicorn.Config:
    """The uvicorn configuration for the gateway ``app`` (`routes.create_app`) with the
    limits of its ``settings``, its cut connections counted in ``metrics``; ``options``
    are more `uvicorn.Config` arguments."""

    def on_cut(reason: str) -> None:
        if metrics is not None:
            metrics.cut_connections.labels(reason=reason).inc()

    protocol = functools.partial(GatewayProtocol, settings=settings, on_cut=on_cut)
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol,  # type: ignore[arg-type]
        ws="none",
        h11_max_incomplete_event_size=settings.max_header_bytes,
        log_level="warning",
        **options,
    )
