"""The transfer suite over ZMQ, plus ZMQ-specific failure modes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from radixserve.transfer import TransferError
from radixserve.transfer.zmq import MAX_READ_RUNS, MAX_REQUEST_BYTES, ZmqTransferAgent, page_runs
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


def _ask_owner(owner: ZmqTransferAgent, raw: bytes) -> dict | None:
    """Send one raw request to `owner`'s socket; its reply header (None: no reply)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(msgpack.unpackb(owner.metadata(), raw=False)["backend_md"]["endpoint"])
        sock.send(raw)
        if not sock.poll(2000):
            return None
        reply = sock.recv_multipart()
        header: dict = msgpack.unpackb(reply[0], raw=False)
        assert header["ok"] or len(reply) == 1  # a refusal carries no page frames
        return header
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)


def _read_request(owner: ZmqTransferAgent, runs: list[list[int]]) -> bytes:
    request = {"op": "read", "id": 9, "from": "x", "compat": owner.compat.digest, "runs": runs}
    return msgpack.packb(request)


def test_owner_refuses_and_counts_too_many_runs_and_pages_outside_its_pool(
    agents: tuple[ZmqTransferAgent, ZmqTransferAgent],
) -> None:
    owner, _ = agents
    assert _ask_owner(owner, _read_request(owner, [[0, 1]]))["ok"]  # a good read is served
    assert owner.refused_reads == 0
    header = _ask_owner(owner, _read_request(owner, [[0, 1]] * (MAX_READ_RUNS + 1)))
    assert header is not None and not header["ok"] and "at most" in header["error"]
    assert owner.refused_reads == 1
    header = _ask_owner(owner, _read_request(owner, [[owner.num_pages - 1, 2]]))
    assert header is not None and not header["ok"] and "out of range" in header["error"]
    assert owner.refused_reads == 2


def test_owner_drops_a_request_over_its_message_size(
    agents: tuple[ZmqTransferAgent, ZmqTransferAgent],
) -> None:
    """ZMQ_MAXMSGSIZE: a frame over MAX_REQUEST_BYTES disconnects the peer before the
    owner reads it, so nothing is decoded or answered."""
    owner, reader = agents
    big = msgpack.packb({"op": "read", "pad": b"x" * (MAX_REQUEST_BYTES + 1)})
    assert _ask_owner(owner, big) is None
    assert owner.refused_reads == 0  # never reached the decoder
    reader.add_peer("owner", 1, owner.metadata())  # and the owner still serves
    reader.wait(reader.read_pages("owner", [1], [1]))


def test_a_read_needing_more_runs_than_served_fails_at_the_reader(
    agents: tuple[ZmqTransferAgent, ZmqTransferAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, reader = agents
    monkeypatch.setattr("radixserve.transfer.zmq.MAX_READ_RUNS", 2)
    reader.add_peer("owner", 1, owner.metadata())
    with pytest.raises(TransferError, match="split it"):
        reader.wait(reader.read_pages("owner", [0, 2, 4], [0, 1, 2]))
    assert owner.refused_reads == 0  # never sent


def test_an_owner_enforcing_grants_serves_only_pages_lent_to_the_reader(
    agents: tuple[ZmqTransferAgent, ZmqTransferAgent],
) -> None:
    owner, reader = agents
    reader.add_peer("owner", 1, owner.metadata())
    reader.wait(reader.read_pages("owner", [2], [2]))  # grants not enforced: served
    owner.enforce_grants()
    with pytest.raises(TransferError, match="not lent to 'reader'"):
        reader.wait(reader.read_pages("owner", [2], [2]))  # nothing granted
    assert owner.refused_reads == 1
    owner.grant("reader", [2, 3])
    owner.grant("another", [5])
    reader.wait(reader.read_pages("owner", [2, 3], [0, 1]))  # lent: served
    with pytest.raises(TransferError, match="not lent"):
        reader.wait(reader.read_pages("owner", [3, 5], [0, 1]))  # 5 is another's
    assert owner.refused_reads == 2
    owner.grant("reader", [3])  # a second lease of page 3
    owner.revoke("reader", [2, 3])
    reader.wait(reader.read_pages("owner", [3], [0]))  # still lent once
    with pytest.raises(TransferError, match="not lent"):
        reader.wait(reader.read_pages("owner", [2], [0]))  # returned
    owner.revoke("reader")  # every grant of the reader
    with pytest.raises(TransferError, match="not lent"):
        reader.wait(reader.read_pages("owner", [3], [0]))
    assert owner.refused_reads == 4
    assert owner.grants.num_pages() == 1  # another's page 5


def test_a_grant_covers_the_readers_tensor_parallel_ranks(
    agents: tuple[ZmqTransferAgent, ZmqTransferAgent],
) -> None:
    """A rank's agent is named ``<worker>.tp<N>``: a grant to the worker covers it, and
    the name as declared is all the owner goes by (a request may claim any name)."""
    owner, _ = agents
    owner.enforce_grants()
    owner.grant("decode-0", [1])

    def ask(name: str) -> dict | None:
        request = {"op": "read", "id": 9, "from": name, "compat": owner.compat.digest,
                   "runs": [[1, 1]]}  # fmt: skip
        return _ask_owner(owner, msgpack.packb(request))

    assert ask("decode-0")["ok"] and ask("decode-0.tp3")["ok"]
    for name in ("decode-1", "decode-0.spill", "decode-0.tpx", "decode-01"):
        header = ask(name)
        assert header is not None and not header["ok"] and "not lent" in header["error"]
    assert owner.refused_reads == 4
