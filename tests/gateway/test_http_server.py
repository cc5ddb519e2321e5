"""Nothing held by an absent client: the gateway's HTTP server limits (`http_server`) and
the aborts of requests whose clients left or stopped reading, over raw sockets on
loopback against a real gateway (the tiny model: long generations cost little).

Each test asserts the event (the connection cut, the abort counted, the engine holding
nothing after) rather than how long it took: the settings are small, the waits long.
"""

from __future__ import annotations

import json
import socket

import httpx

from tests.gateway.absent_clients import (
    connect,
    metric,
    post,
    read_all,
    trickle,
    wait_for,
)
from tests.gateway.conftest import wait_idle

ABORTED = "radixserve_gateway_aborted_requests_total"
CUT = "radixserve_gateway_cut_connections_total"
#: a generation far longer than any test waits; top_logprobs makes each chunk ~2 KiB,
#: so a client that reads nothing fills its buffers after a few hundred tokens
LONG = {"model": "default", "max_tokens": 6000, "ignore_eos": True}
LONG_CHAT = {**LONG, "messages": [{"role": "user", "content": "Count."}], "logprobs": True,
             "top_logprobs": 20}  # fmt: skip


def assert_holds_nothing(http: httpx.Client) -> None:
    stats = wait_idle(http, timeout=60)
    assert stats["live_requests"] == 0, stats
    assert stats["pages_locked"] == 0, stats
    assert stats["gateway_in_flight"] == 0, stats


def test_a_stream_nobody_reads_is_cut_and_its_request_aborted(tiny_gateway) -> None:
    server, http = tiny_gateway(stream_idle_timeout_s=1.0, stream_buffer_outputs=1 << 20)
    sock = connect(server.port, rcvbuf=4096)
    try:
        sock.sendall(post("/v1/chat/completions", {**LONG_CHAT, "stream": True}))
        wait_for(lambda: metric(http, CUT, reason="write_stalled") == 1, "the stalled stream cut")
        wait_for(lambda: metric(http, ABORTED, reason="disconnected") == 1, "its abort")
        assert_holds_nothing(http)
        assert metric(http, "radixserve_requests_total", finish_reason="abort") == 1
        assert metric(http, "radixserve_requests_total", finish_reason="length") == 0
    finally:
        sock.close()


def test_a_stream_whose_client_falls_behind_is_aborted_in_the_engine(tiny_gateway) -> None:
    server, http = tiny_gateway(stream_idle_timeout_s=600, stream_buffer_outputs=16)
    sock = connect(server.port, rcvbuf=4096)
    try:
        sock.sendall(post("/v1/chat/completions", {**LONG_CHAT, "stream": True}))
        wait_for(lambda: http.get("/debug/cache").json()["live_requests"] == 1, "it running")
        # aborted in the engine while its response waits, unsent, for the client
        wait_for(lambda: http.get("/debug/cache").json()["live_requests"] == 0, "its abort")
    finally:
        sock.close()  # the response ends with the client
    assert_holds_nothing(http)
    assert metric(http, ABORTED, reason="too_slow") == 1
    assert metric(http, CUT) == 0  # aborted for its buffer, not cut
    assert metric(http, "radixserve_requests_total", finish_reason="length") == 0


def test_a_client_that_leaves_a_non_streamed_request_aborts_it(tiny_gateway) -> None:
    server, http = tiny_gateway()
    sock = connect(server.port)
    try:
        sock.sendall(post("/v1/completions", {**LONG, "prompt": "Count."}))
        wait_for(lambda: http.get("/debug/cache").json()["live_requests"] == 1, "it running")
    finally:
        sock.close()
    wait_for(lambda: metric(http, ABORTED, reason="disconnected") == 1, "its abort")
    assert_holds_nothing(http)
    assert metric(http, "radixserve_requests_total", finish_reason="abort") == 1


def test_a_body_sent_a_byte_at_a_time_gets_408_and_nothing_admitted(tiny_gateway) -> None:
    server, http = tiny_gateway(body_read_timeout_s=1.0)
    body = json.dumps({**LONG, "prompt": "Count."}).encode()
    sock = connect(server.port)
    try:
        sock.sendall(post("/v1/completions", {**LONG, "prompt": "Count."})[: -len(body)])
        reply = trickle(sock, body, interval_s=0.25)
    finally:
        sock.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"connection: close" in head.lower()
    error = json.loads(payload)["error"]
    assert error["code"] == 408 and "body_read_timeout_s" in error["message"], error
    assert metric(http, CUT, reason="body_timeout") == 1
    assert metric(http, "radixserve_requests_total") == 0  # nothing was admitted
    assert_holds_nothing(http)


def test_a_request_head_sent_slowly_is_cut_at_the_header_timeout(tiny_gateway) -> None:
    server, http = tiny_gateway(header_timeout_s=1.0)
    sock = connect(server.port)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\n")
        reply = trickle(sock, b"x-slow: " + b"a" * 4096, interval_s=0.25)
    finally:
        sock.close()
    assert reply == b""  # closed, unanswered
    assert metric(http, CUT, reason="header_timeout") == 1
    assert http.get("/live").status_code == 200  # the server serves on


def test_connections_past_the_cap_are_refused_and_the_open_ones_served(tiny_gateway) -> None:
    server, http = tiny_gateway(max_connections=2)
    first, second = connect(server.port), connect(server.port)
    third = connect(server.port)  # accepted after the first two: one too many
    try:
        refused = read_all(third)
        first.sendall(b"GET /live HTTP/1.1\r\nhost: gateway\r\n\r\n")
        served = first.recv(65536)
    finally:
        for sock in (first, second, third):
            sock.close()
    assert served.startswith(b"HTTP/1.1 200"), served[:200]
    head, _, payload = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), refused[:200]
    error = json.loads(payload)["error"]
    assert error["code"] == 503 and "too many connections" in error["message"], error

    def serves_again() -> bool:  # once the server has seen the sockets close
        try:
            return http.get("/live").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(serves_again, "a new connection served")
    assert metric(http, CUT, reason="over_limit") >= 1


def test_connections_send_without_nagles_delay(tiny_gateway) -> None:
    """Every accepted connection has TCP_NODELAY, though the listening socket was made
    with proto 0 (as an inherited one may be; asyncio then leaves Nagle's algorithm on,
    and each response's second write waited for the client's delayed ACK: 40 ms)."""
    running, http = tiny_gateway()
    assert http.get("/live").status_code == 200  # a kept-alive connection
    connections = list(running.server.server_state.connections)
    assert connections
    for protocol in connections:
        sock = protocol.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
