"""Raw-socket clients for the gateway's limit tests: one that stops reading, one that
sends slowly, one that leaves. Each socket times out after `SOCKET_TIMEOUT_S`, so a
test waiting on the server fails rather than hangs."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx

from radixserve.bench.local_cluster import metric_value

SOCKET_TIMEOUT_S = 60.0


def connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    """A TCP connection to the gateway; ``rcvbuf`` (set before connecting, so the
    window stays small): a client whose buffers fill after a few KiB."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(SOCKET_TIMEOUT_S)
    sock.connect(("127.0.0.1", port))
    return sock


def post(path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 POST of ``body`` as JSON."""
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n{head}\r\n").encode() + data  # fmt: skip


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as a close)."""
    parts = []
    while True:
        try:
            part = sock.recv(65536)
        except ConnectionResetError:
            break
        if not part:
            break
        parts.append(part)
    return b"".join(parts)


def trickle(sock: socket.socket, data: bytes, interval_s: float) -> bytes:
    """Send ``data`` a byte every ``interval_s`` until the server answers or closes the
    connection; then what it sent (b"" if it only closed)."""
    for byte in data:
        readable, _, _ = select.select([sock], [], [], interval_s)
        if readable:
            break
        try:
            sock.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
    else:
        raise AssertionError("the server took every byte and never answered")
    return read_all(sock)


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    return metric_value(http.get("/metrics").text, name, **labels)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` until it holds (a generous bound: the event is asserted, not
    its timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)
