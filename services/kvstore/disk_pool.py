"""The kvstore's disk tier: what the host tier evicts, kept in files and promoted on a hit.

The kvstore owns it (docs/architecture.md, ownership): its files (`SlabFiles`, under
``disk_tier_dir``, at most ``disk_tier_gib``), its index (`DiskPageIndex`, an LRU of its
own) and two I/O threads, one writing and one reading, so a hit never waits behind a
batch of writes. Pages are whole (every layer, K and V, every head), as in the host
tier, so the tier does not depend on the workers' tensor parallelism.

* **Demotion** (`stage`): the host tier is about to reuse a page it evicts; unless the
  disk holds that hash already (then it is only touched), its bytes are copied into a
  record of the write buffer (``disk_write_buffer_mib``; full = not written, counted).
  The writer takes up to `_WRITE_BATCH` records at a time, takes slots (adding a file
  while under the bound, else overwriting the least recently used pages), seals each
  record (header and CRC-32) and writes them, one ``pwritev`` per run of slots. Only
  then are the pages visible (`DiskPageIndex.commit`): a page is readable only once
  fully written and checksummed.
* **Promotion** (`promote`, on a `HostLookup`): the leading run of the asked hashes
  held in host memory or on disk; `promotion_cut` keeps the part worth reading at the
  tier's measured read rate against the asking worker's prefill rate (a worker that
  recomputes faster gets only what is already in host memory). Those disk pages are
  read into reserved host pages, each record checked (magic, layout, hash, CRC), and
  committed; the lease covers them. Overlapped (the kvstore's ``disk_read_overlap``),
  the lease goes out once the host pages are reserved and the pages are read in
  chunks (up to `_PIPELINE_CHUNKS`, of at least ``disk_read_chunk_mib``; a run of one
  chunk is read first), each announced when committed, so the worker reads them
  into its device pool while the next chunk is read from disk. A page that fails is
  counted in ``disk_corrupt_pages_total``, dropped from the tier and never served: the
  run stops there and the worker computes the rest. One promotion runs at a time.
* **Restart** (`prepare`, at the kvstore's start, for the layout of the newest slab;
  `_rebuild`): every slab of this layout is read and each record checked; the valid
  ones whose tokens give their hash (`PageProof`) are adopted in their old LRU order,
  the rest counted (``disk_corrupt_pages_total``, ``kv_identity_mismatch_total``);
  slabs of another model identity or layout are left alone (never served) and their
  records counted (``disk_foreign_pages``); ``disk_reclaim_others`` removes them
  instead. The kvstore is not ready until this is done (`loaded`). When the first
  worker attaches with another layout (other weights, quantization or dtype: another
  `PoolCompat.digest`), the adopted pages are let go and that layout's slabs rebuilt
  instead. Writes start once a worker's layout is known and adopted.
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
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from radixserve.cache.disk_index import DiskPageIndex
from radixserve.cache.host_index import HostPageIndex
from radixserve.cache.page_proof import PageProof
from radixserve.runtime.kv_events import MEDIUM_CPU, MEDIUM_DISK
from radixserve.services.kvstore.disk_files import (
    RecordBuffer,
    SlabFiles,
    check,
    count_records,
    newest_layout,
    record_bytes,
    seal,
)
from radixserve.services.kvstore.settings import KVStoreSettings
from radixserve.services.kvstore.tier_events import TierEvents
from radixserve.transfer import PoolCompat

logger = logging.getLogger(__name__)

T = TypeVar("T")

_WRITE_BATCH = 64  # records per write round
_READ_CHUNK_BYTES = 32 << 20  # the read buffer: records per preadv round
_SLAB_MAX_BYTES = 1 << 30
_SLABS_PER_BOUND = 8  # the bound is allocated in eighths, as pages arrive
_RATE_WEIGHT = 0.3  # weight of the newest measurement in the rates' moving averages
_HOLDER = "disk-promotion"
_WRITTEN_WAIT_S = 0.5  # longest wait of a promotion for pages of its run being written
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


@dataclass
class _Run:
    """A promotion's run: its hashes in order and, per page, whether it is read from disk
    (else it is in host memory)."""

    hashes: list[int]
    on_disk: list[bool]

    @property
    def disk_hashes(self) -> list[int]:
        return [h for h, disk in zip(self.hashes, self.on_disk) if disk]

    @property
    def host_hashes(self) -> list[int]:
        return [h for h, disk in zip(self.hashes, self.on_disk) if not disk]

    def cut_at_unreserved(self, reserved: set[int]) -> None:
        """End the run before its first disk page without a host page to go to."""
        n = self.ready(reserved)
        del self.hashes[n:], self.on_disk[n:]

    def ready(self, read: set[int]) -> int:
        """Its leading pages readable once the disk pages ``read`` are in host memory."""
        pending = (i for i, h in enumerate(self.hashes) if self.on_disk[i] and h not in read)
        return next(pending, len(self.hashes))


def promotion_cut(
    on_disk: Sequence[bool], read_s_per_page: float | None, recompute_s_per_page: float | None
) -> int:
    """How many leading pages of a run (``on_disk[i]``: page i must be read from disk,
    else it is in host memory) to load rather than recompute: the length that saves the
    most time when a disk page costs ``read_s_per_page`` and computing a page costs
    ``recompute_s_per_page``. Unknown rates (None or 0) load the whole run."""
    if not read_s_per_page or not recompute_s_per_page:
        return len(on_disk)
    best, gain, best_gain = 0, 0.0, 0.0
    for i, disk in enumerate(on_disk):
        gain += recompute_s_per_page - (read_s_per_page if disk else 0.0)
        if gain > best_gain:
            best, best_gain = i + 1, gain
    return best


class DiskPool:
    """The disk tier: files, index, write buffer and I/O threads; driven by the kvstore."""

    def __init__(
        self, name: str, settings: KVStoreSettings, events: TierEvents | None = None
    ) -> None:
        """``events``: publishes the pages that enter and leave this tier (medium
        "DISK") and those it promotes into the host tier ("CPU")."""
        self.name, self.root = name, settings.disk_tier_dir
        self.events = events
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
        self._page_size = 0
        self._host_kv: torch.Tensor | None = None
        self._staged: list[tuple[int, int, PageProof]] = []  # (hash, record, proof), in order
        self._staged_hashes: set[int] = set()
        self._free_records: list[int] = []
        self._wake = asyncio.Event()  # pages were staged
        self._written = asyncio.Event()  # a write round ended
        self._promoting = asyncio.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-disk-read")
        self._task: asyncio.Task | None = None
        self._prepared: asyncio.Task | None = None
        self._seq = 0

    @property
    def configured(self) -> bool:
        return self.root is not None

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
        if self.configured and self._prepared is None:
            self._prepared = asyncio.create_task(self._prepare())

    @property
    def loaded(self) -> bool:
        """The files found at start are adopted (or there were none, or the tier is off)."""
        return self._prepared is None or self._prepared.done()

    async def _prepare(self) -> None:
        assert self.root is not None
        try:
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

    def open(self, compat: PoolCompat, host_kv: torch.Tensor) -> None:
        """Start the tier for the host pool ``host_kv`` (L, 2, P, S, H, D) of pages
        ``compat`` (once, when the first worker attaches): the pages adopted at start
        if they are of this layout (else the rebuild from this layout's files), then
        the writer."""
        if not self.configured or self._task is not None or self.down is not None:
            return
        self._host_kv, self._page_size = host_kv, compat.page_size
        self._task = asyncio.create_task(self._run(compat))

    async def stop(self) -> None:
        for task in (self._prepared, self._task):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
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
            try:
                self._use(compat)
                await self._rebuild()
            except OSError as exc:
                self._fail(f"cannot use the directory: {exc}")
                return
            except Exception as exc:  # the tier's own fault: it must never fail a request
                logger.exception("%s: the disk tier's rebuild failed", self.name)
                self._fail(f"its rebuild failed: {exc!r}")
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

    def _announce(self) -> None:
        """Publish the pages adopted from the files, least recently used first."""
        self._announced = True
        if self.events is not None:
            hashes = self.index.stored_hashes()
            self.events.stored(MEDIUM_DISK, hashes, [self.index.proof(h) for h in hashes])

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
        files, root = self.files, self.root
        assert files is not None and root is not None
        await self._io(self._writer, lambda: root.mkdir(parents=True, exist_ok=True))
        ours, others = await self._io(self._reader, files.listing)
        if self.reclaim_others and others:
            for path in others:
                logger.warning("%s: %s holds pages of another model identity or layout; "
                               "removed (disk_reclaim_others)", self.name, path)  # fmt: skip
                await self._io(self._writer, path.unlink)
            others = []
        foreign = await self._io(self._reader, lambda: sum(count_records(p) for p in others))
        self.counters["disk_foreign_pages"] = foreign
        written: dict[int, int] = {}  # hash -> write sequence
        for path in ours:
            if files.size_bytes + path.stat().st_size > self.bound_bytes:
                logger.warning("%s: %s lies past the disk tier's bound; removed", self.name, path)
                await self._io(self._writer, path.unlink)
                continue
            try:
                slab = await self._io(self._reader, files.open_slab, path)
            except ValueError as exc:
                logger.warning("%s: %s is not a slab of this tier (%s); left alone",
                               self.name, path, exc)  # fmt: skip
                continue
            scan = await self._io(self._reader, files.scan, slab, self.read_buffer)
            self._measure("read", slab.num_slots * files.record_bytes, scan.seconds)
            keep: dict[int, tuple[int, int, PageProof]] = {}  # hash -> the newest copy
            for page_hash, slot, seq, proof in scan.found:
                if not proof.verifies(page_hash):  # its tokens do not give its hash
                    self.counters["kv_identity_mismatch_total"] += 1
                    continue
                if seq > written.get(page_hash, -1) and seq > keep.get(page_hash, (-1,))[0]:
                    keep[page_hash] = (seq, slot, proof)
            self.index.drop(h for h in keep if h in written)  # an older copy, in a slab before
            found = sorted(keep.items(), key=lambda item: item[1][0])
            self.index.adopt(slab.num_slots, [(h, slot) for h, (_, slot, _) in found],
                             [proof for _, (_, _, proof) in found])  # fmt: skip
            written.update((h, seq) for h, (seq, _, _) in found)
            self.counters["disk_corrupt_pages_total"] += scan.corrupt
        self.index.reorder(written)
        self._announce()
        self._seq = max(written.values(), default=0)
        self.counters["disk_restored_pages"] = self.index.num_stored
        logger.info("%s: disk tier in %s: %d pages found in %d files (%d torn or corrupt, "
                    "dropped; %d whose tokens do not prove their hash, dropped; %d of another "
                    "model identity or layout, left alone)", self.name, root,
                    self.index.num_stored, len(files.slabs),
                    self.counters["disk_corrupt_pages_total"],
                    self.counters["kv_identity_mismatch_total"], foreign)  # fmt: skip

    # -- demotion -------------------------------------------------------------------------

    def stage(self, page_hash: int, host_page: int, proof: PageProof | None) -> None:
        """The host tier evicts ``host_page`` (holding ``page_hash``, proved by
        ``proof``) and reuses it next: copy its bytes towards the disk, unless the disk
        has the page already (a page without a proof is not written)."""
        if not self.ready or not self.up or self.index.touch(page_hash):
            return
        if page_hash in self._staged_hashes:
            return
        if proof is None:
            self.counters["disk_write_dropped_pages_total"] += 1
            return
        if not self._free_records:
            self.counters["disk_write_dropped_pages_total"] += 1
            return
        assert self._host_kv is not None
        record = self._free_records.pop()
        self.write_buffer.page(record).copy_(self._host_kv[:, :, host_page])
        self._staged.append((page_hash, record, proof))
        self._staged_hashes.add(page_hash)
        self._wake.set()

    async def _write(self, batch: list[tuple[int, int, PageProof]]) -> None:
        hashes = [h for h, _, _ in batch]
        try:
            await self._grow(len(batch))
            reserved = self.index.reserve(hashes)
            self.counters["disk_write_dropped_pages_total"] += len(batch) - len(reserved)
            jobs = []
            for i, slot in reserved:
                self._seq += 1
                jobs.append((slot, batch[i][1], hashes[i], self._seq, batch[i][2]))
            mine = [h for _, _, h, _, _ in jobs]
            try:
                seconds = await self._io(self._writer, self._write_records, jobs)
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

    def _write_records(self, jobs: list[tuple[int, int, int, int, PageProof]]) -> float:
        """On the writer thread: seal each (slot, record, hash, seq, proof) and write them."""
        files = self.files
        assert files is not None
        start = time.perf_counter()
        views = [self.write_buffer.view(record) for _, record, _, _, _ in jobs]
        for view, (_, _, page_hash, seq, proof) in zip(views, jobs):
            seal(view, page_hash, seq, files.digest, files.page_bytes, proof)
        files.write([slot for slot, *_ in jobs], views)
        return time.perf_counter() - start

    async def _grow(self, wanted: int) -> None:
        """Add files while fewer than ``wanted`` slots are free and the bound allows."""
        files = self.files
        assert files is not None
        while self.index.num_free < wanted and not self.full:
            room = (self.bound_bytes - files.size_bytes - files.slab_bytes(0)) // files.record_bytes
            share = -(-self.bound_bytes // _SLABS_PER_BOUND) // files.record_bytes
            num_slots = min(room, max(1, share), _SLAB_MAX_BYTES // files.record_bytes)
            if num_slots < 1:
                return
            try:
                await self._io(self._writer, files.add_slab, num_slots)
            except OSError as exc:
                self.full = True
                logger.warning("%s: the disk tier cannot grow past %.3f GiB in %s (%s); it "
                               "keeps what it has", self.name, files.size_bytes / (1 << 30),
                               self.root, exc)  # fmt: skip
                if not files.slabs:
                    self._fail(f"cannot add a file: {exc}")
                return
            self.index.adopt(num_slots)

    async def flush(self, host: HostPageIndex, timeout_s: float) -> int:
        """Write the host tier's pages the disk lacks, least recently used first (so the
        LRU order survives), within ``timeout_s``: a restart finds them. How many were
        staged."""
        deadline = time.monotonic() + timeout_s
        staged = 0
        for page_hash, page in host.stored_pages():
            while self.up and self.ready and not self._free_records:
                if time.monotonic() >= deadline:
                    return staged
                self._wake.set()
                await asyncio.sleep(0.005)
            if not (self.up and self.ready) or time.monotonic() >= deadline:
                return staged
            before = len(self._staged)
            self.stage(page_hash, page, host.proof(page_hash))
            staged += len(self._staged) - before
        while not self.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # the writer drains what was staged
        return staged

    # -- promotion ------------------------------------------------------------------------

    def run(self, page_hashes: Sequence[int], host: HostPageIndex) -> list[bool]:
        """The leading run of ``page_hashes`` the host tier and this one hold: per page,
        whether it is only on disk."""
        readable = self.up and self.ready
        out = []
        for h in page_hashes:
            if host.stored(h):
                out.append(False)
            elif readable and self.index.stored(h):
                out.append(True)
            else:
                break
        return out

    async def promote(
        self,
        page_hashes: Sequence[int],
        host: HostPageIndex,
        prefill_tokens_per_s: float,
        on_plan: Callable[[list[int], int], Awaitable[None]] | None = None,
        on_ready: Callable[[int, bool], Awaitable[None]] | None = None,
    ) -> set[int]:
        """Read the disk pages of the leading run of ``page_hashes`` into the host tier
        when that is quicker than recomputing them at ``prefill_tokens_per_s`` (0:
        unknown); the hashes that came from disk. With ``on_plan``, the read overlaps
        the worker's when it takes more than one chunk (`_chunk_pages`): once host
        pages are reserved, ``on_plan(run, ready)`` gets the run to lease (host pages
        and pages being read, in order) and how many of it are readable already, then
        the disk pages are read in chunks and after each one ``on_ready(ready,
        failed)`` says how many are readable now (``failed``: the page after them
        failed and the rest of the run never comes). Without a call of ``on_plan``
        the caller leases the run afterwards."""
        if not self.up or not any(await self._settled_run(page_hashes, host)):
            return set()
        async with self._promoting:
            on_disk = self.run(page_hashes, host)  # again: it may have changed meanwhile
            recompute = self._page_size / prefill_tokens_per_s if prefill_tokens_per_s else None
            rate = self.rates["read"]
            read = self.write_buffer.record_bytes / rate if rate else None
            n = promotion_cut(on_disk, read, recompute)
            self.counters["disk_recomputed_pages_total"] += sum(on_disk[n:])
            if not any(on_disk[:n]):
                return set()
            run = _Run(list(page_hashes[:n]), on_disk[:n])
            return await self._read_into(host, run, on_plan, on_ready)

    async def _settled_run(self, page_hashes: Sequence[int], host: HostPageIndex) -> list[bool]:
        """`run`, once the pages of it on their way to disk are written (at most
        `_WRITTEN_WAIT_S`): a page the host tier evicted a moment ago is read back
        once it is on disk, rather than recomputed, and never before."""
        deadline = time.monotonic() + _WRITTEN_WAIT_S
        while True:
            on_disk = self.run(page_hashes, host)
            left = deadline - time.monotonic()
            n = len(on_disk)
            if n == len(page_hashes) or page_hashes[n] not in self._staged_hashes or left <= 0:
                return on_disk
            self._written.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._written.wait(), left)

    async def _read_into(
        self,
        host: HostPageIndex,
        run: _Run,
        on_plan: Callable[[list[int], int], Awaitable[None]] | None,
        on_ready: Callable[[int, bool], Awaitable[None]] | None,
    ) -> set[int]:
        """Read the run's disk pages into newly reserved host pages, holding its host
        pages (and the disk slots) meanwhile; in chunks told to ``on_ready`` when there
        is an ``on_plan`` (see `promote`), else in one go."""
        want = run.disk_hashes
        host_hold, _ = host.hold(_HOLDER, run.host_hashes, math.inf)
        disk_hold, slots = self.index.hold(_HOLDER, want, math.inf)
        reserved = host.reserve(want)  # may evict other host pages (towards the disk)
        jobs = [(slots[j], page, want[j]) for j, page in reserved]
        proofs = {h: self.index.proof(h) for h in want}
        run.cut_at_unreserved({want[j] for j, _ in reserved})
        good: list[int] = []
        bad: list[int] = []
        size = self._chunk_pages(len(jobs)) if on_plan else max(1, len(jobs))
        overlap = on_plan is not None and size < len(jobs)  # one chunk: nothing to overlap
        try:
            if overlap and on_plan is not None:
                self.counters["disk_overlapped_promotions_total"] += 1
                await on_plan(run.hashes, run.ready(set()))
            for first in range(0, len(jobs), size):
                chunk = jobs[first : first + size]
                ok = await self._read_chunk(chunk)
                good += [h for (_, _, h), fine in zip(chunk, ok) if fine]
                bad += [h for (_, _, h), fine in zip(chunk, ok) if not fine]
                mine = [h for (_, _, h), fine in zip(chunk, ok) if fine]
                host.commit(mine, [proofs[h] for h in mine])  # type: ignore[misc]
                if self.events is not None:
                    self.events.stored(MEDIUM_CPU, mine, [proofs[h] for h in mine])
                if overlap and on_ready is not None:
                    await on_ready(run.ready(set(good)), bool(bad))
                if bad:
                    break
        finally:  # (cancelled: the kvstore is stopping; the reader may still fill pages)
            done = set(good)
            host.abort([h for _, _, h in jobs if h not in done])
            host.release(host_hold)
            self.index.release(disk_hold)
            self._count_read(good, bad)
        return set(good)

    def _chunk_pages(self, num_pages: int) -> int:
        """Pages per chunk of an overlapped promotion of ``num_pages``."""
        least = -(-self.chunk_bytes // self.read_buffer.record_bytes)
        return max(1, least, -(-num_pages // _PIPELINE_CHUNKS))

    async def _read_chunk(self, jobs: list[tuple[int, int, int]]) -> list[bool]:
        """Read a chunk of (slot, host page, hash) on the reader thread; per job, whether
        it was valid (a failed read turns the tier off and fails them all)."""
        try:
            ok, seconds = await self._io(self._reader, self._read_records, jobs)
        except Exception as exc:  # OSError, or the tier's own fault: never a request's
            if not isinstance(exc, OSError):
                logger.exception("%s: a disk tier read failed", self.name)
            self._fail(f"a read failed: {exc!r}")
            return [False] * len(jobs)
        self._measure("read", len(jobs) * self.read_buffer.record_bytes, seconds)
        return ok

    def _count_read(self, good: list[int], bad: list[int]) -> None:
        """Count a promotion's reads; drop the pages that failed their check."""
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

    def _read_records(self, jobs: list[tuple[int, int, int]]) -> tuple[list[bool], float]:
        """On the reader thread: read each (slot, host page, hash), check it and copy the
        valid ones into their host pages; whether each was valid, and the seconds."""
        files, kv, buffer = self.files, self._host_kv, self.read_buffer
        assert files is not None and kv is not None
        start = time.perf_counter()
        ok: list[bool] = []
        for first in range(0, len(jobs), buffer.count):
            chunk = jobs[first : first + buffer.count]
            views = [buffer.view(i) for i in range(len(chunk))]
            files.read([slot for slot, _, _ in chunk], views)
            for i, (view, (_, page, page_hash)) in enumerate(zip(views, chunk)):
                valid = check(view, files.digest, files.page_bytes, files.page_size)
                fine = valid is not None and valid[0] == page_hash
                fine = fine and valid[2] == self.index.proof(page_hash)  # type: ignore[index]
                if fine:
                    kv[:, :, page].copy_(buffer.page(i))
                ok.append(fine)
        return ok, time.perf_counter() - start

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
