"""The kvstore's disk tier: what the host tier evicts, kept in files and promoted on a hit.

A `LowerTier` (`services.kvstore.tier`), built in as ``disk``: its files (`SlabFiles`,
under ``disk_tier_dir``, at most ``disk_tier_gib``), its index (`DiskPageIndex`, an LRU
of its own) and two I/O threads, one writing and one reading, so a hit never waits
behind a batch of writes.

* **Demotion** (`stage`): the host tier is about to reuse a page it evicts; unless the
  disk holds that hash already (then it is only touched), its bytes are copied into a
  record of the write buffer (``disk_write_buffer_mib``; full = not written, counted).
  The writer takes up to `_WRITE_BATCH` records at a time, takes slots (adding a file
  while under the bound, else overwriting the least recently used pages), seals each
  record (header and CRC-32) and writes them, one ``pwritev`` per run of slots. Only
  then are the pages visible (`DiskPageIndex.commit`): a page is readable only once
  fully written and checksummed.
* **Promotion** (`read`, by `services.kvstore.promotion`, on a `HostLookup`): the held
  pages of a run are read on the reader thread, each record checked (magic, layout,
  hash, CRC, proof) and copied into its reserved host page; a page that fails is
  counted in ``disk_corrupt_pages_total`` and dropped from the tier (`promoted`).
* **Restart** and **growth** (`services.kvstore.disk_slabs`): at start the valid pages
  found in the files are adopted in their old LRU order (the kvstore is not ready
  before); files are added in eighths of the bound as pages arrive.
* **Faults**: a file that cannot be added (disk full, quota) stops the tier growing
  (``disk_tier_full``); a directory that cannot be used, or a write or read that
  fails, turns the tier off (``disk_tier_up`` 0, logged once). Serving goes on either
  way: the host tier and recomputation do not depend on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import torch

from radixserve.cache.disk_index import DiskPageIndex
from radixserve.cache.page_proof import PageProof
from radixserve.runtime.kv_events import MEDIUM_DISK
from radixserve.services.kvstore.disk_files import (
    RecordBuffer,
    SlabFiles,
    newest_layout,
    read_records,
    record_bytes,
    write_records,
)
from radixserve.services.kvstore.disk_slabs import adopt_files, grow
from radixserve.services.kvstore.settings import DiskTierSettings
from radixserve.services.kvstore.tier import TierSpec
from radixserve.services.kvstore.tier_events import TierEvents
from radixserve.transfer import PoolCompat

logger = logging.getLogger(__name__)

T = TypeVar("T")

_WRITE_BATCH = 64  # records per write round
_READ_CHUNK_BYTES = 32 << 20  # the read buffer: records per preadv round
_RATE_WEIGHT = 0.3  # weight of the newest measurement in the rates' moving averages
_PIPELINE_CHUNKS = 8  # an overlapped promotion reads in up to this many chunks
#: the tier's counters (stats and metrics: radixserve_worker_<name> of the kvstore)
COUNTERS = (
    "disk_writes_total", "disk_write_pages_total", "disk_write_bytes_total",
    "disk_write_dropped_pages_total", "disk_promotions_total",
    "disk_overlapped_promotions_total", "disk_read_pages_total",
    "disk_read_bytes_total", "disk_hit_pages_total", "disk_recomputed_pages_total",
    "disk_corrupt_pages_total", "disk_foreign_pages", "disk_restored_pages",
    "kv_identity_mismatch_total",
)  # fmt: skip


class DiskPool:
    """The disk tier: files, index, write buffer and I/O threads; driven by the kvstore."""

    tier_name, medium = "disk", MEDIUM_DISK

    def __init__(
        self, name: str, settings: DiskTierSettings, events: TierEvents | None = None
    ) -> None:
        """``events``: publishes the pages that enter and leave this tier."""
        self.name, self.root = name, settings.disk_tier_dir
        self.events, self.flush_s = events, settings.disk_flush_s
        self._announced = False  # the index's stored pages were published
        self.bound_bytes = int(settings.disk_tier_gib * (1 << 30))
        self.buffer_bytes = settings.disk_write_buffer_mib << 20
        self.chunk_bytes = int(settings.disk_read_chunk_mib * (1 << 20))
        self.reclaim_others = settings.disk_reclaim_others
        self.index = DiskPageIndex(self._evicted)
        self.files: SlabFiles | None = None
        self.down: str | None = None  # why the tier is off
        self.full = False  # a file could not be added: the tier keeps the size it has
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        # bytes/s, moving averages of promotions' reads and of write rounds; seconds spent
        self.rates: dict[str, float | None] = {"read": None, "write": None}
        self.seconds = {"read": 0.0, "write": 0.0}
        self.write_buffer: RecordBuffer  # made by `open`, sized for the pages' layout
        self.read_buffer: RecordBuffer
        self.ready = False  # the rebuild is done: pages may be promoted
        self._host_kv: torch.Tensor | None = None
        self._staged: list[tuple[int, int, PageProof]] = []  # (hash, record, proof), in order
        self._staged_hashes: set[int] = set()
        self._free_records: list[int] = []
        self._wake = asyncio.Event()  # pages were staged
        self._written = asyncio.Event()  # a write round ended
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-disk-read")
        self._write_io = partial(self._io, self._writer)
        self._task: asyncio.Task | None = None
        self._prepared: asyncio.Task | None = None
        self._seq = 0

    @property
    def up(self) -> bool:
        """Open and working (pages may be read and written)."""
        return self.files is not None and self.down is None

    @property
    def idle(self) -> bool:
        """No page waits to be written nor is being written."""
        return not self.up or len(self._free_records) == self.write_buffer.count

    def prepare(self) -> None:
        """At the kvstore's start: adopt the files of the newest slab's layout at once,
        without waiting for a worker (`loaded` says when that is done: the kvstore is
        not ready before), so a warm restart serves its pages from the first request."""
        if self.root is not None and self._prepared is None:
            self._prepared = asyncio.create_task(self._adopt(None))

    @property
    def loaded(self) -> bool:
        """The files found at start are adopted (or there were none, or the tier is off)."""
        return self._prepared is None or self._prepared.done()

    async def _adopt(self, compat: PoolCompat | None) -> None:
        """Use layout ``compat`` (None: the newest slab's, if any), adopting the pages of
        its files (`_rebuild`)."""
        assert self.root is not None
        try:
            if compat is None:
                compat = await self._io(self._reader, newest_layout, self.root)
            if compat is not None:
                self._use(compat)
                await self._rebuild()
        except OSError as exc:
            self._fail(f"cannot use the directory: {exc}")
        except Exception as exc:  # the tier's own fault: it must never fail a request
            logger.exception("%s: the disk tier's rebuild failed", self.name)
            self._fail(f"its rebuild failed: {exc!r}")

    def _use(self, compat: PoolCompat) -> None:
        """Files, index and buffers for pages of layout ``compat`` (none adopted yet)."""
        assert self.root is not None
        if self.files is not None:  # adopted at start for another model identity
            self.files.close()
        self.files = SlabFiles(self.root, compat)
        self._unannounce()  # the pages adopted for another layout are let go
        self.index = DiskPageIndex(self._evicted)
        size = record_bytes(compat.page_bytes, compat.page_size)
        self.write_buffer = RecordBuffer(max(1, self.buffer_bytes // size), compat)
        self.read_buffer = RecordBuffer(max(1, _READ_CHUNK_BYTES // size), compat)
        self._free_records = list(range(self.write_buffer.count - 1, -1, -1))

    def open(self, compat: PoolCompat, host_kv: torch.Tensor) -> bool:
        """Start the tier for the host pool ``host_kv`` (L, 2, P, S, H, D) of pages
        ``compat`` (once, when the first worker attaches): the pages adopted at start
        if they are of this layout (else the rebuild from this layout's files), then
        the writer. Whether the tier is on."""
        if self.root is not None and self._task is None and self.down is None:
            self._host_kv = host_kv
            self._task = asyncio.create_task(self._run(compat))
        return self.down is None

    async def stop(self) -> None:
        for task in (self._prepared, self._task):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        if self.files is not None:
            self.files.close()

    def _fail(self, reason: str) -> None:
        if self.down is None:
            self.down = reason
            logger.error("%s: the disk tier in %s is off: %s; serving goes on without it",
                         self.name, self.root, reason)  # fmt: skip
            self._unannounce()  # never served again
        self._free_records.extend(record for _, record, _ in self._staged)
        self._staged.clear()
        self._staged_hashes.clear()

    async def _io(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _run(self, compat: PoolCompat) -> None:
        if self._prepared is not None:
            await self._prepared
        if self.down is not None:
            return
        if self.files is None or self.files.compat.digest != compat.digest:
            if self.files is not None:
                logger.warning("%s: the pages adopted from %s are of another model identity "
                               "or layout than the workers' (%s); left alone", self.name,
                               self.root, "; ".join(compat.mismatches(self.files.compat)))  # fmt: skip
            await self._adopt(compat)
            if self.down is not None:
                return
        self.ready = True
        while self.up:
            await self._wake.wait()
            self._wake.clear()
            while self._staged and self.up:
                batch = self._staged[:_WRITE_BATCH]
                del self._staged[:_WRITE_BATCH]
                await self._write(batch)

    # -- events ---------------------------------------------------------------------------

    def _unannounce(self) -> None:
        """Publish that every page the tier published as stored is gone from it."""
        if self._announced and self.events is not None:
            self.events.removed(MEDIUM_DISK, self.index.stored_hashes())
        self._announced = False

    def _evicted(self, page_hash: int, slot: int, proof: PageProof | None) -> None:
        """The index evicts ``slot`` (it held ``page_hash``): a write overwrites it."""
        if self.events is not None:
            self.events.removed(MEDIUM_DISK, [page_hash])

    # -- restart --------------------------------------------------------------------------

    async def _rebuild(self) -> None:
        """Adopt the valid pages of this layout's slabs; count the rest."""
        files = self.files
        assert files is not None
        io = (partial(self._io, self._reader), self._write_io)
        found = await adopt_files(self.name, files, self.index, self.read_buffer, self.bound_bytes,
                                  self.reclaim_others, io, partial(self._measure, "read"))  # fmt: skip
        self.counters["disk_foreign_pages"] = found.foreign
        self.counters["disk_corrupt_pages_total"] += found.corrupt
        self.counters["kv_identity_mismatch_total"] += found.mismatched
        self._announced = True  # the pages adopted, least recently used first:
        if self.events is not None:
            hashes = self.index.stored_hashes()
            self.events.stored(MEDIUM_DISK, hashes, [self.index.proof(h) for h in hashes])
        self._seq = found.last_seq
        self.counters["disk_restored_pages"] = self.index.num_stored

    # -- demotion -------------------------------------------------------------------------

    def stage(self, page_hash: int, page: torch.Tensor, proof: PageProof | None) -> None:
        """The host tier evicts ``page`` ((L, 2, S, H, D), holding ``page_hash``, proved
        by ``proof``) and reuses it next: copy its bytes towards the disk, unless the
        disk has the page already (a page without a proof is not written)."""
        if not self.ready or not self.up or self.index.touch(page_hash):
            return
        if page_hash in self._staged_hashes:
            return
        if proof is None or not self._free_records:
            self.counters["disk_write_dropped_pages_total"] += 1
            return
        record = self._free_records.pop()
        self.write_buffer.page(record).copy_(page)
        self._staged.append((page_hash, record, proof))
        self._staged_hashes.add(page_hash)
        self._wake.set()

    async def _write(self, batch: list[tuple[int, int, PageProof]]) -> None:
        hashes = [h for h, _, _ in batch]
        try:
            files = self.files
            assert files is not None
            error = None if self.full else await grow(self.name, files, self.index, len(batch),
                                                      self.bound_bytes, self._write_io)  # fmt: skip
            if error is not None:
                self.full = True
                if not files.slabs:
                    self._fail(f"cannot add a file: {error}")
            reserved = self.index.reserve(hashes)
            self.counters["disk_write_dropped_pages_total"] += len(batch) - len(reserved)
            jobs = []
            for i, slot in reserved:
                self._seq += 1
                jobs.append((slot, batch[i][1], hashes[i], self._seq, batch[i][2]))
            mine = [h for _, _, h, _, _ in jobs]
            try:
                seconds = await self._io(
                    self._writer, write_records, files, self.write_buffer, jobs
                )
            except Exception as exc:  # OSError, or the tier's own fault: never a request's
                if not isinstance(exc, OSError):
                    logger.exception("%s: a disk tier write failed", self.name)
                self.index.abort(mine)
                self._fail(f"a write failed: {exc!r}")
                return
            proofs = [proof for *_, proof in jobs]
            self.index.commit(mine, proofs)
            if self.events is not None:
                self.events.stored(MEDIUM_DISK, mine, proofs)
            written = len(jobs) * self.write_buffer.record_bytes
            self.counters["disk_writes_total"] += 1
            self.counters["disk_write_pages_total"] += len(jobs)
            self.counters["disk_write_bytes_total"] += written
            self._measure("write", written, seconds)
        finally:
            for page_hash, record, _ in batch:
                self._staged_hashes.discard(page_hash)
                self._free_records.append(record)
            self._written.set()

    async def flush(self, pages: Iterable[tuple[int, torch.Tensor, PageProof | None]]) -> int:
        """Write the host tier's ``pages`` the disk lacks, least recently used first (so
        the LRU order survives), within ``disk_flush_s``: a restart finds them. How many
        were staged."""
        deadline = time.monotonic() + self.flush_s
        staged = 0
        for page_hash, page, proof in pages:
            while self.up and self.ready and not self._free_records:
                if time.monotonic() >= deadline:
                    return staged
                self._wake.set()
                await asyncio.sleep(0.005)
            if not (self.up and self.ready) or time.monotonic() >= deadline:
                return staged
            before = len(self._staged)
            self.stage(page_hash, page, proof)
            staged += len(self._staged) - before
        while not self.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # the writer drains what was staged
        return staged

    # -- promotion (`LowerTier`) ----------------------------------------------------------

    def holds(self, page_hash: int) -> bool:
        return self.up and self.ready and self.index.stored(page_hash)

    def proof(self, page_hash: int) -> PageProof | None:
        return self.index.proof(page_hash)

    def hold(self, holder: str, page_hashes: Sequence[int]) -> int:
        return self.index.hold(holder, page_hashes, math.inf)[0] if page_hashes else 0

    def release(self, lease_id: int) -> None:
        self.index.release(lease_id)

    async def settle(self, page_hash: int, timeout_s: float) -> bool:
        """Wait for a write round if ``page_hash`` is on its way to disk."""
        if page_hash not in self._staged_hashes:
            return False
        self._written.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._written.wait(), timeout_s)
        return True

    def read_s_per_page(self) -> float | None:
        rate = self.rates["read"]
        return self.write_buffer.record_bytes / rate if rate else None

    def chunk_pages(self, num_pages: int) -> int:
        """Pages per chunk of an overlapped promotion of ``num_pages``."""
        least = -(-self.chunk_bytes // self.read_buffer.record_bytes)
        return max(1, least, -(-num_pages // _PIPELINE_CHUNKS))

    async def read(self, jobs: Sequence[tuple[int, int]]) -> list[bool]:
        """Read held pages (hash, host page) on the reader thread; per job, whether it
        was valid (a failed read turns the tier off and fails them all)."""
        slots = [self.index.slot_of(h) for h, _ in jobs]
        checked = [(slot, page, h, self.index.proof(h)) for slot, (h, page) in zip(slots, jobs)]
        try:
            ok, seconds = await self._io(self._reader, read_records, self.files, self.read_buffer,
                                         self._host_kv, checked)  # fmt: skip
        except Exception as exc:  # OSError, or the tier's own fault: never a request's
            if not isinstance(exc, OSError):
                logger.exception("%s: a disk tier read failed", self.name)
            self._fail(f"a read failed: {exc!r}")
            return [False] * len(jobs)
        self._measure("read", len(jobs) * self.read_buffer.record_bytes, seconds)
        return ok

    def promoted(self, good: list[int], bad: list[int], recomputed: int, overlapped: bool) -> None:
        """Count a promotion's pages; drop those that failed their check."""
        self.counters["disk_recomputed_pages_total"] += recomputed
        if not (good or bad):
            return
        self.counters["disk_overlapped_promotions_total"] += overlapped
        if bad and self.up:
            self.index.drop(bad)
            if self.events is not None:
                self.events.removed(MEDIUM_DISK, bad)
            self.counters["disk_corrupt_pages_total"] += len(bad)
            logger.warning("%s: %d disk page(s) failed their checksum; dropped, recomputed",
                           self.name, len(bad))  # fmt: skip
        for h in reversed(good):  # a page read from disk is in use: up in its LRU
            self.index.touch(h)
        num_read = len(good) + len(bad)
        self.counters["disk_promotions_total"] += 1
        self.counters["disk_read_pages_total"] += num_read
        self.counters["disk_read_bytes_total"] += num_read * self.read_buffer.record_bytes
        self.counters["disk_hit_pages_total"] += len(good)

    def _measure(self, kind: str, nbytes: int, seconds: float) -> None:
        """Count ``nbytes`` read or written (``kind``) in ``seconds`` into its rate."""
        if nbytes <= 0 or seconds <= 0:
            return
        self.seconds[kind] += seconds
        old, rate = self.rates[kind], nbytes / seconds
        self.rates[kind] = rate if old is None else (1 - _RATE_WEIGHT) * old + _RATE_WEIGHT * rate

    # -- state ----------------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        stats: dict[str, int | float] = dict(self.index.stats())
        stats.update(self.counters)  # its hits are promotions' (the index counts leases)
        files = self.files
        stats["disk_tier_up"] = int(self.up)
        stats["disk_tier_full"] = int(self.full)
        stats["disk_bytes_total"] = files.size_bytes if files is not None else 0
        stats["disk_bytes_bound"] = self.bound_bytes
        stats["disk_bytes_stored"] = self.index.num_stored * (files.record_bytes if files else 0)
        stats["disk_direct_io"] = int(files is not None and files.direct)
        stats["disk_write_queued_pages"] = len(self._staged)
        for kind in ("read", "write"):
            stats[f"disk_{kind}_bytes_per_s"] = round(self.rates[kind] or 0.0)
            stats[f"disk_{kind}_seconds_total"] = round(self.seconds[kind], 6)
        return stats


def _build(name: str, settings: DiskTierSettings, events: TierEvents | None) -> DiskPool | None:
    """The disk tier when ``disk_tier_dir`` is set, adopting its files from now on."""
    if settings.disk_tier_dir is None:
        return None
    pool = DiskPool(name, settings, events)
    pool.prepare()  # its files are adopted now: the kvstore is not ready before
    return pool


TIER = TierSpec("disk", DiskTierSettings, _build)
