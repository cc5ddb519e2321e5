"""A link to an address by host name (``tcp://kvstore-a:7000``) is resolved by the link
set, off the event loop, and its socket connected to the address found: ZMQ never
resolves it (it would, on its one I/O thread, at every reconnect, stalling every socket
of the process while a stopped container's name takes seconds to fail). While the link
is down the name is resolved again, so a peer that comes back at another address (a
restarted pod) is followed.

Real sockets: a ROUTER on loopback answers hellos and heartbeats as a service does. The
resolver is the event loop's, replaced here (no DNS server can be made to answer for a
test name): one name resolves to 127.0.0.1 then to 127.0.0.2, another never answers
within the test."""

from __future__ import annotations

import asyncio
import socket

import zmq
import zmq.asyncio

from radixserve.protocol import AsyncChannel, Heartbeat, Hello, HelloAck
from radixserve.runtime.links import LinkIdentity, LinkSet

ME = LinkIdentity("gw", "gateway", 1, interval_s=0.05, peer_timeout_s=0.5)


async def serve(
    context: zmq.asyncio.Context, endpoint: str, name: str
) -> tuple[AsyncChannel, asyncio.Task]:
    """A ROUTER at ``endpoint`` answering as the service ``name`` would."""
    router = AsyncChannel.open(context, zmq.ROUTER, endpoint, bind=True)

    async def answer() -> None:
        while True:
            got = await router.recv_from()
            if got is None:
                continue
            identity, msg = got
            if isinstance(msg, Hello):
                await router.send_to(identity, HelloAck(name, "kvstore", 1), timeout_ms=100)
            elif isinstance(msg, Heartbeat):
                await router.send_to(identity, Heartbeat(name, 1), timeout_ms=100)

    return router, asyncio.create_task(answer())


async def until(condition, timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_a_named_peer_is_dialled_at_its_resolved_address_and_followed_when_it_moves(
    monkeypatch,
) -> None:
    asyncio.run(_named_peer(monkeypatch))


async def _named_peer(monkeypatch) -> None:
    context = zmq.asyncio.Context()
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo
    where = {"node-a.test": "127.0.0.1"}
    asked: list[str] = []

    async def fake(host, port, *args, **kwargs):
        asked.append(host)
        if host == "stuck.test":  # a name that does not answer within the test
            await asyncio.sleep(60)
        if host in where:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (where[host], port))]
        return await real(host, port, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", fake)
    first, task = await serve(context, "tcp://127.0.0.1:*", "kv-1")
    port = int(first.socket.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    links = LinkSet(context, [f"tcp://stuck.test:{port}", f"tcp://node-a.test:{port}"], ME,
                    on_message=lambda link, msg: None)  # fmt: skip
    stuck, named = links.links
    links.start()
    try:
        # the name that hangs holds nothing up: the other link is up at once
        await until(lambda: named.up, 5, "the named link up")
        assert named.endpoint == f"tcp://127.0.0.1:{port}" and named.name == "kv-1"
        assert not stuck.up and stuck.endpoint == "" and "stuck.test" in asked
        # ZMQ was given the address, never the name
        assert named.channel.socket.getsockopt(zmq.LAST_ENDPOINT).decode().startswith(
            "tcp://127.0.0.1:")  # fmt: skip
        # the peer comes back elsewhere (another address, the same port): followed once
        # its link is down
        task.cancel()
        first.close()
        where["node-a.test"] = "127.0.0.2"
        second, task = await serve(context, f"tcp://127.0.0.2:{port}", "kv-2")
        await until(lambda: not named.up, 5, "the old peer's link down")
        await until(lambda: named.up and named.name == "kv-2", 10, "the link up at the new address")
        assert named.endpoint == f"tcp://127.0.0.2:{port}"
        second.close()
    finally:
        task.cancel()
        await links.close()
        context.term()
