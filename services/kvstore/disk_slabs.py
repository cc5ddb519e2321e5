"""The disk tier's slabs: those found at a restart adopted, more added as pages arrive.

**Restart** (`adopt_files`): at the kvstore's start (`DiskPool.prepare`, for the layout of the newest slab) and when
the first worker attaches with another layout (other weights, quantization or dtype:
another `PoolCompat.digest`; the pages adopted at start are let go), every slab of the
layout is read and each record checked (`SlabFiles.scan`); the valid ones whose tokens
give their hash (`PageProof`) are adopted in their old LRU order (their write sequence
numbers), the rest counted (``disk_corrupt_pages_total``, ``kv_identity_mismatch_total``).
Slabs of another model identity or layout are left alone (never served) and their
records counted (``disk_foreign_pages``); ``disk_reclaim_others`` removes them instead.
A slab past the tier's bound is removed. The kvstore is not ready until this is done
(`DiskPool.loaded`); writes start once a worker's layout is known and adopted.

**Growth** (`grow`): the bound is allocated in eighths as pages arrive (slabs of at most
1 GiB); a slab that cannot be added (disk full, quota) stops the tier growing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from radixserve.cache.disk_index import DiskPageIndex
from radixserve.cache.page_proof import PageProof
from radixserve.services.kvstore.disk_files import RecordBuffer, SlabFiles, count_records

logger = logging.getLogger(__name__)

_SLAB_MAX_BYTES = 1 << 30
_SLABS_PER_BOUND = 8  # the bound is allocated in eighths, as pages arrive

#: runs a call on one of the tier's I/O threads
IO = Callable[..., Awaitable[Any]]


@dataclass
class Adopted:
    """What a rebuild found besides the pages it adopted."""

    last_seq: int  # the newest write sequence number: writes go on after it
    corrupt: int  # torn or corrupt records
    mismatched: int  # records whose tokens do not give their hash
    foreign: int  # records of another model identity or layout


async def adopt_files(
    name: str,
    files: SlabFiles,
    index: DiskPageIndex,
    buffer: RecordBuffer,
    bound_bytes: int,
    reclaim_others: bool,
    io: tuple[IO, IO],
    measure: Callable[[int, float], None],
) -> Adopted:
    """Adopt into ``index`` the valid pages of ``files``' slabs (read through ``buffer``
    on ``io``'s reader, removing on its writer; ``measure(bytes, seconds)`` of each
    scan), within ``bound_bytes``."""
    read, write = io
    root = files.root
    await write(lambda: root.mkdir(parents=True, exist_ok=True))
    ours, others = await read(files.listing)
    if reclaim_others and others:
        for path in others:
            logger.warning("%s: %s holds pages of another model identity or layout; "
                           "removed (disk_reclaim_others)", name, path)  # fmt: skip
            await write(path.unlink)
        others = []
    found = Adopted(0, 0, 0, await read(lambda: sum(count_records(p) for p in others)))
    written: dict[int, int] = {}  # hash -> write sequence
    for path in ours:
        if files.size_bytes + path.stat().st_size > bound_bytes:
            logger.warning("%s: %s lies past the disk tier's bound; removed", name, path)
            await write(path.unlink)
            continue
        try:
            slab = await read(files.open_slab, path)
        except ValueError as exc:
            logger.warning("%s: %s is not a slab of this tier (%s); left alone", name, path, exc)
            continue
        scan = await read(files.scan, slab, buffer)
        measure(slab.num_slots * files.record_bytes, scan.seconds)
        keep: dict[int, tuple[int, int, PageProof]] = {}  # hash -> the newest copy
        for page_hash, slot, seq, proof in scan.found:
            if not proof.verifies(page_hash):  # its tokens do not give its hash
                found.mismatched += 1
                continue
            if seq > written.get(page_hash, -1) and seq > keep.get(page_hash, (-1,))[0]:
                keep[page_hash] = (seq, slot, proof)
        index.drop(h for h in keep if h in written)  # an older copy, in a slab before
        newest = sorted(keep.items(), key=lambda item: item[1][0])
        index.adopt(slab.num_slots, [(h, slot) for h, (_, slot, _) in newest],
                    [proof for _, (_, _, proof) in newest])  # fmt: skip
        written.update((h, seq) for h, (seq, _, _) in newest)
        found.corrupt += scan.corrupt
    index.reorder(written)
    found.last_seq = max(written.values(), default=0)
    logger.info("%s: disk tier in %s: %d pages found in %d files (%d torn or corrupt, "
                "dropped; %d whose tokens do not prove their hash, dropped; %d of another "
                "model identity or layout, left alone)", name, root, index.num_stored,
                len(files.slabs), found.corrupt, found.mismatched, found.foreign)  # fmt: skip
    return found


async def grow(
    name: str, files: SlabFiles, index: DiskPageIndex, wanted: int, bound_bytes: int, write: IO
) -> OSError | None:
    """Add slabs (on ``write``'s thread) while ``index`` has fewer than ``wanted`` free
    slots and ``bound_bytes`` allows; the error that stopped it, if one did."""
    while index.num_free < wanted:
        room = (bound_bytes - files.size_bytes - files.slab_bytes(0)) // files.record_bytes
        share = -(-bound_bytes // _SLABS_PER_BOUND) // files.record_bytes
        num_slots = min(room, max(1, share), _SLAB_MAX_BYTES // files.record_bytes)
        if num_slots < 1:
            return None
        try:
            await write(files.add_slab, num_slots)
        except OSError as exc:
            logger.warning("%s: the disk tier cannot grow past %.3f GiB in %s (%s); it keeps "
                           "what it has", name, files.size_bytes / (1 << 30), files.root, exc)  # fmt: skip
            return exc
        index.adopt(num_slots)
    return None
