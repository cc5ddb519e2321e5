"""The transfer suite over ZMQ, plus ZMQ-specific failure modes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from radixserve.transfer import TransferError
from radixserve.transfer.zmq import ZmqTransferAgent, page_runs
from tests.transfer.peer_process import TransferSuite, fill_pattern, make_pool


class TestZmqTransfer(TransferSuite):
    backend = "zmq"


@pytest.fixture
def agents() -> Iterator[tuple[ZmqTransferAgent, ZmqTransferAgent]]:
    owner_pool, compat = make_pool()
    fill_pattern(owner_pool.kv, 3)
    reader_pool, _ = make_pool()
    owner = ZmqTransferAgent("owner", owner_pool.kv, compat)
    reader = ZmqTransferAgent("reader", reader_pool.kv, compat, default_timeout_s=2.0)
    yield owner, reader
    reader.close()
    owner.close()


def _metadata_with_endpoint(metadata: bytes, endpoint: str) -> bytes:
    env = msgpack.unpackb(metadata, raw=False)
    env["backend_md"]["endpoint"] = endpoint
    return msgpack.packb(env, use_bin_type=True)


class _FakeOwner:
    """A ROUTER that answers one read with a header claiming success and `frames`."""

    def __init__(self, frames: list[bytes]) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.frames = frames
        self.thread = threading.Thread(target=self._answer_one, daemon=True)
        self.thread.start()

    def _answer_one(self) -> None:
        if self.sock.poll(5000):
            ident, raw = self.sock.recv_multipart()
            req = msgpack.unpackb(raw, raw=False)
            header = msgpack.packb({"id": req["id"], "ok": True, "error": None})
            self.sock.send_multipart([ident, header, *self.frames])

    def close(self) -> None:
        self.thread.join(6)
        self.sock.close(linger=0)
        self.ctx.destroy(linger=0)


def test_page_runs_are_consecutive_on_both_sides() -> None:
    assert page_runs([5, 2, 3, 4, 0], [9, 14, 15, 3, 6]) == [
        (5, 9, 1),
        (2, 14, 2),
        (4, 3, 1),
        (0, 6, 1),
    ]


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"\0" * 256], "1 of 4 page runs"),  # one frame where 2 layers x K,V = 4 are due
        ([b"\0" * 128] * 4, "128 bytes, expected 256"),  # short frames (page is 256 B)
        ([b"\0" * 256] * 5, "more frames"),
    ],
)
def test_short_or_oversized_reply_fails(
    agents: tuple[ZmqTransferAgent, ZmqTransferAgent], frames: list[bytes], reason: str
) -> None:
    owner, reader = agents
    fake = _FakeOwner(frames)
    try:
        reader.add_peer("owner", 1, _metadata_with_endpoint(owner.metadata(), fake.endpoint))
        with pytest.raises(TransferError, match=reason):
            reader.wait(reader.read_pages("owner", [1], [2]))
    finally:
        fake.close()


def test_owner_checks_compat_hash_of_every_request(
    agents: tuple[ZmqTransferAgent, ZmqTransferAgent],
) -> None:
    owner, _ = agents
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(msgpack.unpackb(owner.metadata(), raw=False)["backend_md"]["endpoint"])
        request = {"op": "read", "id": 7, "from": "x", "compat": "0" * 64, "runs": [[0, 1]]}
        sock.send(msgpack.packb(request))
        assert sock.poll(5000)
        reply = sock.recv_multipart()
        header = msgpack.unpackb(reply[0], raw=False)
        assert len(reply) == 1 and header["id"] == 7 and not header["ok"]
        assert "incompatible" in header["error"]
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)


def test_out_of_range_run_is_refused_by_owner(
    agents: tuple[ZmqTransferAgent, ZmqTransferAgent],
) -> None:
    owner, reader = agents
    env = msgpack.unpackb(owner.metadata(), raw=False)
    env["num_pages"] = 64  # the reader believes the owner is bigger than it is
    reader.add_peer("owner", 1, msgpack.packb(env, use_bin_type=True))
    with pytest.raises(TransferError, match="out of range"):
        reader.wait(reader.read_pages("owner", [40], [0]))


def test_nobody_listening_fails_after_timeout(
    agents: tuple[ZmqTransferAgent, ZmqTransferAgent],
) -> None:
    owner, reader = agents
    probe = zmq.Context()
    sock = probe.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:0")
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close(linger=0)
    probe.destroy(linger=0)
    reader.add_peer("owner", 1, _metadata_with_endpoint(owner.metadata(), endpoint))
    start = time.monotonic()
    handle = reader.read_pages("owner", [0], [0], timeout_s=0.5)
    with pytest.raises(TransferError, match="timed out"):
        reader.wait(handle)
    assert 0.4 < time.monotonic() - start < 3.0
    assert reader.poll(handle) == "failed"
