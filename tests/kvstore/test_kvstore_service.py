"""The kvstore service in one process: `KVStoreService.run` on the test's event loop,
spoken to over real ZMQ DEALER sockets the way workers and routers speak to it.

Membership (a registered member is listed to watchers; a silent one leaves the list and
the index), the global index (stored and removed events in every `IndexReply`, per
worker; events sent for another worker ignored; a sequence gap or an unknown worker
answered `KVResync`), bad frames dropped without harm, the host tier's refusals and
round trip (attach, spill, lookup, read the leased pages, release), and a restart on
the disk tier's directory (its pages indexed and leased again, from disk)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from radixserve.protocol import (
    AsyncChannel,
    Deregister,
    Heartbeat,
    Hello,
    HelloAck,
    HostAttach,
    HostAttachAck,
    HostLease,
    HostLookup,
    HostPagesReady,
    HostRelease,
    IndexQuery,
    IndexReply,
    KVEvent,
    KVResync,
    MemberInfo,
    MemberList,
    Message,
    Register,
    SpillDone,
    WatchMembers,
)
from radixserve.services.kvstore.disk_pool import DiskPool
from radixserve.services.kvstore.host_pool import spill_agent_name
from radixserve.services.kvstore.service import KVStoreService
from radixserve.services.kvstore.settings import KVStoreSettings
from radixserve.transfer import KVTransferAgent, PoolCompat, create_agent
from tests.kvstore.page_chain import Chain

KVSTORE = "kvstore-test"
MODEL = "kvstore-test-model"
# spill buffers of 8 pages, (L, 2, P, S, H, D) = (2, 2, 8, 4, 2, 8) float32: 1024 B a page
PAGE_BYTES = 1024
H = Chain(4)  # real page hashes (pages of 4 tokens), named by small ints
HOST_PAGES = 32


def settings(**overrides) -> KVStoreSettings:
    values = {
        "name": KVSTORE, "generation": 42, "host": "127.0.0.1", "port": 0,
        "host_capacity_gib": HOST_PAGES * PAGE_BYTES / (1 << 30), "transfer_backend": "zmq",
        "heartbeat_interval_s": 0.1, "peer_timeout_s": 5.0, "member_refresh_s": 60.0,
    }  # fmt: skip
    values.update(overrides)
    return KVStoreSettings(**values)


async def until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def kvstore(**overrides) -> AsyncIterator[KVStoreService]:
    """A kvstore serving on this loop until the block ends."""
    service = KVStoreService(settings(**overrides))
    stop = asyncio.Event()
    task = asyncio.ensure_future(service.run(stop))
    try:
        await until(lambda: service.serving or task.done(), 5.0, "the kvstore to start")
        if task.done():
            task.result()  # raises what stopped it
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, 10.0)


class Dealer:
    """One connection to the kvstore, as a worker or a router opens it."""

    def __init__(self, context: zmq.asyncio.Context, address: str) -> None:
        self.channel = AsyncChannel.open(context, zmq.DEALER, address, bind=False)

    async def send(self, msg: Message) -> None:
        await self.channel.send(msg, timeout_ms=2000)

    async def next(self, timeout_s: float = 5.0) -> Message:
        """The next message that is not a heartbeat."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            msg = await self.channel.recv(timeout_ms=max(left_ms, 0))
            if msg is None:
                raise AssertionError(f"no message within {timeout_s} s")
            if not isinstance(msg, Heartbeat):
                return msg

    async def ask(self, msg: Message) -> Message:
        await self.send(msg)
        return await self.next()

    async def hello(self, name: str, role: str = "decode", generation: int = 1) -> None:
        ack = await self.ask(Hello(name, role, generation))  # type: ignore[arg-type]
        assert isinstance(ack, HelloAck) and ack.name == KVSTORE and ack.generation == 42

    async def index(self, *hashes: int, query_id: str = "q") -> IndexReply:
        """The kvstore's answer for ``hashes``: every message sent before is applied."""
        reply = await self.ask(IndexQuery(query_id, hashes))
        assert isinstance(reply, IndexReply) and reply.query_id == query_id, reply
        return reply


@contextlib.asynccontextmanager
async def dealers(address: str, count: int) -> AsyncIterator[list[Dealer]]:
    context = zmq.asyncio.Context()
    opened = [Dealer(context, address) for _ in range(count)]
    try:
        yield opened
    finally:
        for dealer in opened:
            dealer.channel.close()
        context.term()


def disk_tier(service: KVStoreService) -> DiskPool:
    """The kvstore's tier below its host tier: its disk tier."""
    (disk,) = service.tiers[1:]
    assert isinstance(disk, DiskPool)
    return disk


def member(name: str, role: str = "decode", port: int = 7001) -> MemberInfo:
    return MemberInfo(name, role, f"tcp://127.0.0.1:{port}", 1)  # type: ignore[arg-type]


def test_a_registered_member_is_listed_to_its_watchers_until_it_deregisters():
    """A decode worker registers; a router watching decode workers gets a list naming
    exactly it (a prefill member is left out), then an empty one when it deregisters."""

    async def scenario() -> None:
        async with kvstore() as service, dealers(service.address, 3) as (worker, other, router):
            await worker.send(Register(member("decode-0")))
            await other.send(Register(member("prefill-0", "prefill", 7002)))
            await worker.index()  # both registrations are applied before the watch
            await other.index()
            listing = await router.ask(WatchMembers(("decode",)))
            assert isinstance(listing, MemberList)
            assert listing.members == (member("decode-0"),)
            assert listing.epoch == 42 and listing.version == 2
            await worker.send(Deregister("decode-0", 1))
            update = await router.next()
            assert isinstance(update, MemberList)
            assert update.members == () and update.version == 3
            assert service.store_stats()["members"] == 1  # the prefill one

    asyncio.run(scenario())


def test_a_worker_that_goes_silent_leaves_the_member_list_and_the_index():
    """A decode worker registers and publishes pages, then stops talking: after the
    peer timeout its watcher (which keeps beating) gets a list without it, and the index
    no longer names it."""

    async def scenario() -> None:
        async with (
            kvstore(peer_timeout_s=0.5) as service,
            dealers(service.address, 2) as (worker, router),
        ):
            await worker.hello("decode-0")
            await worker.send(KVEvent("decode-0", 1, 1, "stored", (1, 2)))
            await worker.send(Register(member("decode-0")))
            assert dict((await worker.index(1, 2)).device_pages) == {"decode-0": 2}
            listing = await router.ask(WatchMembers(("decode",)))
            assert isinstance(listing, MemberList) and len(listing.members) == 1

            async def beat() -> None:  # the router stays alive; the worker does not
                while True:
                    await router.send(Heartbeat("router", 1))
                    await asyncio.sleep(0.05)

            beating = asyncio.ensure_future(beat())
            try:
                update = await router.next()
            finally:
                beating.cancel()
                await asyncio.gather(beating, return_exceptions=True)
            assert isinstance(update, MemberList)
            assert update.members == () and update.version == listing.version + 1
            assert dict((await router.index(1, 2)).device_pages) == {}
            stats = service.store_stats()
            assert stats["members"] == 0 and stats["index_workers"] == 0

    asyncio.run(scenario())


def test_stored_and_removed_events_show_in_index_replies_per_worker():
    """Two workers publish overlapping prefixes: each `IndexReply` counts the leading
    pages each holds; a removal shortens one worker's run; an event a worker sends under
    another worker's name is ignored."""

    async def scenario() -> None:
        async with kvstore() as service, dealers(service.address, 2) as (w1, w2):
            await w1.hello("w1")
            await w2.hello("w2", "prefill")
            await w1.send(KVEvent("w1", 1, 1, "stored", (11, 12, 13)))
            assert dict((await w1.index(11, 12, 13, 14)).device_pages) == {"w1": 3}
            await w2.send(KVEvent("w2", 1, 1, "stored", (11, 12)))
            reply = await w2.index(11, 12, 13, 14)
            assert dict(reply.device_pages) == {"w1": 3, "w2": 2} and reply.host_pages == 0
            await w1.send(KVEvent("w1", 1, 2, "removed", (12,)))
            assert dict((await w1.index(11, 12, 13)).device_pages) == {"w1": 1, "w2": 2}
            await w1.send(KVEvent("w2", 1, 2, "removed", (11,)))  # not w1's to send
            assert dict((await w1.index(11, 12, 13)).device_pages) == {"w1": 1, "w2": 2}
            stats = service.store_stats()
            assert stats["index_events_total"] == 3 and stats["index_pages"] == 3
            assert stats["index_resyncs_total"] == 0

    asyncio.run(scenario())


def test_a_gap_in_event_sequence_numbers_asks_for_one_resync():
    """Event 3 after event 1: the kvstore drops the worker's pages and answers
    `KVResync` once; later events are ignored (no second resync) until the worker's
    ``cleared``, after which its snapshot counts again."""

    async def scenario() -> None:
        async with kvstore() as service, dealers(service.address, 1) as (w1,):
            await w1.hello("w1")
            await w1.send(KVEvent("w1", 1, 1, "stored", (1, 2)))
            resync = await w1.ask(KVEvent("w1", 1, 3, "stored", (3,)))
            assert isinstance(resync, KVResync) and resync.reason == "event 3 out of order"
            assert dict((await w1.index(1, 2, 3)).device_pages) == {}
            await w1.send(KVEvent("w1", 1, 4, "stored", (1,)))  # still waiting for cleared
            assert dict((await w1.index(1, 2, 3)).device_pages) == {}
            assert service.index.num_resyncs == 1
            await w1.send(KVEvent("w1", 1, 10, "cleared"))
            await w1.send(KVEvent("w1", 1, 11, "stored", (1, 2, 3)))
            assert dict((await w1.index(1, 2, 3)).device_pages) == {"w1": 3}
            assert service.store_stats()["index_resyncs_total"] == 1

    asyncio.run(scenario())


def test_an_event_from_a_worker_the_kvstore_never_saw_start_asks_for_a_resync():
    """After a kvstore restart a worker's next event carries seq 7: the kvstore cannot
    know what came before, answers `KVResync` and indexes nothing of it."""

    async def scenario() -> None:
        async with kvstore() as service, dealers(service.address, 1) as (w1,):
            await w1.hello("w1")
            resync = await w1.ask(KVEvent("w1", 5, 7, "stored", (1,)))
            assert isinstance(resync, KVResync) and resync.reason == "event 7 out of order"
            assert dict((await w1.index(1)).device_pages) == {}
            assert service.store_stats()["index_resyncs_total"] == 1

    asyncio.run(scenario())


def test_bad_frames_are_dropped_and_the_kvstore_still_answers():
    """Not msgpack, an unknown type, a field out of bounds, another major version and a
    two-frame message: each is dropped, nothing is applied, and the same connection's
    next query is answered."""

    async def scenario() -> None:
        async with kvstore() as service, dealers(service.address, 1) as (w1,):
            socket = w1.channel.socket
            frames = [
                b"\xc1 not msgpack",
                msgpack.packb({"type": "no_such_message", "v": [4, 0]}),
                msgpack.packb(
                    {
                        "type": "kv_event",
                        "v": [4, 0],
                        "worker": "w1",
                        "generation": 1,
                        "seq": 1,
                        "kind": "stored",
                        "page_hashes": [-1],  # a page hash is unsigned
                    }
                ),
                msgpack.packb(
                    {"type": "index_query", "v": [99, 0], "query_id": "x", "page_hashes": []}
                ),
            ]
            for frame in frames:
                await socket.send(frame)
            await socket.send_multipart([b"two", b"frames"])
            reply = await w1.index(1, query_id="after-garbage")
            assert dict(reply.device_pages) == {} and reply.host_pages == 0
            stats = service.store_stats()
            assert stats["index_events_total"] == 0 and stats["index_resyncs_total"] == 0
            assert service.serving

    asyncio.run(scenario())


def spill_buffer(name: str, head_dim: int = 8) -> tuple[torch.Tensor, KVTransferAgent]:
    """A worker's spill buffer (every element distinct) and its agent."""
    shape = (2, 2, 8, 4, 2, head_dim)  # (L, 2, P, S, H, D)
    buffer = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    compat = PoolCompat.of(buffer, MODEL)
    return buffer, create_agent("zmq", spill_agent_name(name), buffer, compat)


def test_the_host_tier_answers_before_attach_refuses_a_pool_and_serves_a_lease():
    """Before any attach a spill stores 0 pages and a lookup leases nothing. A worker
    attaches, spills three pages and sees them in `IndexReply.host_pages`; its lookup
    leases the stored run, whose pages it reads back byte-exact from the kvstore's
    agent, and its release ends the lease. A worker with other pages is refused."""

    async def scenario() -> None:
        buffer, spill_agent = spill_buffer("w1")
        _, other_agent = spill_buffer("w2", head_dim=16)
        device = torch.zeros_like(buffer)  # the worker's device pool, (2, 2, 8, 4, 2, 8)
        reader = create_agent("zmq", "w1", device, PoolCompat.of(device, MODEL))
        try:
            async with kvstore() as service, dealers(service.address, 2) as (w1, w2):
                await w1.hello("w1")
                done = await w1.ask(H.offer(1, [1, 2], [0, 1]))
                assert isinstance(done, SpillDone) and (done.spill_id, done.stored) == (1, 0)
                empty = await w1.ask(HostLookup("early", tuple(H(1, 2))))
                assert empty == HostLease("early", 0, ())

                ack = await w1.ask(HostAttach("w1", 1, spill_agent.metadata()))
                assert isinstance(ack, HostAttachAck) and ack.accepted, ack
                assert ack.num_pages == HOST_PAGES and not ack.disk_tier
                done = await w1.ask(H.offer(2, [1, 2, 3], [4, 5, 6]))
                assert isinstance(done, SpillDone) and (done.spill_id, done.stored) == (2, 3)
                assert (await w1.index(*H(1, 2, 3, 4))).host_pages == 3

                lease = await w1.ask(
                    HostLookup("miss", tuple(H(9, 1, 2)))
                )  # the first page is not there
                assert isinstance(lease, HostLease) and lease.lease_id == 0
                lease = await w1.ask(HostLookup("load", tuple(H(1, 2, 3, 4))))
                assert isinstance(lease, HostLease) and lease.lease_id > 0
                assert len(lease.host_page_ids) == 3
                reader.add_peer(KVSTORE, 42, ack.metadata)
                handle = reader.read_pages(KVSTORE, list(lease.host_page_ids), [0, 1, 2])
                assert await reader.wait_async(handle) == "done"
                assert torch.equal(device[:, :, :3], buffer[:, :, 4:7])
                assert service.store_stats()["host_leases"] == 1
                await w1.send(HostRelease(lease.lease_id))
                await w1.index(*H(1))  # the release was applied before this answer
                assert service.store_stats()["host_leases"] == 0

                await w2.hello("w2")
                refused = await w2.ask(HostAttach("w2", 1, other_agent.metadata()))
                assert isinstance(refused, HostAttachAck) and not refused.accepted
                assert refused.reason == "the host pool holds other pages: head_dim: 8 != 16"
                stats = service.store_stats()
                assert stats["host_pages_stored"] == 3 and stats["host_spill_failures_total"] == 0
        finally:
            reader.close()
            spill_agent.close()
            other_agent.close()

    asyncio.run(scenario())


def test_a_worker_that_attached_before_its_hello_spills_and_reads_as_itself():
    """Across a kvstore restart a worker's socket reconnects by itself, and what it was
    sending (attach, spill, lookup) can come before its hello: the kvstore serves that
    connection as the worker that attached on it (its spill stored, its lease's pages
    readable by its own agent: the lease is granted to it, not to an unnamed peer), and
    the hello that follows names the peer."""

    async def scenario() -> None:
        buffer, spill_agent = spill_buffer("w1")
        device = torch.zeros_like(buffer)
        reader = create_agent("zmq", "w1", device, PoolCompat.of(device, MODEL))
        try:
            async with kvstore() as service, dealers(service.address, 1) as (w1,):
                ack = await w1.ask(HostAttach("w1", 1, spill_agent.metadata()))
                assert isinstance(ack, HostAttachAck) and ack.accepted, ack
                done = await w1.ask(H.offer(1, [1, 2], [2, 3]))
                assert isinstance(done, SpillDone) and done.stored == 2
                lease = await w1.ask(HostLookup("early", tuple(H(1, 2))))
                assert isinstance(lease, HostLease) and len(lease.host_page_ids) == 2
                reader.add_peer(KVSTORE, 42, ack.metadata)
                handle = reader.read_pages(KVSTORE, list(lease.host_page_ids), [0, 1])
                assert await reader.wait_async(handle) == "done"
                assert torch.equal(device[:, :, :2], buffer[:, :, 2:4])
                assert service.store_stats().get("host_spill_failures_total", 0) == 0
                assert [p.name for p in service.peers.values()] == ["?"]
                await w1.hello("w1")
                assert [p.name for p in service.peers.values()] == ["w1"]
        finally:
            reader.close()
            spill_agent.close()

    asyncio.run(scenario())


def test_a_kvstore_without_a_host_tier_refuses_attach():
    """``host_capacity_gib`` 0: an attach is refused with the reason, and a spill offer
    still gets its `SpillDone` with nothing stored (the worker reuses its buffer)."""

    async def scenario() -> None:
        _, spill_agent = spill_buffer("w1")
        try:
            async with (
                kvstore(host_capacity_gib=0.0) as service,
                dealers(service.address, 1) as (w1,),
            ):
                await w1.hello("w1")
                ack = await w1.ask(HostAttach("w1", 1, spill_agent.metadata()))
                assert ack == HostAttachAck(
                    False, reason="this kvstore has no host tier (capacity 0)"
                )
                done = await w1.ask(H.offer(1, [1], [0]))
                assert done == SpillDone(1, 0)
        finally:
            spill_agent.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("overlap", "chunk_mib", "reads_loading"),
    [(True, 0.0, True), (True, 16.0, True), (True, 0.0, False), (False, 0.0, True)],
    ids=["overlapped", "one chunk: disk first", "older worker: disk first", "disk first"],
)  # fmt: skip
def test_a_kvstore_restarted_on_its_disk_tier_serves_those_pages_from_disk(
    tmp_path, overlap, chunk_mib, reads_loading
):
    """A 6-page host tier over a disk tier: a worker spills 8 pages, two of which the
    host tier evicts to disk; the index counts all 8 as loadable. The kvstore stops (it
    writes its host pages to disk on the way out) and a new one starts on the same
    directory: once the worker attaches again, the index counts the 8 pages, and a
    lookup leases them with ``disk_pages`` 8, byte-exact. Overlapped, the lease comes
    first (``loading``, nothing ready) and `HostPagesReady` follow, each readying more,
    up to all 8; else (when the run is one chunk of ``disk_read_chunk_mib``: nothing to
    overlap; when the lookup does not say it ``reads_loading``: a worker of an older
    version) the lease comes once all are read. A disk tier without a host tier is
    refused at start."""
    disk = {"disk_tier_dir": tmp_path, "disk_tier_gib": 64 * 8192 / (1 << 30),
            "disk_read_overlap": overlap, "disk_read_chunk_mib": chunk_mib}  # fmt: skip
    loading = overlap and chunk_mib == 0 and reads_loading

    async def scenario() -> None:
        buffer, spill_agent = spill_buffer("w1")
        device = torch.zeros_like(buffer)  # the worker's device pool, (2, 2, 8, 4, 2, 8)
        reader = create_agent("zmq", "w1", device, PoolCompat.of(device, MODEL))
        hashes = tuple(H(*range(101, 109)))
        try:
            async with (
                kvstore(host_capacity_gib=6 * PAGE_BYTES / (1 << 30), **disk) as service,
                dealers(service.address, 1) as (w1,),
            ):
                await w1.hello("w1")
                ack = await w1.ask(HostAttach("w1", 1, spill_agent.metadata()))
                assert isinstance(ack, HostAttachAck) and ack.accepted and ack.disk_tier, ack
                # the tier opens on the first attach, in a task: what the host tier evicts
                # before it is ready is not written
                tier = disk_tier(service)
                await until(lambda: tier.ready, 5.0, "the disk tier to open")
                await w1.ask(H.offer(1, [101, 102, 103, 104], [0, 1, 2, 3]))
                await w1.ask(H.offer(2, [105, 106, 107, 108], [4, 5, 6, 7]))
                await until(lambda: tier.idle, 5.0, "the disk writes")
                assert service.store_stats()["disk_pages_stored"] == 2
                assert (await w1.index(*hashes)).host_pages == 8
            async with kvstore(**disk) as service, dealers(service.address, 1) as (w1,):
                await w1.hello("w1")
                # the files are adopted at start, before any worker: then it is ready
                tier = disk_tier(service)
                await until(lambda: tier.loaded, 5.0, "the adoption")
                assert service.health()[0] and service.store_stats()["disk_tier_ready"] == 1
                assert service.store_stats()["disk_restored_pages"] == 8
                assert (await w1.index(*hashes)).host_pages == 0  # no worker's layout yet
                ack = await w1.ask(HostAttach("w1", 1, spill_agent.metadata()))
                assert isinstance(ack, HostAttachAck) and ack.accepted, ack
                await until(lambda: tier.ready, 5.0, "the rebuild")
                assert service.store_stats()["disk_restored_pages"] == 8
                assert (await w1.index(*hashes)).host_pages == 8
                lease = await w1.ask(HostLookup("warm", hashes, reads_loading=reads_loading))
                assert isinstance(lease, HostLease) and lease.disk_pages == 8
                assert (lease.loading, lease.ready_pages) == (loading, 0)
                readies = [0]
                while loading and readies[-1] < 8:
                    ready = await w1.next()
                    assert isinstance(ready, HostPagesReady) and not ready.failed, ready
                    readies.append(ready.ready_pages)
                assert readies == sorted(set(readies))  # each one readies more
                reader.add_peer(KVSTORE, 42, ack.metadata)
                handle = reader.read_pages(KVSTORE, list(lease.host_page_ids), list(range(8)))
                assert await reader.wait_async(handle) == "done"
                assert torch.equal(device, buffer)
                await w1.send(HostRelease(lease.lease_id))
                stats = service.store_stats()
                assert stats["disk_hit_pages_total"] == 8 and stats["disk_corrupt_pages_total"] == 0
        finally:
            reader.close()
            spill_agent.close()

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="disk_tier_dir needs a host tier"):
        settings(host_capacity_gib=0.0, **disk)
