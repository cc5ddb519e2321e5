"""The decode worker's token endpoint (`radixserve.runtime.token_endpoint`), in process over
the fake engine (`tests.fake_engine`: no model; its outputs reach the worker's sink as
`AsyncEngine`'s do), with test sockets speaking the protocol as gateways: a gateway on
the endpoint gets every message of its request there, in order and none on the control
socket; two gateways get only their own; one not on it (or gone from it mid-stream, or
without the cluster's keys) gets the request, or the rest of it, on the control socket,
in order; the endpoint can be turned off."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from radixserve.errors import ConfigurationError
from radixserve.protocol import AsyncChannel, Heartbeat, Message, TokenChunk
from radixserve.protocol.security import ClusterKeys, keys_from
from radixserve.runtime.token_endpoint import token_routing_id
from radixserve.services.decode.settings import DecodeSettings
from radixserve.services.decode.worker import DecodeWorker
from tests.decode.test_decode_worker import LOCAL_TOKENS, SHORT, request
from tests.fake_engine import FakeEngine, PeerSocket, run_scenario, serving, until

SECRET = "a-token-endpoint-test-secret-0123456789"


@contextlib.asynccontextmanager
async def worker_and_gateway(
    context: zmq.asyncio.Context, engine: FakeEngine, keys: ClusterKeys | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[DecodeWorker, PeerSocket]]:  # fmt: skip
    """A decode worker with no prefill worker, and a gateway's control socket past its
    hello (``gateway-test``, generation 1)."""
    worker = DecodeWorker(DecodeSettings(transfer_backend="zmq", heartbeat_interval_s=0.05,
                                         **settings), engine)  # fmt: skip
    async with serving(worker):
        gateway = PeerSocket(context, worker.address, keys)
        try:
            await gateway.hello("gateway-test", "gateway")
            yield worker, gateway
        finally:
            gateway.close()


async def on_endpoint(
    context: zmq.asyncio.Context, port: int, name: str = "gateway-test",
    keys: ClusterKeys | None = None, timeout_s: float = 5.0,
) -> AsyncChannel:  # fmt: skip
    """A gateway's DEALER on the token endpoint at ``port``, its handshake done
    (`TimeoutError` if it is not within ``timeout_s``)."""
    address = f"tcp://127.0.0.1:{port}"
    channel = AsyncChannel.open(context, zmq.DEALER, address, bind=False,
                                identity=token_routing_id(name, 1), keys=keys, connect=False)  # fmt: skip
    monitor = channel.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        channel.socket.connect(address)
        await asyncio.wait_for(monitor.recv_multipart(), timeout_s)
    except BaseException:
        monitor.close(linger=0)
        channel.close()
        raise
    channel.socket.disable_monitor()
    monitor.close(linger=0)
    return channel


async def received(channel: AsyncChannel, request_id: str) -> list[TokenChunk]:
    """``request_id``'s chunks on ``channel`` until its finished one."""
    chunks: list[TokenChunk] = []
    while not chunks or not chunks[-1].finished:
        msg = await channel.recv(timeout_ms=5000)
        assert isinstance(msg, TokenChunk) and msg.request_id == request_id, msg
        chunks.append(msg)
    return chunks


async def nothing_on(gateway: PeerSocket, within_s: float = 0.3) -> None:
    """No message but heartbeats on ``gateway``'s control socket for ``within_s``."""
    with pytest.raises(AssertionError, match="within"):
        await gateway.recv(Message, timeout_s=within_s)


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def test_a_gateway_on_the_token_endpoint_gets_its_whole_request_there_in_order() -> None:
    """Every chunk (the engine thread's, and the last one, the loop's) comes on the
    endpoint in order; the control socket carries none; the counters say so."""
    seen: dict[str, Any] = {}

    async def scenario(context: zmq.asyncio.Context) -> None:
        async with worker_and_gateway(context, FakeEngine(base_token=100)) as (worker, gateway):
            assert gateway.ack is not None and gateway.ack.token_port
            tokens_in = await on_endpoint(context, gateway.ack.token_port)
            try:
                await gateway.send(request("r1", SHORT))
                seen["chunks"] = await received(tokens_in, "r1")
                await nothing_on(gateway)
                seen["stats"] = worker.stats().decode
            finally:
                tokens_in.close()

    run_scenario(scenario)
    chunks = seen["chunks"]
    assert tokens(chunks) == LOCAL_TOKENS
    assert [c.finished for c in chunks] == [False, False, False, True]
    assert chunks[-1].route == "local"  # the last one carries what only the loop knows
    assert seen["stats"].token_endpoint_messages_total == len(LOCAL_TOKENS)
    assert seen["stats"].token_fallbacks_total == 0


def test_two_gateways_each_get_only_their_own_requests_tokens() -> None:
    seen: dict[str, Any] = {}

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine(base_token=100)
        async with worker_and_gateway(context, engine) as (worker, a):
            b = PeerSocket(context, worker.address)
            await b.hello("gateway-b", "gateway")
            port = worker.tokens.port if worker.tokens else 0
            a_in = await on_endpoint(context, port)
            b_in = await on_endpoint(context, port, "gateway-b")
            try:
                await a.send(request("ra", SHORT))
                await b.send(request("rb", SHORT))
                seen["a"], seen["b"] = await asyncio.gather(received(a_in, "ra"),
                                                            received(b_in, "rb"))  # fmt: skip
                seen["stats"] = worker.stats().decode
            finally:
                a_in.close()
                b_in.close()
                b.close()

    run_scenario(scenario)
    assert tokens(seen["a"]) == tokens(seen["b"]) == LOCAL_TOKENS
    assert seen["stats"].token_endpoint_messages_total == 2 * len(LOCAL_TOKENS)
    assert seen["stats"].token_fallbacks_total == 0


def test_a_gateway_not_on_the_endpoint_gets_its_request_on_the_control_socket() -> None:
    seen: dict[str, Any] = {}

    async def scenario(context: zmq.asyncio.Context) -> None:
        async with worker_and_gateway(context, FakeEngine(base_token=100)) as (worker, gateway):
            await gateway.send(request("r1", SHORT))
            seen["stream"] = await gateway.stream("r1")
            await until(lambda: not worker.tasks, "the request's task to end")
            seen["stats"] = worker.stats().decode

    run_scenario(scenario)
    assert seen["stream"] == (LOCAL_TOKENS, None)
    assert seen["stats"].token_endpoint_messages_total == 0
    assert seen["stats"].token_fallbacks_total == 1


def test_a_gateway_gone_from_the_endpoint_mid_stream_gets_the_rest_on_the_control_socket() -> None:
    """Two tokens on the endpoint; the gateway's DEALER closes; once the worker sees it
    gone, the held stream goes on: the rest comes on the control socket, in order, none
    twice and none lost."""
    seen: dict[str, Any] = {}

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine(base_token=100, hold_after=2)
        async with worker_and_gateway(context, engine) as (worker, gateway):
            assert gateway.ack is not None and worker.tokens is not None
            tokens_in = await on_endpoint(context, gateway.ack.token_port)
            await gateway.send(request("r1", SHORT))
            first = [await tokens_in.recv(timeout_ms=5000) for _ in range(2)]
            tokens_in.close()
            # the worker's socket has dropped the route once a send to it fails (the
            # probe goes nowhere: nobody is connected under that id any more)
            gone = token_routing_id("gateway-test", 1)
            probe = Heartbeat("probe")
            endpoint, probes = worker.tokens, []

            def dropped() -> bool:
                probes.append(endpoint.send(gone, probe))
                return not probes[-1]

            await until(dropped, "the route to drop")
            seen["probes_sent"] = sum(probes)
            engine.release.set()
            seen["first"] = first
            seen["rest"] = await gateway.stream("r1")
            await until(lambda: not worker.tasks, "the request's task to end")
            seen["stats"] = worker.stats().decode

    run_scenario(scenario)
    assert [t for c in seen["first"] for t in c.token_ids] == LOCAL_TOKENS[:2]
    assert seen["rest"] == (LOCAL_TOKENS[2:], None)
    assert seen["stats"].token_fallbacks_total == 1
    assert seen["stats"].token_endpoint_messages_total - seen["probes_sent"] == 2


def test_only_a_gateway_with_the_cluster_keys_gets_on_the_endpoint() -> None:
    """The endpoint is a CURVE server with the control socket's keys: a DEALER without
    them never completes its handshake, and its gateway's tokens come on the (secure)
    control socket; with them, on the endpoint."""
    seen: dict[str, Any] = {}
    keys = keys_from(SECRET)

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine(base_token=100)
        async with worker_and_gateway(context, engine, keys, cluster_secret=SECRET) as (
            worker,
            gateway,
        ):
            assert gateway.ack is not None
            port = gateway.ack.token_port
            with pytest.raises(TimeoutError):
                await on_endpoint(context, port, keys=None, timeout_s=1.0)
            await gateway.send(request("r1", SHORT))
            seen["without"] = await gateway.stream("r1")
            tokens_in = await on_endpoint(context, port, keys=keys)
            try:
                await gateway.send(request("r2", SHORT))
                seen["with"] = tokens(await received(tokens_in, "r2"))
            finally:
                tokens_in.close()
            seen["stats"] = worker.stats().decode

    run_scenario(scenario)
    assert seen["without"] == (LOCAL_TOKENS, None)
    assert seen["with"] == LOCAL_TOKENS
    assert seen["stats"].token_endpoint_messages_total == len(LOCAL_TOKENS)


def test_with_the_endpoint_off_the_handshake_names_none_and_tokens_use_the_control_socket() -> None:
    seen: dict[str, Any] = {}

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine(base_token=100)
        async with worker_and_gateway(context, engine, token_endpoint=False) as (worker, gateway):
            seen["ack"] = gateway.ack
            seen["tokens"] = worker.tokens
            await gateway.send(request("r1", SHORT))
            seen["stream"] = await gateway.stream("r1")

    run_scenario(scenario)
    assert seen["ack"].token_port == 0 and seen["tokens"] is None
    assert seen["stream"] == (LOCAL_TOKENS, None)


def test_a_token_port_in_use_stops_the_worker_with_an_error_naming_it() -> None:
    seen: dict[str, Any] = {}

    async def scenario(_context: zmq.asyncio.Context) -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            worker = DecodeWorker(DecodeSettings(transfer_backend="zmq", token_port=port),
                                  FakeEngine())  # fmt: skip
            with pytest.raises(ConfigurationError) as raised:
                await worker.run(asyncio.Event())
            seen["error"], seen["port"] = str(raised.value), port

    run_scenario(scenario)
    assert seen["error"] == (
        f"the decode worker's token endpoint cannot listen on tcp://127.0.0.1:{seen['port']}: "
        "Address already in use (RADIXSERVE_DECODE_TOKEN_PORT sets its port; 0 takes any "
        "free one)"
    )
