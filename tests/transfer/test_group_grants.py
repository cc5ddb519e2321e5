"""Grants across a worker's tensor-parallel ranks: `GroupAgent.grant` and `revoke` reach
every rank's agent (rank 1's runs on its `serve_rank` thread here, as in a rank process),
so a reader is served the granted pages by every rank and refused the others by each."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from radixserve.transfer import KVTransferAgent, create_agent
from radixserve.transfer.group import GroupAgent
from radixserve.transfer.rank_agent import serve_rank
from tests.transfer.peer_process import fill_pattern
from tests.transfer.test_tp_transfer import _compat, _shards, _whole


def _agent(name: str, rank: int, size: int) -> KVTransferAgent:
    shard = _shards(size)[rank]
    reference = _whole()
    fill_pattern(reference.kv, 1)
    kv = reference.kv[..., shard.first : shard.first + shard.count, :].contiguous()
    return create_agent("zmq", name, kv, _compat(), default_timeout_s=5.0, shard=shard)


def _read(reader: GroupAgent, owner: GroupAgent, remote: list[int], local: list[int]) -> str:
    """Read ``remote`` pages of the owner into ``local``: "done", or the error."""
    handle = reader.read_pages("prefill-0", remote, local)
    while reader.poll(handle) == "pending":
        owner.serve_reads()
        time.sleep(0.001)
    return "done" if handle.state == "done" else str(handle.error)


@pytest.fixture
def owner_and_reader() -> Iterator[tuple[GroupAgent, GroupAgent, KVTransferAgent]]:
    owner = GroupAgent(_agent("prefill-0", 0, 2), size=2)
    rank1 = _agent("prefill-0.tp1", 1, 2)
    thread = serve_rank(rank1, owner.endpoint, 1)
    owner.wait_ranks()
    reader = GroupAgent(_agent("decode-0", 0, 1))
    reader.add_peer("prefill-0", 1, owner.metadata())
    yield owner, reader, rank1
    reader.close()
    owner.close()  # tells rank 1 to close its agent
    thread.join(5)


def test_grants_reach_every_rank(owner_and_reader) -> None:
    owner, reader, rank1 = owner_and_reader
    assert _read(reader, owner, [1], [1]) == "done"  # not enforced: served
    owner.enforce_grants()
    owner.grant("decode-0", [2, 3])
    assert _read(reader, owner, [2, 3], [0, 1]) == "done"  # both ranks serve it
    error = _read(reader, owner, [4], [0])
    assert "not lent to 'decode-0'" in error, error
    owner.revoke("decode-0", [2])
    assert "not lent" in _read(reader, owner, [2], [0])
    assert _read(reader, owner, [3], [0]) == "done"
    # each rank refused the two reads of its heads
    assert owner.refused_reads == 2 and rank1.refused_reads == 2
