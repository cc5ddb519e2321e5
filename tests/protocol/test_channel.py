"""Channels over real ZMQ sockets: threads, a child process, asyncio, bad frames."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from radixserve.protocol.channel import AsyncChannel, Channel
from radixserve.protocol.codec import ProtocolError
from radixserve.protocol.link_messages import Heartbeat, Hello, HelloAck
from radixserve.protocol.messages import PROTOCOL_VERSION, Abort, GenerateRequest, TokenChunk
from radixserve.protocol.sampling import SamplingSpec
from radixserve.protocol.stats_messages import EngineSection, ServiceStats
from radixserve.protocol.wire import Message

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCAL = "tcp://127.0.0.1:*"
WAIT_MS = 5000


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes any socket a failed test left open


def run_in_thread(fn: Callable[[], None]) -> Callable[[], None]:
    """Start ``fn`` in a thread; the returned join re-raises what it raised."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def join() -> None:
        thread.join(timeout=10)
        assert not thread.is_alive(), "peer thread hung"
        if errors:
            raise errors[0]

    return join


def test_dealer_router_between_threads_survives_a_garbage_frame(
    ctx: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    request = GenerateRequest("req-1", (5, 6, 7), SamplingSpec(max_tokens=3, seed=1))
    with Channel.open(ctx, zmq.ROUTER, LOCAL, bind=True) as router:

        def worker() -> None:
            with Channel.open(
                ctx, zmq.DEALER, router.endpoint, bind=False, identity=b"decode-0"
            ) as dealer:
                dealer.send(Hello("decode-0", "decode", generation=2))
                ack = dealer.recv(WAIT_MS)
                assert ack == HelloAck("gateway", "gateway")
                dealer.socket.send(b"\xc1 not msgpack")
                dealer.socket.send_multipart([b"one", b"two"])
                got = dealer.recv(WAIT_MS)
                assert isinstance(got, GenerateRequest)
                dealer.send(TokenChunk(got.request_id, got.prompt_token_ids[::-1], "x"))

        join = run_in_thread(worker)
        assert router.recv_from(WAIT_MS) == (b"decode-0", Hello("decode-0", "decode", 2))
        router.send_to(b"decode-0", HelloAck("gateway", "gateway"))
        with caplog.at_level(logging.WARNING, logger="radixserve.protocol.channel"):
            with pytest.raises(ProtocolError, match="not valid msgpack") as garbage:
                router.recv_from(WAIT_MS)
            with pytest.raises(ProtocolError, match="expected 1 message frame, got 2"):
                router.recv_from(WAIT_MS)
        assert garbage.value.identity == b"decode-0"
        assert "bad frame on ROUTER" in caplog.text
        router.send_to(b"decode-0", request)
        assert router.recv_from(WAIT_MS) == (b"decode-0", TokenChunk("req-1", (7, 6, 5), "x"))
        join()
    assert router.closed


def test_push_pull_between_threads_and_timeouts(ctx: zmq.Context) -> None:
    sent = [Heartbeat("prefill-0", 1, stats=ServiceStats(tasks=3, uptime_s=0.5)), Abort("r")]
    with Channel.open(ctx, zmq.PULL, LOCAL, bind=True) as pull:
        start = time.monotonic()
        assert pull.recv(50) is None
        assert pull.recv(0) is None
        assert time.monotonic() - start >= 0.04

        received = threading.Event()

        def worker() -> None:
            with Channel.open(ctx, zmq.PUSH, pull.endpoint, bind=False) as push:
                push.socket.send(msgpack_map_without_tag())
                for msg in sent:
                    push.send(msg, timeout_ms=WAIT_MS)
                received.wait(WAIT_MS / 1000)  # linger 0: closing early would drop them

        join = run_in_thread(worker)
        with pytest.raises(ProtocolError, match="frame has no string 'type' tag") as bad:
            pull.recv(WAIT_MS)
        assert bad.value.identity is None
        assert [pull.recv(WAIT_MS), pull.recv(WAIT_MS)] == sent
        received.set()
        join()


def msgpack_map_without_tag() -> bytes:
    return msgpack.packb({"v": [PROTOCOL_VERSION[0], 0]})


def test_ipc_address_and_send_timeout_without_peer(ctx: zmq.Context, tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/chan.sock"
    with Channel.open(ctx, zmq.PUSH, address, bind=True) as push:
        with pytest.raises(TimeoutError, match="could not send within 50 ms"):
            push.send(Abort("r"), timeout_ms=50)
        with Channel.open(ctx, zmq.PULL, address, bind=False) as pull:
            push.send(Abort("r"), timeout_ms=WAIT_MS)
            assert pull.recv(WAIT_MS) == Abort("r")


def test_misuse_is_refused_clearly(ctx: zmq.Context) -> None:
    with Channel.open(ctx, zmq.ROUTER, LOCAL, bind=True) as router:
        with pytest.raises(ValueError, match="ROUTER socket receives with recv_from"):
            router.recv(0)
        with pytest.raises(ValueError, match=r"ROUTER socket sends with send_to\(identity, msg\)"):
            router.send(Abort("r"))
        with Channel.open(ctx, zmq.DEALER, router.endpoint, bind=False) as dealer:
            with pytest.raises(ValueError, match="DEALER socket receives with recv"):
                dealer.recv_from(0)
            with pytest.raises(ValueError, match=r"DEALER socket sends with send\(msg\)"):
                dealer.send_to(b"x", Abort("r"))
            with pytest.raises(ProtocolError, match=r"abort.request_id"):
                dealer.send(Abort(""))  # invalid messages never leave the sender
    with Channel.open(ctx, zmq.PULL, LOCAL, bind=True) as pull:
        with pytest.raises(ValueError, match="PULL socket cannot send"):
            pull.send(Abort("r"))
        with (
            Channel.open(ctx, zmq.PUSH, pull.endpoint, bind=False) as push,
            pytest.raises(ValueError, match="PUSH socket cannot receive"),
        ):
            push.recv(0)
    with pytest.raises(ValueError, match="unsupported socket type"):
        Channel.open(ctx, zmq.PUB, LOCAL, bind=True)
    with pytest.raises(ValueError, match="address must be tcp://"):
        Channel.open(ctx, zmq.PULL, "udp://127.0.0.1:5", bind=True)
    pull.close()  # idempotent


CHILD = textwrap.dedent(
    """
    import sys, zmq
    from radixserve.protocol.channel import Channel
    from radixserve.protocol.codec import ProtocolError
    from radixserve.protocol.link_messages import Hello, HelloAck
    from radixserve.protocol.messages import GenerateRequest, TokenChunk

    ctx = zmq.Context()
    with Channel.open(ctx, zmq.DEALER, sys.argv[1], bind=False, identity=b"child") as chan:
        chan.send(Hello("child", "prefill", generation=7))
        assert chan.recv(10000) == HelloAck("parent", "gateway"), "no ack"
        chan.socket.send(b"garbage from the child")
        try:
            chan.recv(10000)
            raise SystemExit("garbage frame was accepted")
        except ProtocolError:
            pass
        req = chan.recv(10000)
        assert isinstance(req, GenerateRequest), req
        chan.send(TokenChunk(req.request_id, req.prompt_token_ids[::-1], "done",
                             finished=True, finish_reason="stop"))
    ctx.term()
    """
)


def test_dealer_router_between_processes(ctx: zmq.Context) -> None:
    with Channel.open(ctx, zmq.ROUTER, LOCAL, bind=True) as router:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, router.endpoint],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert router.recv_from(15000) == (b"child", Hello("child", "prefill", 7))
            router.send_to(b"child", HelloAck("parent", "gateway"))
            with pytest.raises(ProtocolError) as bad:
                router.recv_from(WAIT_MS)
            assert bad.value.identity == b"child"
            router.socket.send_multipart([b"child", b"\xff\x00junk"])
            router.send_to(b"child", GenerateRequest("p-1", (1, 2, 3)))
            reply = router.recv_from(WAIT_MS)
            _, stderr = child.communicate(timeout=15)
            assert child.returncode == 0, stderr
        finally:
            child.kill()
            child.wait()
    assert reply == (b"child", TokenChunk("p-1", (3, 2, 1), "done", True, "stop"))


async def _async_exchange() -> list[Message | tuple[bytes, Message] | None]:
    actx = zmq.asyncio.Context()
    try:
        async with (
            AsyncChannel.open(actx, zmq.ROUTER, LOCAL, bind=True) as router,
            AsyncChannel.open(
                actx, zmq.DEALER, router.endpoint, bind=False, identity=b"w1"
            ) as dealer,
        ):
            got: list[Message | tuple[bytes, Message] | None] = [await router.recv_from(20)]
            await dealer.send(
                Heartbeat("w1", 0, stats=ServiceStats(engine=EngineSection(pages_free=10))),
                timeout_ms=WAIT_MS,
            )
            got.append(await router.recv_from(WAIT_MS))
            await dealer.socket.send_multipart([b"\x93"])  # a truncated array
            with pytest.raises(ProtocolError, match="not valid msgpack") as bad:
                await router.recv_from(WAIT_MS)
            assert bad.value.identity == b"w1"
            await router.send_to(b"w1", Abort("r"), timeout_ms=WAIT_MS)
            got.append(await dealer.recv(WAIT_MS))
            got.append(await dealer.recv(0))
        assert router.closed and dealer.closed
        return got
    finally:
        actx.destroy(linger=0)


def test_asyncio_dealer_router() -> None:
    got = asyncio.run(asyncio.wait_for(_async_exchange(), timeout=15))
    assert got == [
        None,
        (b"w1", Heartbeat("w1", 0, stats=ServiceStats(engine=EngineSection(pages_free=10)))),
        Abort("r"),
        None,
    ]
