"""The kvstore's host tier in one process: `HostPool` reading real spill buffers through
real ZMQ transfer agents over CPU tensors. A spill stores only the pages the pool lacks;
a lookup leases the longest stored run and nothing past a gap; a leased page is never
evicted and an unreleased lease runs out; a read from a worker that is gone (agent
closed, peer detached) stores nothing and holds no page; an attach whose pool differs is
refused with the reason."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.protocol import HostLookup, SpillOffer
from radixserve.services.kvstore.host_pool import HostPool, spill_agent_name
from radixserve.services.kvstore.settings import KVStoreSettings
from radixserve.transfer import KVTransferAgent, PoolCompat, create_agent
from tests.kvstore.page_chain import Chain

MODEL = "host-pool-test"
# the workers' spill buffers: (L, 2, P, S, H, D) = 2 layers, 8 pages of 4 tokens, 2 KV
# heads of 8 floats: a page is 2 * 2 * 4 * 2 * 8 * 4 = 1024 bytes
LAYERS, BUFFER_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM = 2, 8, 4, 2, 8
PAGE_BYTES = 2 * LAYERS * PAGE_SIZE * KV_HEADS * HEAD_DIM * 4


def gib_of(num_pages: int) -> float:
    """A capacity that holds exactly ``num_pages`` pages (exact: a power-of-two divisor)."""
    return num_pages * PAGE_BYTES / (1 << 30)


@dataclass
class Worker:
    """A worker's spill buffer and the agent the pool reads it through."""

    name: str
    generation: int
    buffer: torch.Tensor
    agent: KVTransferAgent

    def metadata(self) -> bytes:
        return self.agent.metadata()


def worker(name: str = "w1", generation: int = 1, head_dim: int = HEAD_DIM) -> Worker:
    shape = (LAYERS, 2, BUFFER_PAGES, PAGE_SIZE, KV_HEADS, head_dim)  # (L, 2, P, S, H, D)
    # every element distinct, so a page copied to the wrong place shows
    buffer = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    buffer += 1_000_000 * generation
    agent = create_agent("zmq", spill_agent_name(name), buffer, PoolCompat.of(buffer, MODEL))
    return Worker(name, generation, buffer, agent)


def pool(num_pages: int = 16, lease_s: float = 60.0, transfer_timeout_s: float = 5.0) -> HostPool:
    return HostPool("kvstore-test", settings(gib_of(num_pages), lease_s, transfer_timeout_s))


def settings(gib: float, lease_s: float = 60.0, transfer_timeout_s: float = 5.0) -> KVStoreSettings:
    return KVStoreSettings(transfer_backend="zmq", host_capacity_gib=gib, host_lease_s=lease_s,
                           host_transfer_timeout_s=transfer_timeout_s)  # fmt: skip


def held(host: HostPool, hashes: list[int]) -> int:
    """Leading pages of ``hashes`` the host tier holds."""
    return next((i for i, h in enumerate(hashes) if not host.holds(h)), len(hashes))


def attach(host: HostPool, w: Worker, connection: bytes = b"conn-1") -> None:
    ack = host.attach(w.name, w.generation, w.metadata(), connection)
    assert ack.accepted, ack.reason


H = Chain(PAGE_SIZE)  # page n's real hash: H[n]


def offer(spill_id: int, names: list[int], buffer_pages: list[int]) -> SpillOffer:
    """An offer of pages ``names`` (of `H`) with their tokens."""
    return H.offer(spill_id, names, buffer_pages)


def same_page(host: HostPool, host_page: int, w: Worker, buffer_page: int) -> bool:
    assert host.kv is not None
    return torch.equal(host.kv[:, :, host_page], w.buffer[:, :, buffer_page])


async def until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


def test_a_spill_stores_the_pages_the_pool_lacks_and_skips_those_it_holds():
    """Two offers overlapping by two hashes: the second stores only its two new pages,
    and every stored page holds the bytes of the buffer page it was offered from."""

    async def scenario() -> None:
        host, w = pool(), worker()
        try:
            attach(host, w)
            assert await host.spill(w.name, offer(1, [11, 12, 13], [0, 1, 2])) == 3
            assert await host.spill(w.name, offer(2, [12, 13, 14, 15], [5, 6, 3, 4])) == 2
            stats = host.stats()
            assert stats["host_spill_offers_total"] == 2
            assert stats["host_pages_stored"] == 5
            assert stats["host_bytes_stored_total"] == 5 * PAGE_BYTES
            assert stats["host_spill_failures_total"] == 0
            lease = host.lookup(w.name, HostLookup("q", tuple(H(11, 12, 13, 14, 15))))
            assert len(lease.host_page_ids) == 5
            # hash -> the buffer page it came from (12 and 13 from the first offer)
            for host_page, buffer_page in zip(lease.host_page_ids, [0, 1, 2, 3, 4]):
                assert same_page(host, host_page, w, buffer_page)
            host.release(lease.lease_id)
            assert host.index is not None
            host.index.check_integrity()
        finally:
            await host.stop()
            w.agent.close()

    asyncio.run(scenario())


def test_a_lookup_leases_the_longest_stored_run_and_nothing_past_a_gap():
    """Hashes 1, 2, 3 and 5 stored: asking 1..5 leases exactly 1..3 (5 lies past the gap
    at 4); asking from 4 on leases nothing; a release ends the lease."""

    async def scenario() -> None:
        host, w = pool(), worker()
        try:
            attach(host, w)
            assert await host.spill(w.name, offer(1, [1, 2, 3, 5], [0, 1, 2, 3])) == 4
            stored = host.lookup(w.name, HostLookup("all", tuple(H(1, 2, 3, 5))))
            pages_of = dict(zip([1, 2, 3, 5], stored.host_page_ids))
            host.release(stored.lease_id)

            lease = host.lookup(w.name, HostLookup("q1", tuple(H(1, 2, 3, 4, 5))))
            assert lease.query_id == "q1" and lease.lease_id > 0
            assert lease.host_page_ids == (pages_of[1], pages_of[2], pages_of[3])
            missed = host.lookup(w.name, HostLookup("q2", tuple(H(4, 5))))
            assert (missed.query_id, missed.lease_id, missed.host_page_ids) == ("q2", 0, ())
            assert held(host, H(1, 2, 3, 4, 5)) == 3
            stats = host.stats()
            assert stats["host_leases"] == 1 and stats["host_pages_leased"] == 3
            assert stats["host_lookups_total"] == 3
            host.release(lease.lease_id)
            assert host.stats()["host_leases"] == 0
        finally:
            await host.stop()
            w.agent.close()

    asyncio.run(scenario())


def test_a_leased_page_is_not_evicted_while_leased():
    """A pool of two pages, both leased: an offer of a new page stores nothing and evicts
    nothing, and the leased bytes stay; once released, the same offer evicts one."""

    async def scenario() -> None:
        host, w = pool(num_pages=2), worker()
        try:
            attach(host, w)
            assert await host.spill(w.name, offer(1, [1, 2], [0, 1])) == 2
            lease = host.lookup(w.name, HostLookup("q", tuple(H(1, 2))))
            assert len(lease.host_page_ids) == 2
            assert await host.spill(w.name, offer(2, [3], [2])) == 0
            stats = host.stats()
            assert stats["host_evictions_total"] == 0 and stats["host_pages_stored"] == 2
            assert held(host, H(1, 2)) == 2 and held(host, H(3)) == 0
            assert same_page(host, lease.host_page_ids[0], w, 0)
            assert same_page(host, lease.host_page_ids[1], w, 1)
            host.release(lease.lease_id)
            assert await host.spill(w.name, offer(3, [3], [2])) == 1
            assert host.stats()["host_evictions_total"] == 1
            assert held(host, H(3)) == 1
        finally:
            await host.stop()
            w.agent.close()

    asyncio.run(scenario())


def test_an_unreleased_lease_expires_and_frees_its_page_for_eviction():
    """A lease nobody releases ends after ``lease_s`` on its own (the pool's serving task
    expires it); its page can then be evicted for a new one."""

    async def scenario() -> None:
        host, w = pool(num_pages=1, lease_s=0.2), worker()
        try:
            attach(host, w)
            assert await host.spill(w.name, offer(1, [1], [0])) == 1
            lease = host.lookup(w.name, HostLookup("q", tuple(H(1))))
            assert lease.lease_id > 0
            assert host.stats()["host_leases"] == 1
            assert await host.spill(w.name, offer(2, [2], [1])) == 0  # leased: kept
            await until(lambda: host.stats()["host_leases"] == 0, 5.0, "the lease to expire")
            assert host.stats()["host_pages_leased"] == 0
            assert await host.spill(w.name, offer(3, [2], [1])) == 1
            assert host.stats()["host_evictions_total"] == 1
            assert held(host, H(1)) == 0 and held(host, H(2)) == 1
        finally:
            await host.stop()
            w.agent.close()

    asyncio.run(scenario())


def test_a_read_from_a_closed_spill_buffer_stores_nothing_and_holds_no_page():
    """The worker's agent is closed (the process died) before the pool reads it: the
    read fails at the pool's transfer deadline, the spill stores nothing, counts one
    failure and leaves every page free; the worker's next incarnation stores the same
    hashes (they were not left half written)."""

    async def scenario() -> None:
        host, dead = pool(num_pages=4, transfer_timeout_s=0.3), worker(generation=1)
        reborn: Worker | None = None
        try:
            attach(host, dead)
            dead.agent.close()
            assert await host.spill(dead.name, offer(1, [1, 2], [0, 1])) == 0
            stats = host.stats()
            assert stats["host_spill_failures_total"] == 1
            assert stats["host_pages_used"] == 0 and stats["host_pages_free"] == 4
            assert host.index is not None
            host.index.check_integrity()
            assert held(host, H(1, 2)) == 0

            reborn = worker(generation=2)
            attach(host, reborn, b"conn-2")
            assert await host.spill(reborn.name, offer(2, [1, 2], [0, 1])) == 2
            lease = host.lookup(reborn.name, HostLookup("q", tuple(H(1, 2))))
            assert same_page(host, lease.host_page_ids[0], reborn, 0)
            host.release(lease.lease_id)
        finally:
            await host.stop()
            dead.agent.close()
            if reborn is not None:
                reborn.agent.close()

    asyncio.run(scenario())


def test_a_detach_fails_a_pending_spill_read_at_once():
    """A spill read waits on a worker that does not answer; its connection is lost
    (`detach`): the read fails at once, long before its 30 s deadline, nothing is stored
    and every page is free. A detach for an older connection changes nothing, and a
    detached worker's next offer stores nothing."""

    async def scenario() -> None:
        host, w = pool(num_pages=4, transfer_timeout_s=30.0), worker()
        try:
            attach(host, w, b"conn-1")
            w.agent.close()  # the read goes out and nothing answers it
            spill = asyncio.ensure_future(host.spill(w.name, offer(1, [1, 2], [0, 1])))
            await until(lambda: host.stats()["host_pages_used"] == 2, 5.0, "the read to start")
            host.detach(w.name, b"conn-0")  # a stale connection of the same worker
            assert host.agent is not None
            assert host.agent.peers == {spill_agent_name(w.name): 1}
            assert not spill.done()
            started = time.monotonic()
            host.detach(w.name, b"conn-1")
            assert await asyncio.wait_for(spill, 5.0) == 0
            assert time.monotonic() - started < 2.0
            assert host.agent.peers == {}
            stats = host.stats()
            assert stats["host_spill_failures_total"] == 1
            assert stats["host_pages_used"] == 0 and stats["host_pages_free"] == 4
            assert await host.spill(w.name, offer(2, [1, 2], [0, 1])) == 0
            assert host.stats()["host_spill_failures_total"] == 2
            assert host.index is not None
            host.index.check_integrity()
        finally:
            await host.stop()
            w.agent.close()

    asyncio.run(scenario())


def test_an_attach_with_another_pool_geometry_is_refused_with_the_difference():
    """The pool was laid out for the first worker's pages; a worker whose pages have
    another head size is refused, told which field differs, and never becomes a peer."""

    async def scenario() -> None:
        host, first, other = pool(), worker("w1"), worker("w2", head_dim=16)
        try:
            ack = host.attach(first.name, 1, first.metadata(), b"c1")
            assert ack.accepted and ack.num_pages == 16
            refused = host.attach(other.name, 1, other.metadata(), b"c2")
            assert not refused.accepted
            assert refused.reason == "the host pool holds other pages: head_dim: 8 != 16"
            assert refused.metadata == b"" and refused.num_pages == 0
            assert host.agent is not None
            assert host.agent.peers == {spill_agent_name("w1"): 1}
        finally:
            await host.stop()
            first.agent.close()
            other.agent.close()

    asyncio.run(scenario())


def test_an_attach_is_refused_without_a_tier_with_bad_metadata_or_no_room_for_a_page():
    """Each refusal says why: capacity 0 (index only), metadata that is not a spill
    buffer's, and a capacity smaller than one page of the worker's pool."""

    async def scenario() -> None:
        w = worker()
        hosts = [
            HostPool("kv-none", settings(0.0)),
            pool(),
            HostPool("kv-tiny", settings((PAGE_BYTES - 1) / (1 << 30))),
        ]
        try:
            none = hosts[0].attach(w.name, 1, w.metadata())
            assert not none.accepted
            assert none.reason == "this kvstore has no host tier (capacity 0)"
            junk = hosts[1].attach(w.name, 1, b"\x93not metadata")
            assert not junk.accepted and junk.reason.startswith("spill buffer metadata: ")
            assert hosts[1].agent is None  # nothing was allocated for it
            tiny = hosts[2].attach(w.name, 1, w.metadata())
            assert not tiny.accepted
            assert tiny.reason.startswith("cannot set up the host pool: ")
            assert "hold no page of 1024 bytes" in tiny.reason
            assert hosts[2].agent is None
        finally:
            for host in hosts:
                await host.stop()
            w.agent.close()

    asyncio.run(scenario())


def test_a_spill_stores_only_pages_whose_tokens_give_their_hash_and_leases_carry_them():
    """An offer whose second page's tokens were changed (a worker that is wrong): the
    pages whose hash the pool recomputes are stored, the other is refused and counted;
    an offer without tokens stores nothing; a lease carries the stored tokens."""

    async def scenario() -> None:
        host, w = pool(), worker()
        try:
            attach(host, w)
            good = offer(1, [1, 2, 3], [0, 1, 2])
            tokens = list(good.token_ids)
            tokens[PAGE_SIZE] += 1  # page 2's first token
            bad = dataclasses.replace(good, token_ids=tuple(tokens))
            assert await host.spill(w.name, bad) == 2
            assert held(host, H(1)) == 1 and held(host, H(2)) == 0 and held(host, H(3)) == 1
            bare = SpillOffer(2, tuple(H(2)), (1,))  # no tokens: nothing to prove it by
            assert await host.spill(w.name, bare) == 0
            stats = host.stats()
            assert stats["host_spill_refused_pages_total"] == 2
            assert stats["kv_identity_mismatch_total"] == 2
            assert await host.spill(w.name, offer(3, [2], [1])) == 1
            lease = host.lookup(w.name, HostLookup("q", tuple(H(1, 2, 3))))
            assert lease.token_ids == tuple(H.tokens[PAGE_SIZE : 4 * PAGE_SIZE])
            host.release(lease.lease_id)
        finally:
            await host.stop()
            w.agent.close()

    asyncio.run(scenario())


def test_a_worker_reads_only_the_host_pages_leased_to_it_while_leased():
    """The pool's agent serves a read of host pages only to the worker they are leased
    to (ZMQ, grants enforced): its own leased pages arrive; another worker's read of
    them, and its read of a page whose lease it released, are refused and counted."""

    async def scenario() -> None:
        host, w = pool(), worker()
        readers: list[KVTransferAgent] = []
        try:
            attach(host, w)
            assert await host.spill(w.name, offer(1, [1, 2, 3], [0, 1, 2])) == 3
            assert host.kv is not None and host.agent is not None and host.compat is not None
            compat = host.compat  # the pool's own: a reader of another is refused for that

            def reader(name: str) -> KVTransferAgent:
                agent = create_agent("zmq", name, torch.zeros_like(host.kv), compat, 2.0)
                agent.add_peer(host.name, 1, host.agent.metadata())
                readers.append(agent)
                return agent

            async def read(agent: KVTransferAgent, pages: tuple[int, ...]) -> str:
                return await agent.wait_async(agent.read_pages(host.name, list(pages), list(pages)))

            mine, other = reader(w.name), reader("w2")
            first = host.lookup(w.name, HostLookup("a", tuple(H(1, 2))))
            second = host.lookup(w.name, HostLookup("b", tuple(H(3))))
            assert len(first.host_page_ids) == 2 and len(second.host_page_ids) == 1
            assert await read(mine, first.host_page_ids) == "done"
            refused = host.agent.refused_reads
            assert await read(other, first.host_page_ids) == "failed"  # leased to w1 only
            host.release(first.lease_id)  # the second lease keeps the pool serving
            assert await read(mine, first.host_page_ids) == "failed"  # no longer leased
            assert await read(mine, second.host_page_ids) == "done"
            assert host.agent.refused_reads == refused + 2
            host.release(second.lease_id)
        finally:
            for agent in readers:
                agent.close()
            await host.stop()
            w.agent.close()

    asyncio.run(scenario())
