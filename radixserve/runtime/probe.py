"""A service's small HTTP side: ``/health`` (ready), ``/live`` and ``/metrics``.

Kubernetes probes and Prometheus scrape every process directly, so each service serves
these three on an HTTP port of its own, from its asyncio loop (nothing here blocks it):

* ``GET /live``: 200 while the process's loop answers at all (liveness);
* ``GET /health``: 200 with a JSON body when the service can serve, 503 otherwise
  (readiness: e.g. not yet loaded, draining);
* ``GET /metrics``: the Prometheus text exposition.

Anything else is 404; a request line that is not HTTP gets 400. HTTP/1.0-style: one
request per connection, closed after the answer.

`probe` is the other side, for a container's HEALTHCHECK (``radixserve probe``): one GET,
healthy on 200. One image runs every service, so the URL is a setting
(``RADIXSERVE_PROBE_URL``, `ProbeSettings`) each service's container sets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from radixserve.launch.listeners import BACKLOG, adopt

logger = logging.getLogger(__name__)

_MAX_HEAD_BYTES = 16 * 1024
_READ_TIMEOUT_S = 5.0


class ProbeServer:
    """Serves the three endpoints on ``host:port`` (0 = any free port; see ``port``), or
    on the inherited listening socket ``listen_fd`` (`radixserve.launch.listeners`)."""

    def __init__(
        self,
        host: str,
        port: int,
        health: Callable[[], tuple[bool, dict[str, Any]]],
        metrics: Callable[[], bytes],
        metrics_content_type: str = "text/plain; version=0.0.4; charset=utf-8",
        listen_fd: int | None = None,
    ) -> None:
        self.host, self.port, self._listen_fd = host, port, listen_fd
        self._health, self._metrics, self._type = health, metrics, metrics_content_type
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        if self._listen_fd is not None:
            sock = adopt(self._listen_fd)
            self._server = await asyncio.start_server(self._serve, sock=sock, backlog=BACKLOG)
        else:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            status, ctype, body = self._answer(head[:_MAX_HEAD_BYTES])
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            status, ctype, body = 400, "text/plain", b"bad request\n"
        except Exception:
            logger.exception("probe request failed")
            status, ctype, body = 500, "text/plain", b"internal error\n"
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                  500: "Internal Server Error", 503: "Service Unavailable"}[status]  # fmt: skip
        header = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        with contextlib.suppress(ConnectionError):
            writer.write(header.encode() + body)
            await writer.drain()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    def _answer(self, head: bytes) -> tuple[int, str, bytes]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, "text/plain", b"bad request\n"
        method, path = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return 405, "text/plain", b"GET only\n"
        if path == b"/live":
            return 200, "application/json", b'{"status":"alive"}\n'
        if path == b"/health":
            ok, detail = self._health()
            body = json.dumps({"status": "ok" if ok else "unavailable", **detail}).encode()
            return (200 if ok else 503), "application/json", body + b"\n"
        if path == b"/metrics":
            return 200, self._type, self._metrics()
        return 404, "text/plain", b"not found: /health, /live, /metrics\n"


class ProbeSettings(BaseSettings):
    """What ``radixserve probe`` checks, from ``RADIXSERVE_PROBE_*`` (set per container)."""

    model_config = SettingsConfigDict(env_prefix="RADIXSERVE_PROBE_", frozen=True, extra="forbid")

    url: str = Field(
        "http://127.0.0.1:8000/health",
        min_length=1,
        max_length=1024,
        description="The health URL of this container's service (default: the gateway's).",
    )
    timeout_s: float = Field(5.0, gt=0, le=300, description="Longest wait for the answer.")


def probe(url: str, timeout_s: float) -> tuple[bool, str]:
    """GET ``url``: whether it answered 200, and a one-line account of what happened."""
    if not url.startswith(("http://", "https://")):
        return False, f"{url}: not an http(s) URL"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200, f"{url}: {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: {exc.code} {exc.read(512).decode(errors='replace').strip()}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, f"{url}: {getattr(exc, 'reason', exc)}"
