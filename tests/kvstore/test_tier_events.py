"""The kvstore's tiers' KV events (`services.kvstore.tier_events`) in one process: a real
`HostPool` over a real `DiskPool` publishing through a real `KVEventPublisher` (ipc://
sockets in the test's tmp directory), read back through its replay socket as a vLLM
subscriber would.

* spilled pages are ``BlockStored`` "CPU" (one event per chain, its tokens rehashing to
  its hashes); evicted from host memory, ``BlockRemoved`` "CPU" and, once written,
  ``BlockStored`` "DISK"; promoted back, ``BlockStored`` "CPU"; a disk page that fails
  its check on a read, ``BlockRemoved`` "DISK"; a disk slot reused, ``BlockRemoved``
  "DISK" for the page it held;
* a restarted kvstore publishes ``AllBlocksCleared`` first, then the disk pages it
  adopted from the files, in the order they were written; a first worker of another
  layout has them let go: ``BlockRemoved`` "DISK";
* a kvstore without a host tier refuses the events' endpoint by name.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from pydantic import ValidationError

from radixserve.cache.block_hash import page_hashes
from radixserve.runtime.kv_events import KVEventPublisher
from radixserve.runtime.settings import KVEventsSettings
from radixserve.services.kvstore.disk_pool import DiskPool
from radixserve.services.kvstore.host_pool import HostPool
from radixserve.services.kvstore.settings import KVStoreSettings
from radixserve.services.kvstore.tier_events import TierEvents
from tests.kvstore.page_chain import NAMESPACE
from tests.kvstore.test_disk_pool import flip_byte, promote, settings, spill
from tests.kvstore.test_host_pool import PAGE_SIZE, H, attach, until, worker

Event = tuple[str, str, list[int]]  # (kind, medium, page names of `H`)


def publisher(tmp_path: Path, name: str) -> KVEventPublisher:
    return KVEventPublisher(KVEventsSettings(
        kv_events_endpoint=f"ipc://{tmp_path}/{name}-events",
        kv_events_replay_endpoint=f"ipc://{tmp_path}/{name}-replay",
    ))  # fmt: skip


def replayed(endpoint: str) -> list[list]:
    """Every event the publisher has sent, in order, from its replay socket."""
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        events: list[list] = []
        expected = 0
        while True:
            assert sock.poll(10_000), "the replay socket did not answer"
            _, seq, payload = sock.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                return events
            assert number == expected
            expected += 1
            _, batch, rank = msgpack.unpackb(payload, raw=False)
            assert rank == 0
            events += batch
    finally:
        context.destroy(linger=0)


def named(events: list[list]) -> list[Event | list]:
    """The events with their hashes as names of `H`, each ``BlockStored`` checked: its
    tokens, after its parent, give its hashes (pages of `PAGE_SIZE`)."""
    out: list[Event | list] = []
    for event in events:
        if event[0] == "BlockStored":
            _, hashes, parent, tokens, size, lora_id, medium = event
            ints = [int.from_bytes(h, "big") for h in hashes]
            parent_hash = None if parent is None else int.from_bytes(parent, "big")
            assert (size, lora_id) == (PAGE_SIZE, None)
            assert page_hashes(tokens, size, NAMESPACE, parent_hash) == ints
            out.append(("stored", medium, H.named(ints)))
        elif event[0] == "BlockRemoved":
            _, hashes, medium = event
            out.append(("removed", medium, H.named(int.from_bytes(h, "big") for h in hashes)))
        else:
            out.append(event)
    return out


class Feed:
    """What a publisher has sent, taken step by step."""

    def __init__(self, pub: KVEventPublisher) -> None:
        assert pub.replay_endpoint is not None
        self.endpoint, self.taken = pub.replay_endpoint, 0

    def take(self, count: int) -> list[Event | list]:
        """The next ``count`` events, once published (within 30 s; a slow machine's disk
        writer may still be publishing the next step's: `done` checks none is extra)."""
        deadline = time.monotonic() + 30
        while len(events := replayed(self.endpoint)) < self.taken + count:
            assert time.monotonic() < deadline, f"{count} more awaited: {named(events)}"
            time.sleep(0.01)
        out = named(events[self.taken : self.taken + count])
        self.taken += count
        return out

    def done(self) -> None:
        """Nothing was published past the events taken (after a moment to settle)."""
        time.sleep(0.2)
        events = replayed(self.endpoint)
        assert len(events) == self.taken, named(events[self.taken :])

    def step(self, cpu: list[Event], disk: list[Event], disk_in_order: bool = True) -> None:
        """The next events are ``cpu`` and ``disk``, each medium's in order (the two
        interleave as the disk writer's rounds and the loop's awaits fall); with
        ``disk_in_order`` False, the disk's in any order (a read's and a write's, which
        run on two threads)."""
        events = self.take(len(cpu) + len(disk))
        assert [e for e in events if e[1] == "CPU"] == cpu
        on_disk = [e for e in events if e[1] == "DISK"]
        if disk_in_order:
            assert on_disk == disk
        else:
            assert sorted(on_disk, key=repr) == sorted(disk, key=repr), (on_disk, disk)


def cpu_removed(*names: int) -> list[Event]:
    return [("removed", "CPU", [n]) for n in names]  # one event per page evicted


def test_pages_entering_and_leaving_the_tiers_are_published(tmp_path: Path) -> None:
    root = tmp_path / "disk"

    async def first_run() -> None:
        pub = publisher(tmp_path, "first")
        feed = Feed(pub)
        events = TierEvents(pub)
        s = settings(root, host_pages=4, disk_slots=8)
        disk = DiskPool("kvstore-test", s, events)
        host = HostPool("kvstore-test", s, [disk], events)
        w = worker()
        try:
            attach(host, w)
            assert host.compat is not None and host.kv is not None
            disk.open(host.compat, host.kv)
            await until(lambda: disk.ready, 30, "the disk tier's rebuild")
            assert feed.take(1) == [["AllBlocksCleared"]]
            await spill(host, disk, w, [1, 2, 3, 4], [0, 1, 2, 3])  # one chain, one event
            feed.step([("stored", "CPU", [1, 2, 3, 4])], [])
            await spill(host, disk, w, [11, 12, 13, 14], [4, 5, 6, 7])  # 1..4 to disk
            feed.step([*cpu_removed(1, 2, 3, 4), ("stored", "CPU", [11, 12, 13, 14])],
                      [("stored", "DISK", [1, 2, 3, 4])])  # fmt: skip
            assert H.names(await promote(host, disk, H(1, 2), 0.0)) == {1, 2}
            await until(lambda: disk.idle, 30, "the disk writes")  # 11, 12 to disk
            feed.step([*cpu_removed(11, 12), ("stored", "CPU", [1, 2])],
                      [("stored", "DISK", [11, 12])])  # fmt: skip
            flip_byte(disk, 3)  # its read fails: dropped; 13 made room for it
            assert H.names(await promote(host, disk, H(1, 2, 3), 0.0)) == set()
            await until(lambda: disk.idle, 30, "the disk writes")
            # the reader drops 3 while the writer stores 13: two threads, either first
            feed.step(cpu_removed(13), [("removed", "DISK", [3]), ("stored", "DISK", [13])],
                      disk_in_order=False)  # fmt: skip
            await spill(host, disk, w, [21, 22, 23, 24], [0, 1, 2, 3])  # 1, 2 on disk already
            feed.step([*cpu_removed(14, 1, 2), ("stored", "CPU", [21, 22, 23, 24])],
                      [("stored", "DISK", [14])])  # fmt: skip
            # 21..24 to disk: its 8 slots hold 7 pages; the 3 least recently used go
            await spill(host, disk, w, [31, 32, 33, 34], [4, 5, 6, 7])
            feed.step([*cpu_removed(21, 22, 23, 24), ("stored", "CPU", [31, 32, 33, 34])],
                      [("removed", "DISK", [4]), ("removed", "DISK", [11]),
                       ("removed", "DISK", [12]), ("stored", "DISK", [21, 22, 23, 24])])  # fmt: skip
            feed.done()
        finally:
            await host.stop()
            await disk.stop()
            w.agent.close()
            pub.close()

    async def restart() -> None:
        """The disk pages of the first run, adopted at start in the order they were
        written (one event per chain), then let go for a worker of another layout."""
        pub = publisher(tmp_path, "second")
        feed = Feed(pub)
        s = settings(root, host_pages=4, disk_slots=8)
        disk = DiskPool("kvstore-test", s, TierEvents(pub))
        host = HostPool("kvstore-test", s, [disk], TierEvents(pub))
        other = worker(head_dim=16)
        try:
            disk.prepare()
            await until(lambda: disk.loaded, 30, "the adoption at start")
            assert feed.take(4) == [
                ["AllBlocksCleared"],
                ("stored", "DISK", [1, 2]),
                ("stored", "DISK", [13, 14]),
                ("stored", "DISK", [21, 22, 23, 24]),
            ]
            attach(host, other)
            assert host.compat is not None and host.kv is not None
            disk.open(host.compat, host.kv)
            await until(lambda: disk.ready, 30, "the rebuild for the worker's layout")
            assert feed.take(1) == [("removed", "DISK", [1, 2, 13, 14, 21, 22, 23, 24])]
            feed.done()
        finally:
            await host.stop()
            await disk.stop()
            other.agent.close()
            pub.close()

    asyncio.run(first_run())
    asyncio.run(restart())


def test_events_without_a_host_tier_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="kv_events_endpoint needs a host tier"):
        KVStoreSettings(host_capacity_gib=0, kv_events_endpoint=f"ipc://{tmp_path}/events")
