"""The kvstore's disk tier in one process: `DiskPool` under a real `HostPool` (real ZMQ
spill reads from worker buffers), writing real files in the test's tmp directory.

Pages the host tier evicts are written to disk and promoted back byte-exact on a lookup
(also where a run alternates host and disk pages); the tier keeps to its bound with an
LRU of its own in which a page read moves up; a byte flipped on disk is detected on read,
counted, dropped and never reaches the host tier; a restart rebuilds the index from the
files (a torn record dropped and counted, another layout's records ignored and counted,
the LRU order kept); a worker that computes faster than the disk reads gets only the
host part; an unusable directory or a file the kernel refuses to grow (RLIMIT_FSIZE)
degrades the tier and spilling and lookups go on; a writer SIGKILLed mid-write leaves
only pages that read back valid and exact."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import torch

from radixserve.cache.block_hash import hash_namespace
from radixserve.cache.host_index import HostPageIndex
from radixserve.cache.page_proof import PageProof, pack_tokens
from radixserve.model.identity import ModelIdentity
from radixserve.protocol import HostLease, HostLookup
from radixserve.services.kvstore.disk_files import (
    HEADER_BYTES,
    RecordBuffer,
    SlabFiles,
    check,
    seal,
)
from radixserve.services.kvstore.disk_pool import DiskPool
from radixserve.services.kvstore.host_pool import HostPool
from radixserve.services.kvstore.promotion import OnPlan, OnReady, Promotion, promotion_cut
from radixserve.services.kvstore.settings import KVStoreSettings
from radixserve.transfer import PoolCompat
from tests.kvstore.page_chain import Chain
from tests.kvstore.test_disk_files import file_size_limit
from tests.kvstore.test_host_pool import (
    PAGE_BYTES,
    H,
    Worker,
    attach,
    gib_of,
    offer,
    same_page,
    until,
    worker,
)

RECORD = 8192  # a 1 KiB page's slot: a 4 KiB header and the page padded to 4 KiB


def disk_gib(slots: int) -> float:
    """A bound of ``slots`` slots in eight files (the tier allocates its bound in eighths)."""
    assert slots % 8 == 0
    return 8 * (HEADER_BYTES + slots // 8 * RECORD) / (1 << 30)


def settings(root: Path, host_pages: int, disk_slots: int = 64, **more) -> KVStoreSettings:
    values = {"disk_tier_gib": disk_gib(disk_slots), **more}
    return KVStoreSettings(transfer_backend="zmq", host_capacity_gib=gib_of(host_pages),
                           disk_tier_dir=root, **values)  # fmt: skip


@contextlib.asynccontextmanager
async def tiers(
    root: Path, host_pages: int = 4, disk_slots: int = 64, **more
) -> AsyncIterator[tuple[HostPool, DiskPool, Worker]]:
    """A host pool of ``host_pages`` over a disk tier in ``root``, and a worker attached
    (the disk tier opens, as in the kvstore, once the pool knows the pages' layout)."""
    s = settings(root, host_pages, disk_slots, **more)
    disk = DiskPool("kvstore-test", s)
    host = HostPool("kvstore-test", s, [disk])
    w = worker()
    try:
        attach(host, w)
        assert host.compat is not None and host.kv is not None
        disk.open(host.compat, host.kv)
        await until(lambda: disk.ready or disk.down is not None, 5, "the disk tier's rebuild")
        yield host, disk, w
    finally:
        await host.stop()
        await disk.stop()
        w.agent.close()


async def spill(host: HostPool, disk: DiskPool, w: Worker, hashes: list[int], buffer_pages: list[int]) -> None:  # fmt: skip
    """Spill pages ``hashes`` (names of `H`) from those buffer pages; wait until what
    they evicted is on disk."""
    assert await host.spill(w.name, offer(1, hashes, buffer_pages)) == len(hashes)
    await until(lambda: disk.idle, 5, "the disk writes")


def on_disk(host: HostPool, disk: DiskPool, hashes: list[int]) -> list[bool]:
    """The leading run of ``hashes`` the two tiers hold: per page, whether it is on disk."""
    return [tier is disk for tier in Promotion(host, [disk]).run(hashes)]


async def promote(
    host: HostPool,
    disk: DiskPool,
    hashes: list[int],
    rate: float,
    on_plan: OnPlan | None = None,
    on_ready: OnReady | None = None,
) -> set[int]:
    """`Promotion.promote` from ``disk`` into ``host``, as the kvstore runs it."""
    return await Promotion(host, [disk]).promote(hashes, rate, on_plan, on_ready)


def index(host: HostPool) -> HostPageIndex:
    assert host.index is not None
    return host.index


def lease_pages(host: HostPool, w: Worker, names: list[int]) -> tuple[int, ...]:
    lease = host.lookup(w.name, HostLookup("q", tuple(H(*names))))
    host.release(lease.lease_id)
    return lease.host_page_ids


def flip_byte(disk: DiskPool, name: int, offset: int = 100) -> None:
    """Flip a bit of page ``name``'s page in its file (as a failing disk would)."""
    files, slot = disk.files, disk.index.slot_of(H[name])
    assert files is not None and slot is not None
    (slab,) = [s for s in files.slabs if s.first <= slot < s.first + s.num_slots]
    at = HEADER_BYTES + (slot - slab.first) * RECORD + HEADER_BYTES + offset
    with open(slab.path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def test_evicted_pages_go_to_disk_and_come_back_exact_through_a_mixed_run(tmp_path: Path):
    """A host tier of 4 pages: spilling 5, 6 evicts 1, 2 to disk. The run 1..4 is then
    disk, disk, host, host: the index sees all four, a promotion reads 1 and 2 back
    (evicting 5 and 6 to disk, never 3 and 4, which it holds), and the lease covers the
    whole run with the bytes each hash was spilled with."""

    async def scenario() -> None:
        async with tiers(tmp_path) as (host, disk, w):
            await spill(host, disk, w, [1, 2, 3, 4], [0, 1, 2, 3])
            await spill(host, disk, w, [5, 6], [4, 5])
            assert on_disk(host, disk, H(1, 2, 3, 4, 9)) == [True, True, False, False]
            assert disk.stats()["disk_write_pages_total"] == 2
            assert H.names(await promote(host, disk, H(1, 2, 3, 4), 0.0)) == {1, 2}
            pages = lease_pages(host, w, [1, 2, 3, 4])
            assert len(pages) == 4
            for page, buffer_page in zip(pages, [0, 1, 2, 3]):
                assert same_page(host, page, w, buffer_page)
            await until(lambda: disk.idle, 5, "the disk writes")
            assert on_disk(host, disk, H(5, 6)) == [True, True]  # evicted by the promotion
            stats = disk.stats()
            assert stats["disk_hit_pages_total"] == 2 and stats["disk_read_pages_total"] == 2
            assert stats["disk_write_pages_total"] == 4 and stats["disk_corrupt_pages_total"] == 0
            assert stats["disk_read_bytes_per_s"] > 0 and stats["disk_write_bytes_per_s"] > 0
            assert stats["disk_direct_io"] == 1  # tmp is a real disk filesystem here
            index(host).check_integrity()
            disk.index.check_integrity()

    asyncio.run(scenario())


def test_an_overlapped_promotion_leases_its_run_first_and_readies_it_chunk_by_chunk(
    tmp_path: Path,
):
    """The run 1..4 is disk, disk, disk, host (a host tier of 4 pages; 5, 6, 7 evicted 1,
    2, 3). Overlapped, the run is leased before any disk read (nothing ready: its first
    page is on disk), then each chunk (one page here: ``disk_read_chunk_mib`` 0) readies
    more of it; at each step exactly the ready pages are in host memory, with the bytes
    they were spilled with (the reader may read them), and the index holds: the pages
    still being read are leased but invisible. The last chunk readies the whole run,
    host page included. With the default chunk size (16 MiB) the run is one chunk."""

    async def scenario() -> None:
        async with tiers(tmp_path, disk_read_chunk_mib=0) as (host, disk, w):
            await spill(host, disk, w, [1, 2, 3, 4], [0, 1, 2, 3])
            await spill(host, disk, w, [5, 6, 7], [4, 5, 6])
            assert on_disk(host, disk, H(1, 2, 3, 4)) == [True, True, True, False]
            seen: list[tuple[str, int, bool]] = []
            lease = HostLease("q")

            async def on_plan(run: list[int], ready: int) -> None:
                nonlocal lease
                lease = host.lease_loading(
                    w.name, HostLookup("q", tuple(H(1, 2, 3, 4))), run, ready, disk.proof
                )
                seen.append(("plan", ready, False))
                index(host).check_integrity()

            async def on_ready(ready: int, failed: bool) -> None:
                seen.append(("ready", ready, failed))
                pages = lease.host_page_ids
                assert [index(host).stored(H[h]) for h in (1, 2, 3)] == [
                    i < ready for i in range(3)
                ]
                assert all(same_page(host, pages[i], w, i) for i in range(ready))
                index(host).check_integrity()

            promoted = await promote(host, disk, H(1, 2, 3, 4), 0.0, on_plan, on_ready)
            assert H.names(promoted) == {1, 2, 3}
            assert seen == [("plan", 0, False), ("ready", 1, False), ("ready", 2, False),
                            ("ready", 4, False)]  # fmt: skip
            assert (lease.loading, lease.disk_pages, len(lease.host_page_ids)) == (True, 3, 4)
            host.release(lease.lease_id)
            index(host).check_integrity()
            assert disk.stats()["disk_hit_pages_total"] == 3
            assert disk.stats()["disk_overlapped_promotions_total"] == 1
            assert disk.chunk_pages(3) == 1
            disk.chunk_bytes = 16 << 20
            assert disk.chunk_pages(3) >= 3 and disk.chunk_pages(20_000) == 2500  # 8 chunks

    asyncio.run(scenario())


def test_an_overlapped_promotion_stops_at_a_corrupt_page_and_says_so(tmp_path: Path):
    """As above with page 2 flipped on disk: the chunk holding it readies nothing more
    and says ``failed``; page 3 is not read (it stays on disk), page 2 is dropped and
    counted, and once the lease is released every host page is accounted for."""

    async def scenario() -> None:
        async with tiers(tmp_path, disk_read_chunk_mib=0) as (host, disk, w):
            await spill(host, disk, w, [1, 2, 3, 4], [0, 1, 2, 3])
            await spill(host, disk, w, [5, 6, 7], [4, 5, 6])
            flip_byte(disk, 2)
            seen: list[tuple[int, bool]] = []
            lease = HostLease("q")

            async def on_plan(run: list[int], ready: int) -> None:
                nonlocal lease
                lease = host.lease_loading(
                    w.name, HostLookup("q", tuple(H(1, 2, 3, 4))), run, ready, disk.proof
                )

            async def on_ready(ready: int, failed: bool) -> None:
                seen.append((ready, failed))

            promoted = await promote(host, disk, H(1, 2, 3, 4), 0.0, on_plan, on_ready)
            assert H.names(promoted) == {1} and seen == [(1, False), (1, True)]
            assert disk.stats()["disk_corrupt_pages_total"] == 1
            assert not disk.index.stored(H[2]) and disk.index.stored(H[3])
            assert not index(host).stored(H[3])
            index(host).check_integrity()
            host.release(lease.lease_id)
            index(host).check_integrity()
            assert index(host).stats()["host_pages_leased"] == 0

    asyncio.run(scenario())


def test_a_promotion_waits_for_pages_of_its_run_still_being_written(tmp_path: Path):
    """Pages evicted from host memory a moment ago are on their way to disk (not yet
    readable): a lookup right then waits for their write and reads them back, rather
    than stopping its run short."""

    async def scenario() -> None:
        async with tiers(tmp_path) as (host, disk, w):
            await spill(host, disk, w, [1, 2, 3, 4], [0, 1, 2, 3])
            gate = threading.Event()
            disk._writer.submit(gate.wait)  # the writer thread is busy until the gate opens
            assert await host.spill(w.name, offer(2, [5, 6], [4, 5])) == 2  # evicts 1, 2
            assert on_disk(host, disk, H(1, 2, 3, 4)) == []  # 1 is not written yet
            promoting = asyncio.ensure_future(promote(host, disk, H(1, 2, 3, 4), 0.0))
            await asyncio.sleep(0.05)
            assert not promoting.done()  # it waits for the write...
            gate.set()
            assert H.names(await promoting) == {1, 2}  # ...and reads 1, 2 once they are on disk
            assert len(lease_pages(host, w, [1, 2, 3, 4])) == 4

    asyncio.run(scenario())


def test_the_tier_keeps_to_its_bound_and_a_page_read_moves_up_its_lru(tmp_path: Path):
    """A host tier of 2 pages over 16 disk slots; pairs of pages spilled one after
    another push each pair to disk. The files never pass the bound; the oldest pages
    go first, except one read back from disk in between, which stays."""

    async def scenario() -> None:
        async with tiers(tmp_path, host_pages=2, disk_slots=16) as (host, disk, w):
            bound = disk.stats()["disk_bytes_bound"]
            for k in range(10):
                await spill(host, disk, w, [100 + 2 * k, 101 + 2 * k], [0, 1])
                if k == 4:  # page 100 (the oldest on disk) is read: now the most recent
                    assert H.names(await promote(host, disk, H(100), 0.0)) == {100}
                assert disk.stats()["disk_bytes_total"] <= bound
            stats = disk.stats()
            assert stats["disk_pages_total"] == 16 and stats["disk_pages_stored"] == 16
            assert stats["disk_evictions_total"] > 0
            on_disk = {h for h in range(100, 120) if disk.index.stored(H[h])}
            assert 100 in on_disk and 101 not in on_disk and 102 not in on_disk
            assert {114, 115, 116, 117} <= on_disk  # the most recent evictions
            assert len(list(tmp_path.glob("slab-*.kv"))) == 8
            disk.index.check_integrity()

    asyncio.run(scenario())


def test_a_page_flipped_on_disk_is_counted_dropped_and_never_served(tmp_path: Path):
    """Pages 1, 2, 3 on disk, a bit of 2 flipped in its file: the promotion of 1..3
    brings back 1 only, counts 2 as corrupt and drops it from the tier (3 is valid but
    lies past the gap: the worker computes 2 and what follows). The host tier never
    holds 2."""

    async def scenario() -> None:
        async with tiers(tmp_path) as (host, disk, w):
            await spill(host, disk, w, [1, 2, 3], [0, 1, 2])
            await spill(host, disk, w, [7, 8, 9, 10], [3, 4, 5, 6])
            flip_byte(disk, 2)
            promoted = await promote(host, disk, H(1, 2, 3), 0.0)
            assert 1 in H.names(promoted) and 2 not in H.names(promoted)
            assert not index(host).stored(H[2]) and not disk.index.stored(H[2])
            assert len(lease_pages(host, w, [1, 2, 3])) == 1
            assert same_page(host, lease_pages(host, w, [1])[0], w, 0)
            assert disk.stats()["disk_corrupt_pages_total"] == 1
            assert disk.stats()["disk_tier_up"] == 1  # one bad page does not stop the tier
            index(host).check_integrity()
            disk.index.check_integrity()

    asyncio.run(scenario())


def test_a_restart_rebuilds_the_index_from_the_files(tmp_path: Path):
    """Six pages written, then the pool stops. One record is torn (half its page
    overwritten, as a crash mid-write leaves it) and a slab of another layout lies in
    the directory. A new pool on the same directory lists the five valid pages and
    promotes them byte-exact, counts the torn one and the other layout's records, and
    evicts in the old LRU order."""

    async def scenario() -> None:
        async with tiers(tmp_path, disk_slots=8) as (host, disk, w):
            await spill(host, disk, w, [1, 2, 3, 4], [0, 1, 2, 3])
            await spill(host, disk, w, [11, 12, 13, 14], [4, 5, 6, 7])
            await spill(host, disk, w, [21, 22], [0, 1])  # 1..4, then 11, 12 on disk
            assert H.named(disk.index.stored_hashes()) == [1, 2, 3, 4, 11, 12]
            for offset in range(0, PAGE_BYTES // 2, 64):  # 3's page: half rewritten
                flip_byte(disk, 3, offset)
        other = PoolCompat("another-model", "float32", 2, 2, 8, 4)
        theirs = SlabFiles(tmp_path, other)
        theirs.add_slab(2)
        record = RecordBuffer(1, other).view(0)
        seal(record, H[5], 1, bytes.fromhex(other.digest), other.page_bytes, H.proof(5))
        theirs.write([1], [record])
        theirs.close()

        async with tiers(tmp_path, disk_slots=8) as (host, disk, w):
            stats = disk.stats()
            assert stats["disk_restored_pages"] == 5 and stats["disk_corrupt_pages_total"] == 1
            assert stats["disk_foreign_pages"] == 1
            assert H.named(disk.index.stored_hashes()) == [1, 2, 4, 11, 12]
            assert H.names(await promote(host, disk, H(1, 2), 0.0)) == {1, 2}
            for page, buffer_page in zip(lease_pages(host, w, [1, 2]), [0, 1]):
                assert same_page(host, page, w, buffer_page)
            # the promotion moved 1 and 2 up: 4 is the oldest now. Four more pages to
            # disk fill its three free slots and take the oldest one's
            await spill(host, disk, w, [31, 32, 33, 34], [0, 1, 2, 3])
            await spill(host, disk, w, [41, 42, 43, 44], [4, 5, 6, 7])
            assert not disk.index.stored(H[4]) and disk.index.stored(H[11])
            assert disk.stats()["disk_evictions_total"] == 1
            disk.index.check_integrity()

    asyncio.run(scenario())


def test_a_restart_with_a_lower_bound_removes_the_files_past_it(tmp_path: Path):
    """Four files of two slots (20 KiB each) are written under a 16-slot bound;
    restarted with a 50 KiB bound, the tier keeps the first two files, removes the
    rest (their pages are gone) and stays within the new bound."""

    async def scenario() -> None:
        async with tiers(tmp_path, host_pages=2, disk_slots=16) as (host, disk, w):
            for k in range(5):
                await spill(host, disk, w, [10 + 2 * k, 11 + 2 * k], [0, 1])
            assert len(list(tmp_path.glob("slab-*.kv"))) == 4  # 8 pages on disk
        lower = 50 * 1024 / (1 << 30)
        async with tiers(tmp_path, host_pages=2, disk_tier_gib=lower) as (host, disk, w):
            stats = disk.stats()
            assert stats["disk_bytes_total"] <= stats["disk_bytes_bound"]
            assert len(list(tmp_path.glob("slab-*.kv"))) == 2
            assert stats["disk_restored_pages"] == 4
            assert H.named(disk.index.stored_hashes()) == [10, 11, 12, 13]

    asyncio.run(scenario())


def test_a_worker_that_computes_faster_than_the_disk_reads_gets_only_the_host_part(
    tmp_path: Path,
):
    """Once the tier has measured its read rate, a lookup from a worker whose prefill
    is far quicker promotes nothing (the pages are counted as recomputed), while a slow
    worker's gets the disk pages. `promotion_cut` keeps the most profitable prefix."""
    assert promotion_cut([None, 0.0, None], 1.0) == 3  # unknown: load all
    assert promotion_cut([2.0, 0.0], None) == 2
    assert promotion_cut([2.0, 2.0], 1.0) == 0  # every disk page costs more
    assert promotion_cut([0.0, 0.0, 2.0, 2.0], 1.0) == 2  # the host pages only
    assert promotion_cut([2.0, 0.0, 0.0, 0.0], 1.0) == 4  # the host pages repay it

    async def scenario() -> None:
        async with tiers(tmp_path) as (host, disk, w):
            await spill(host, disk, w, [1, 2, 3, 4], [0, 1, 2, 3])
            await spill(host, disk, w, [5, 6, 7, 8], [4, 5, 6, 7])
            assert H.names(await promote(host, disk, H(1), 0.0)) == {1}  # measures the rate
            assert disk.rates["read"] is not None
            fast = 1e12  # tokens/s: a page computes in femtoseconds
            assert H.names(await promote(host, disk, H(2, 3), fast)) == set()
            assert disk.stats()["disk_recomputed_pages_total"] == 2
            assert lease_pages(host, w, [2, 3]) == ()
            assert H.names(await promote(host, disk, H(2, 3), 1.0)) == {2, 3}  # 4 s a page

    asyncio.run(scenario())


def test_an_unusable_directory_turns_the_tier_off_and_the_host_tier_goes_on(tmp_path: Path, caplog):
    """The directory lies under a regular file: the tier says so once, reports
    disk_tier_up 0, and spills and lookups keep working on host memory alone."""
    (tmp_path / "a-file").write_text("not a directory")

    async def scenario() -> None:
        async with tiers(tmp_path / "a-file" / "tier") as (host, disk, w):
            assert disk.down is not None and "cannot use the directory" in disk.down
            await spill(host, disk, w, [1, 2, 3, 4], [0, 1, 2, 3])
            await spill(host, disk, w, [5, 6], [4, 5])
            assert len(lease_pages(host, w, [3, 4, 5, 6])) == 4
            assert H.names(await promote(host, disk, H(1), 0.0)) == set()
            stats = disk.stats()
            assert stats["disk_tier_up"] == 0 and stats["disk_write_pages_total"] == 0

    asyncio.run(scenario())
    assert "the disk tier in" in caplog.text and "is off" in caplog.text


def test_a_full_disk_stops_the_tier_growing_and_serving_goes_on(tmp_path: Path, monkeypatch):
    """After the tier's first file (2 slots) the disk is full: the tier stays at that
    size (disk_tier_full), keeps writing by LRU within it and serves its pages. (A disk
    cannot be filled for real on a shared machine without root, so the allocation of
    the second file is refused with ENOSPC by a stand-in for ``posix_fallocate``.)"""

    def disk_full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    async def scenario() -> None:
        async with tiers(tmp_path, host_pages=2, disk_slots=16) as (host, disk, w):
            await spill(host, disk, w, [1, 2], [0, 1])
            await spill(host, disk, w, [3, 4], [2, 3])  # 1, 2 to disk: the first file
            monkeypatch.setattr(os, "posix_fallocate", disk_full)
            for k in range(3):
                await spill(host, disk, w, [10 + 2 * k, 11 + 2 * k], [4, 5])
            stats = disk.stats()
            assert stats["disk_tier_full"] == 1 and stats["disk_tier_up"] == 1
            assert stats["disk_pages_total"] == 2 and stats["disk_write_pages_total"] == 8
            assert H.names(await promote(host, disk, H(12, 13), 0.0)) == {12, 13}
            assert len(list(tmp_path.glob("slab-*.kv"))) == 1

    asyncio.run(scenario())


def test_a_tier_whose_first_file_the_kernel_refuses_turns_off(tmp_path: Path):
    """Files may not grow past 4 KiB (RLIMIT_FSIZE, a real refusal by the kernel): the
    tier's first file cannot be made, the tier turns off, and the host tier serves."""

    async def scenario() -> None:
        with file_size_limit(4096):
            async with tiers(tmp_path, host_pages=2) as (host, disk, w):
                await spill(host, disk, w, [1, 2], [0, 1])
                await spill(host, disk, w, [3, 4], [2, 3])
                assert disk.down is not None and "cannot add a file" in disk.down
                assert disk.stats()["disk_tier_up"] == 0
                assert len(lease_pages(host, w, [3, 4])) == 2
                assert list(tmp_path.glob("slab-*.kv")) == []

    asyncio.run(scenario())


def test_a_write_the_kernel_refuses_turns_the_tier_off_and_serving_goes_on(tmp_path: Path):
    """Once the tier's first file is full, files may not be written past 8 KiB
    (RLIMIT_FSIZE): the next write, into a slot past that, fails; the tier turns off,
    its pages are no longer offered, and the host tier keeps serving."""

    async def scenario() -> None:
        async with tiers(tmp_path, host_pages=2, disk_slots=16) as (host, disk, w):
            await spill(host, disk, w, [1, 2], [0, 1])
            await spill(host, disk, w, [3, 4], [2, 3])  # 1, 2 fill the first file
            with file_size_limit(8192):
                await spill(host, disk, w, [5, 6], [4, 5])  # 3, 4 go nowhere
            assert disk.down is not None and "a write failed" in disk.down
            assert disk.stats()["disk_tier_up"] == 0
            assert on_disk(host, disk, H(1, 2)) == []  # not offered any more
            assert H.names(await promote(host, disk, H(1, 2), 0.0)) == set()
            assert len(lease_pages(host, w, [5, 6])) == 2

    asyncio.run(scenario())


_WRITER = """
import asyncio, sys, torch
from pathlib import Path
from radixserve.services.kvstore.disk_pool import DiskPool
from radixserve.services.kvstore.settings import KVStoreSettings
from radixserve.transfer import PoolCompat
from tests.kvstore.page_chain import Chain

compat = PoolCompat("disk-kill-test", "float32", 2, 2, 8, 4)
H = Chain(4, 8192)
kv = torch.zeros((2, 2, 16, 4, 2, 8))  # a host pool of 16 pages
shape = (2, 2, 4, 2, 8)

async def main():
    s = KVStoreSettings(host_capacity_gib=1.0, disk_tier_dir=Path(sys.argv[1]),
                        disk_tier_gib=float(sys.argv[2]), disk_write_buffer_mib=1)
    disk = DiskPool("writer", s)
    disk.open(compat, kv)
    page_hash = 0
    while True:  # evicted pages without end: the writer thread is always writing
        for page in range(16):
            page_hash += 1
            kv[:, :, page] = torch.arange(256.0).reshape(shape) + page_hash
            disk.stage(H[page_hash], kv[:, :, page], H.proof(page_hash))
        print(disk.stats()["disk_write_pages_total"], flush=True)
        await asyncio.sleep(0)
        while disk.stats()["disk_write_queued_pages"] > 32:
            await asyncio.sleep(0.001)

asyncio.run(main())
"""


def test_pages_listed_after_a_sigkill_mid_write_read_back_valid_and_exact(tmp_path: Path):
    """A process writes evicted pages to a 64-slot tier without pause and is SIGKILLed
    while its writer thread is busy; a tier rebuilt from its files lists pages every one
    of which promotes with a valid checksum and exactly the bytes written for it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_WRITER), str(tmp_path),
                              str(disk_gib(64))], stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert child.stdout is not None
        for line in child.stdout:  # until the tier has wrapped around its slots twice
            if int(line) > 200:
                break
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL

    async def scenario() -> None:
        compat = PoolCompat("disk-kill-test", "float32", 2, 2, 8, 4)
        kv = torch.zeros((2, 2, 80, 4, 2, 8))  # the host pool the tier reads into
        disk = DiskPool("reader", settings(tmp_path, 80, 64))
        disk.open(compat, kv)
        try:
            await until(lambda: disk.ready, 5, "the rebuild")
            listed = disk.index.stored_hashes()
            torn = disk.counters["disk_corrupt_pages_total"]  # found by the rebuild
            assert len(listed) + torn <= 64 and len(listed) >= 48  # at most a batch torn
            lease_id = disk.hold("t", listed)
            assert await disk.read([(h, page) for page, h in enumerate(listed)]) == [True] * len(
                listed
            )
            disk.release(lease_id)
            chain = Chain(4, 8192)
            for page, page_hash in enumerate(listed):
                expected = torch.arange(256.0).reshape(2, 2, 4, 2, 8) + chain.named([page_hash])[0]
                assert torch.equal(kv[:, :, page], expected), page_hash
        finally:
            await disk.stop()

    asyncio.run(scenario())


def test_a_record_whose_tokens_do_not_give_its_hash_is_never_served(tmp_path: Path):
    """Page 2's record rewritten with other tokens under its own hash and a valid
    checksum (a writer that was wrong): after a restart the rebuild finds its tokens do
    not give its hash, counts it in ``kv_identity_mismatch_total`` and drops it; the
    others are served."""

    async def scenario() -> None:
        async with tiers(tmp_path) as (host, disk, w):
            await spill(host, disk, w, [1, 2, 3, 4], [0, 1, 2, 3])
            await spill(host, disk, w, [5, 6, 7, 8], [4, 5, 6, 7])
            files, slot = disk.files, disk.index.slot_of(H[2])
            assert files is not None and slot is not None
            record = RecordBuffer(1, files.compat)
            files.read([slot], [record.view(0)])
            found = check(record.view(0), files.digest, files.page_bytes, files.page_size)
            assert found is not None and found[0] == H[2] and found[2] == H.proof(2)
            tokens = H.proof(2).token_ids
            other = PageProof(H.proof(2).namespace, H[1], pack_tokens([tokens[0] + 1, *tokens[1:]]))
            seal(record.view(0), H[2], found[1], files.digest, files.page_bytes, other)
            files.write([slot], [record.view(0)])
        async with tiers(tmp_path) as (host, disk, w):
            stats = disk.stats()
            assert stats["kv_identity_mismatch_total"] == 1
            assert stats["disk_corrupt_pages_total"] == 0  # its checksum is valid
            assert not disk.index.stored(H[2]) and disk.index.stored(H[3])
            assert H.names(await promote(host, disk, H(1, 2, 3), 0.0)) == {1}

    asyncio.run(scenario())


def test_files_are_adopted_at_start_and_let_go_for_a_worker_of_another_identity(tmp_path: Path):
    """A kvstore starting on a directory with pages adopts them before any worker
    attaches (`loaded`: it is not ready until then); a first worker whose pages have
    another layout (another model identity) gets none of them: they are counted as
    another model's, left alone in their files, and its own pages go to new ones."""

    async def scenario() -> None:
        async with tiers(tmp_path) as (host, disk, w):
            await spill(host, disk, w, [1, 2, 3, 4], [0, 1, 2, 3])
            await spill(host, disk, w, [5, 6, 7, 8], [4, 5, 6, 7])
        before = sorted(tmp_path.glob("slab-*.kv"))
        s = settings(tmp_path, 4, 64)
        disk = DiskPool("kvstore-test", s)
        disk.prepare()
        assert not disk.loaded  # adopting: the kvstore is not ready
        await until(lambda: disk.loaded, 5, "the adoption at start")
        assert disk.stats()["disk_restored_pages"] == 4 and disk.down is None  # 1..4
        host = HostPool("kvstore-test", s, [disk])
        other = worker(head_dim=16)
        try:
            attach(host, other)
            assert host.compat is not None and host.kv is not None
            disk.open(host.compat, host.kv)
            await until(lambda: disk.ready, 5, "the rebuild for the worker's layout")
            stats = disk.stats()
            assert stats["disk_restored_pages"] == 0 and stats["disk_foreign_pages"] == 4
            assert on_disk(host, disk, H(1, 2)) == []
            # its pages are twice as large: the host tier holds two; 11, 12 go to disk
            await spill(host, disk, other, [11, 12], [0, 1])
            await spill(host, disk, other, [13, 14], [2, 3])
            assert set(before) <= set(tmp_path.glob("slab-*.kv"))  # left alone
        finally:
            await host.stop()
            await disk.stop()
            other.agent.close()
        # reclaimed on request: started with disk_reclaim_others, the first layout's
        # worker gets its pages again and the other layout's file is removed
        theirs = set(tmp_path.glob("slab-*.kv")) - set(before)
        async with tiers(tmp_path, disk_reclaim_others=True) as (host, disk, w):
            stats = disk.stats()
            assert stats["disk_foreign_pages"] == 0 and stats["disk_restored_pages"] == 4
            assert theirs and not theirs & set(tmp_path.glob("slab-*.kv"))
            assert set(before) <= set(tmp_path.glob("slab-*.kv"))

    asyncio.run(scenario())


def test_one_adapters_pages_on_disk_serve_no_other_adapter(tmp_path: Path):
    """Pages a LoRA adapter's requests spilled (their namespace: the model's identity with
    the adapter's fingerprint), evicted from the host tier to disk: the same tokens under
    another adapter's namespace, or the base model's, find nothing in either tier and
    promote nothing; under their own they come back."""
    identity = ModelIdentity("weights-digest", "int4", "bfloat16")
    a, b = (Chain(4, 64, hash_namespace(dataclasses.replace(identity, adapter=f).key))
            for f in ("fingerprint-a", "fingerprint-b"))  # fmt: skip
    base = Chain(4, 64, hash_namespace(identity.key))

    async def scenario() -> None:
        async with tiers(tmp_path) as (host, disk, w):
            for spill_id, names in ((1, [1, 2, 3, 4]), (2, [5, 6, 7, 8])):  # 1..4 to disk
                buffer_pages = [name - 1 for name in names]
                assert await host.spill(w.name, a.offer(spill_id, names, buffer_pages)) == 4
                await until(lambda: disk.idle, 5, "the disk writes")
            assert on_disk(host, disk, a(1, 2, 3)) == [True, True, True]
            for other in (b, base):
                assert on_disk(host, disk, other(1, 2, 3)) == []
                assert on_disk(host, disk, other(5, 6)) == []  # nor in the host tier
                assert await promote(host, disk, other(1, 2, 3), 0.0) == set()
            assert a.names(await promote(host, disk, a(1, 2, 3), 0.0)) == {1, 2, 3}

    asyncio.run(scenario())
