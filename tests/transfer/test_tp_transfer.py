"""Pages between pools of different tensor-parallel sizes, over NIXL and ZMQ: each rank
reads from each peer rank exactly the KV heads it needs (`head_sources`), in one read per
rank pair, and the pages reassemble bit for bit. The agents run in this process (real
agents, real UCX and TCP transfers), the owners driven by the same wait loop."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.transfer import KVShard, KVTransferAgent, PoolCompat, TransferError, create_agent
from radixserve.transfer.shards import head_sources, tp_pair_error
from tests.transfer.peer_process import fill_pattern

HEADS, PAGES = 4, 12  # the model's KV heads; pages in every pool
REMOTE, LOCAL = [5, 2, 3, 11, 0], [9, 6, 7, 1, 4]


def _compat() -> PoolCompat:
    return PoolCompat.of(_whole().kv, "tiny")


def _whole() -> KVPool:
    # 2 layers, every KV head, pages of 4 tokens, head dim 8
    return KVPool(2, HEADS, 8, 4, PAGES, torch.float32, torch.device("cpu"))


def _shards(size: int) -> list[KVShard]:
    """The KV heads of each rank of a TP=size worker (replicated past the model's heads)."""
    count = max(1, HEADS // size)
    return [KVShard(size, r, (r * count) % HEADS if size <= HEADS else r * HEADS // size, count)
            for r in range(size)]  # fmt: skip


class Group:
    """The ranks of one worker: a pool and an agent each."""

    def __init__(self, backend: str, name: str, size: int, seed: int | None) -> None:
        reference = _whole()
        if seed is not None:
            fill_pattern(reference.kv, seed)
        else:
            reference.kv.fill_(-1.0)
        self.shards = _shards(size)
        self.agents: list[KVTransferAgent] = []
        for shard in self.shards:
            kv = reference.kv[..., shard.first : shard.first + shard.count, :].contiguous()
            self.agents.append(create_agent(backend, f"{name}.tp{shard.rank}", kv, _compat(),
                                            default_timeout_s=10.0, shard=shard))  # fmt: skip

    def close(self) -> None:
        for agent in self.agents:
            agent.close()


def _move(reader: Group, owner: Group) -> int:
    """Every reader rank reads its heads of REMOTE into LOCAL; the number of reads."""
    handles = []
    for agent in reader.agents:
        for i, heads in head_sources(agent.shard, owner.shards):
            peer = owner.agents[i]
            if peer.name not in agent.peers:
                agent.add_peer(peer.name, 1, peer.metadata())
            handles.append((agent, agent.read_pages(peer.name, REMOTE, LOCAL, heads=heads)))
    deadline = time.monotonic() + 20
    while any(a.poll(h) == "pending" for a, h in handles) and time.monotonic() < deadline:
        for peer in owner.agents:
            peer.serve_reads()
    assert [a.poll(h) for a, h in handles] == ["done"] * len(handles), [h.error for _, h in handles]
    return len(handles)


@pytest.fixture(params=["nixl", "zmq"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def groups(backend: str) -> Iterator[list[Group]]:
    made: list[Group] = []
    yield made
    for group in made:
        group.close()


@pytest.mark.parametrize(
    ("owner_tp", "reader_tp", "reads"),
    [(2, 1, 2), (1, 2, 2), (2, 2, 2), (2, 4, 4), (4, 2, 4), (8, 1, 4)],
)
def test_pages_reassemble_across_tp_sizes(
    backend: str, groups: list[Group], owner_tp: int, reader_tp: int, reads: int
) -> None:
    owner = Group(backend, "prefill", owner_tp, seed=1)
    reader = Group(backend, "decode", reader_tp, seed=None)
    groups += [owner, reader]
    assert _move(reader, owner) == reads  # one read per (reader rank, owner rank) pair
    expected = _whole()
    fill_pattern(expected.kv, 1)
    for agent, shard in zip(reader.agents, reader.shards):
        want = expected.kv[:, :, REMOTE][..., shard.first : shard.first + shard.count, :]
        assert torch.equal(agent.kv[:, :, LOCAL], want)
        others = [p for p in range(PAGES) if p not in LOCAL]
        assert bool((agent.kv[:, :, others] == -1.0).all())


def test_a_read_of_heads_a_pool_lacks_is_refused(backend: str, groups: list[Group]) -> None:
    owner, reader = Group(backend, "prefill", 2, seed=1), Group(backend, "decode", 1, seed=None)
    groups += [owner, reader]
    agent, peer = reader.agents[0], owner.agents[0]
    agent.add_peer(peer.name, 1, peer.metadata())
    with pytest.raises(TransferError, match=r"KV heads 0\.\.3 are not all in peer"):
        agent.read_pages(peer.name, [0], [0])  # default: all of ours; the peer has 0..1


def test_head_sources_and_pairs() -> None:
    assert tp_pair_error(2, 4) == tp_pair_error(4, 2) == tp_pair_error(3, 3) == ""
    assert "this side is TP=2, the peer TP=3" in tp_pair_error(2, 3)
    # a TP=1 reader takes heads 0-1 from rank 0 and 2-3 from rank 1 of a TP=2 owner
    assert head_sources(KVShard(1, 0, 0, 4), _shards(2)) == [(0, range(0, 2)), (1, range(2, 4))]
    # TP=8 over 4 KV heads replicates each head on two ranks: readers spread over them
    owners = _shards(8)
    assert [s.first for s in owners] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert head_sources(KVShard(4, 1, 1, 1), owners) == [(3, range(1, 2))]
    assert head_sources(KVShard(4, 2, 2, 1), owners) == [(4, range(2, 3))]
    with pytest.raises(ValueError, match="no peer rank holds KV head 3"):
        head_sources(KVShard(1, 0, 0, 4), owners[:6])
