"""The disk tier's files: preallocated slabs of page records, read and written in batches.

A slab is one file, ``slab-<layout>-<n>.kv`` (``<layout>``: the first 16 hex digits of
the pool's `PoolCompat.digest`, which covers the model's identity, dtype and page shape)::

    0      slab header, 4 KiB: magic, version, slot bytes, slots, page bytes, the PoolCompat
    4 KiB  slot 0: record header (4 KiB aligned) | page bytes, zero-padded to 4 KiB
    ...    slot 1, 2, ... (every slot the same size, ``record_bytes(page_bytes, page_size)``)

A record header holds the page's chained hash (16 bytes), its write sequence number (the
LRU order after a restart), the page bytes, the layout digest (the pool's identity), the
page's proof (`PageProof`: namespace, parent hash, its tokens as u32 each) and a CRC-32
over the header (its own field zeroed) and the page. A slot is *valid* only when all of
them agree, so a record torn by a crash or flipped on the disk is found on read and never
served; a slot never written is all zeros (the file is preallocated) and counts as empty.
Whether the hash is the one its proof gives is the disk pool's check (`PageProof.verifies`).

**The I/O path**, measured with ``bench/disk_io.py`` (bench/README.md): records are
staged in page-aligned host memory (`RecordBuffer`) and written with one ``os.pwritev``
per run of consecutive slots, ``O_DIRECT``, into files ``posix_fallocate``-d when
they are added; reads are one ``os.preadv`` per run. On this project's machines
``O_DIRECT`` writes were the fastest and steadiest (buffered ones copy through the page
cache on cores the model also uses, and swung 5x with the load), reads matched cold
buffered ones, and the page cache keeps no second, unaccounted copy of what the host
tier evicted. ``mmap`` reads fastest but writes slowest (a fault per 4 KiB) and turns
an I/O error into SIGBUS; a file per page costs a create, a rename and an fsync per page. A filesystem that refuses ``O_DIRECT`` (tmpfs)
gets the same calls on the page cache (``direct`` False).

Everything here is synchronous and runs on the disk pool's I/O threads.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import struct
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.cache.block_hash import HASH_BYTES
from radixserve.cache.page_proof import PageProof
from radixserve.transfer import PoolCompat

logger = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT's alignment of memory, offsets and lengths (a logical block)
HEADER_BYTES = ALIGN  # a slab's header and each record's
FORMAT_VERSION = 2
SLAB_MAGIC = b"RXKVSLAB"
RECORD_MAGIC = b"RXKVPAGE"
# magic, version, slot bytes, slots, page bytes, compat JSON bytes (the JSON follows)
_SLAB = struct.Struct("<8sIQQQI")
# magic, version, crc32, write sequence, page bytes, page hash, layout digest (sha256),
# namespace, has a parent, parent hash, tokens (u32 LE each, after the struct)
_RECORD = struct.Struct(f"<8sIIQQ{HASH_BYTES}s32s32sB{HASH_BYTES}sI")
_CRC_AT = 12  # offset of the crc32 field in a record header
_NAMESPACE_BYTES = 32
_IOV_MAX = 1024  # POSIX's minimum for IOV_MAX, Linux's value


def record_header_bytes(page_size: int) -> int:
    """A record's header for pages of ``page_size`` tokens, aligned."""
    return -(-(_RECORD.size + 4 * page_size) // ALIGN) * ALIGN


def record_bytes(page_bytes: int, page_size: int) -> int:
    """The size of a slot holding a page of ``page_bytes`` (``page_size`` tokens): a
    header and the page, aligned."""
    return record_header_bytes(page_size) + -(-page_bytes // ALIGN) * ALIGN


def slab_prefix(compat: PoolCompat) -> str:
    return f"slab-{compat.digest[:16]}-"


class RecordBuffer:
    """Page-aligned host memory for ``count`` records, seen as bytes and as pages.

    An anonymous mapping is page-aligned, as ``O_DIRECT`` needs; a record's page is a
    tensor view of the pool's page shape, so copies to and from the host pool are one
    torch copy each."""

    def __init__(self, count: int, compat: PoolCompat) -> None:
        self.count, self.page_bytes = count, compat.page_bytes
        self.header_bytes = record_header_bytes(compat.page_size)
        self.record_bytes = record_bytes(compat.page_bytes, compat.page_size)
        self._map = mmap.mmap(-1, count * self.record_bytes)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self.records = raw.view(count, self.record_bytes)  # (records, record bytes)
        # (L, 2, S, H, D): one page of the pool (L, 2, P, S, H, D) without its page axis
        self.page_shape = (compat.num_layers, 2, compat.page_size, compat.num_kv_heads,
                           compat.head_dim)  # fmt: skip
        self._dtype = getattr(torch, compat.dtype)

    def page(self, i: int) -> torch.Tensor:
        """Record ``i``'s page bytes as a (L, 2, S, H, D) tensor of the pool's dtype."""
        body = self.records[i, self.header_bytes : self.header_bytes + self.page_bytes]
        return body.view(self._dtype).view(self.page_shape)

    def view(self, i: int) -> memoryview:
        return memoryview(self._map)[i * self.record_bytes : (i + 1) * self.record_bytes]


def seal(
    record: memoryview, page_hash: int, seq: int, digest: bytes, page_bytes: int, proof: PageProof
) -> None:
    """Write the header of the record whose page is in place: after this it is valid.
    ValueError if the proof does not fit the record (another namespace size)."""
    if len(proof.namespace) != _NAMESPACE_BYTES:
        raise ValueError(f"a namespace of {len(proof.namespace)} bytes, not {_NAMESPACE_BYTES}")
    parent = b"" if proof.parent is None else proof.parent.to_bytes(HASH_BYTES, "big")
    _RECORD.pack_into(record, 0, RECORD_MAGIC, FORMAT_VERSION, 0, seq, page_bytes,
                      page_hash.to_bytes(HASH_BYTES, "big"), digest, proof.namespace,
                      proof.parent is not None, parent, len(proof.tokens) // 4)  # fmt: skip
    record[_RECORD.size : _RECORD.size + len(proof.tokens)] = proof.tokens
    struct.pack_into("<I", record, _CRC_AT, _crc(record, page_bytes, len(proof.tokens)))


def _crc(record: memoryview, page_bytes: int, token_bytes: int) -> int:
    header = -(-(_RECORD.size + token_bytes) // ALIGN) * ALIGN
    crc = zlib.crc32(record[:_CRC_AT])
    crc = zlib.crc32(b"\0\0\0\0", crc)
    crc = zlib.crc32(record[_CRC_AT + 4 : _RECORD.size + token_bytes], crc)
    return zlib.crc32(record[header : header + page_bytes], crc)


def check(
    record: memoryview, digest: bytes, page_bytes: int, page_size: int
) -> tuple[int, int, PageProof] | None:
    """(page hash, write sequence, proof) of a valid record; None if it is torn, corrupt
    or of another layout."""
    (magic, version, crc, seq, size, page_hash, layout, namespace, has_parent, parent,
     num_tokens) = _RECORD.unpack_from(record, 0)  # fmt: skip
    if (magic, version, size, layout, num_tokens) != (
        RECORD_MAGIC, FORMAT_VERSION, page_bytes, digest, page_size
    ):  # fmt: skip
        return None
    if crc != _crc(record, page_bytes, 4 * num_tokens):
        return None
    tokens = bytes(record[_RECORD.size : _RECORD.size + 4 * num_tokens])
    proof = PageProof(namespace, int.from_bytes(parent, "big") if has_parent else None, tokens)
    return int.from_bytes(page_hash, "big"), seq, proof


def empty(record: memoryview) -> bool:
    """A slot never written: its header is zeros (the file was preallocated)."""
    return not any(record[: _RECORD.size])


@dataclass
class ScanResult:
    """What a slab holds: valid records as (page hash, slot in the file, write sequence,
    proof), and how many slots were torn or corrupt."""

    found: list[tuple[int, int, int, PageProof]]
    corrupt: int = 0
    seconds: float = 0.0


@dataclass
class Slab:
    """One open slab file: slots ``first`` .. ``first + num_slots - 1`` of the tier."""

    path: Path
    fd: int
    first: int
    num_slots: int


class SlabFiles:
    """The slabs of one pool layout in ``root``: open, add, write and read records."""

    def __init__(self, root: Path, compat: PoolCompat, direct: bool = True) -> None:
        self.root, self.compat = root, compat
        self.digest = bytes.fromhex(compat.digest)
        self.page_bytes, self.page_size = compat.page_bytes, compat.page_size
        self.record_bytes = record_bytes(compat.page_bytes, compat.page_size)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.slabs: list[Slab] = []
        self._next_number = 0

    @property
    def num_slots(self) -> int:
        return sum(slab.num_slots for slab in self.slabs)

    def slab_bytes(self, num_slots: int) -> int:
        return HEADER_BYTES + num_slots * self.record_bytes

    @property
    def size_bytes(self) -> int:
        return sum(self.slab_bytes(slab.num_slots) for slab in self.slabs)

    def close(self) -> None:
        for slab in self.slabs:
            os.close(slab.fd)
        self.slabs.clear()

    # -- files --------------------------------------------------------------------------

    def listing(self) -> tuple[list[Path], list[Path]]:
        """(this layout's slabs in number order, other layouts' slabs) in ``root``."""
        ours: list[Path] = []
        others: list[Path] = []
        prefix = slab_prefix(self.compat)
        for path in sorted(self.root.glob("slab-*.kv")):
            (ours if path.name.startswith(prefix) else others).append(path)
        numbers = [
            int(p.stem.rsplit("-", 1)[1]) for p in ours if p.stem.rsplit("-", 1)[1].isdigit()
        ]
        self._next_number = max(numbers, default=-1) + 1
        return ours, others

    def open_slab(self, path: Path) -> Slab:
        """Open an existing slab of this layout; ValueError if its header says otherwise."""
        fd = self._open(path, os.O_RDWR)
        try:
            header = RecordBuffer(1, self.compat).view(0)[:HEADER_BYTES]
            if os.preadv(fd, [header], 0) != HEADER_BYTES:
                raise ValueError("no slab header")
            magic, version, slot_bytes, num_slots, page_bytes, json_len = _SLAB.unpack_from(header)
            found = header[_SLAB.size : _SLAB.size + json_len]
            if (magic, version) != (SLAB_MAGIC, FORMAT_VERSION):
                raise ValueError("not a slab of this format")
            compat = PoolCompat.from_dict(json.loads(bytes(found)))
            if compat != self.compat or slot_bytes != self.record_bytes:
                raise ValueError("; ".join(self.compat.mismatches(compat)) or "another layout")
            if os.fstat(fd).st_size < self.slab_bytes(num_slots):
                raise ValueError("shorter than its header says")
        except (ValueError, KeyError, TypeError, struct.error, json.JSONDecodeError):
            os.close(fd)
            raise
        slab = Slab(path, fd, self.num_slots, num_slots)
        self.slabs.append(slab)
        return slab

    def add_slab(self, num_slots: int) -> Slab:
        """Create and preallocate a slab of ``num_slots`` empty slots (OSError when the
        disk is full or the directory unwritable: nothing is left behind)."""
        path = self.root / f"{slab_prefix(self.compat)}{self._next_number:05d}.kv"
        self._next_number += 1
        fd = self._open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            os.posix_fallocate(fd, 0, self.slab_bytes(num_slots))
            header = RecordBuffer(1, self.compat).view(0)[:HEADER_BYTES]
            text = json.dumps(self.compat.to_dict(), sort_keys=True).encode()
            _SLAB.pack_into(header, 0, SLAB_MAGIC, FORMAT_VERSION, self.record_bytes,
                            num_slots, self.page_bytes, len(text))  # fmt: skip
            header[_SLAB.size : _SLAB.size + len(text)] = text
            _write_fully(fd, [header], 0)
            os.fsync(fd)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        slab = Slab(path, fd, self.num_slots, num_slots)
        self.slabs.append(slab)
        return slab

    def _open(self, path: Path, flags: int) -> int:
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                logger.warning("%s: the filesystem refuses O_DIRECT; the disk tier goes "
                               "through the page cache", self.root)  # fmt: skip
                self.direct = False
        return os.open(path, flags, 0o600)

    def scan(self, slab: Slab, buffer: RecordBuffer) -> ScanResult:
        """Read every slot of ``slab`` (through ``buffer``, a chunk at a time) and check it."""
        result = ScanResult([])
        start = time.perf_counter()
        for first in range(0, slab.num_slots, buffer.count):
            count = min(buffer.count, slab.num_slots - first)
            views = [buffer.view(i) for i in range(count)]
            self.read([slab.first + first + i for i in range(count)], views)
            for i, view in enumerate(views):
                if empty(view):
                    continue
                valid = check(view, self.digest, self.page_bytes, self.page_size)
                if valid is None:
                    result.corrupt += 1
                else:
                    result.found.append((valid[0], first + i, valid[1], valid[2]))
        result.seconds = time.perf_counter() - start
        return result

    # -- records ------------------------------------------------------------------------

    def write(self, slots: Sequence[int], records: Sequence[memoryview]) -> None:
        """Write each record to its slot, one pwritev per run of consecutive slots."""
        for fd, offset, views in self._runs(slots, records):
            _write_fully(fd, views, offset)

    def read(self, slots: Sequence[int], records: Sequence[memoryview]) -> None:
        """Read each slot into its record; a slot past a file's end reads as zeros."""
        for fd, offset, views in self._runs(slots, records):
            got = os.preadv(fd, views, offset)
            for view in views:  # a short read (a truncated file): the rest is empty
                if got < len(view):
                    view[max(got, 0) :] = bytes(len(view) - max(got, 0))
                got -= len(view)

    def _runs(
        self, slots: Sequence[int], records: Sequence[memoryview]
    ) -> Iterator[tuple[int, int, list[memoryview]]]:
        """(fd, offset, records) per run of consecutive slots of one file, in slot order."""
        runs: list[tuple[Slab, int, list[memoryview]]] = []
        for slot, record in sorted(zip(slots, records), key=lambda pair: pair[0]):
            slab = self._slab_of(slot)
            if runs:
                last, start, views = runs[-1]
                if last is slab and slot == start + len(views) and len(views) < _IOV_MAX:
                    views.append(record)
                    continue
            runs.append((slab, slot, [record]))
        for slab, start, views in runs:
            yield slab.fd, self._offset(slab, start), views

    def _slab_of(self, slot: int) -> Slab:
        for slab in self.slabs:
            if slab.first <= slot < slab.first + slab.num_slots:
                return slab
        raise IndexError(f"disk slot {slot} is in no slab")

    def _offset(self, slab: Slab, slot: int) -> int:
        return HEADER_BYTES + (slot - slab.first) * self.record_bytes


def write_records(
    files: SlabFiles, buffer: RecordBuffer, jobs: list[tuple[int, int, int, int, PageProof]]
) -> float:
    """Seal each (slot, record of ``buffer``, hash, seq, proof) and write them; seconds."""
    start = time.perf_counter()
    views = [buffer.view(record) for _, record, _, _, _ in jobs]
    for view, (_, _, page_hash, seq, proof) in zip(views, jobs):
        seal(view, page_hash, seq, files.digest, files.page_bytes, proof)
    files.write([slot for slot, *_ in jobs], views)
    return time.perf_counter() - start


def read_records(
    files: SlabFiles,
    buffer: RecordBuffer,
    kv: torch.Tensor,
    jobs: Sequence[tuple[int, int, int, PageProof | None]],
) -> tuple[list[bool], float]:
    """Read each (slot, page of ``kv`` (L, 2, P, S, H, D), hash, proof) through
    ``buffer``, check it and copy the valid ones (the hash and proof theirs) into their
    pages; whether each was valid, and the seconds."""
    start = time.perf_counter()
    ok: list[bool] = []
    for first in range(0, len(jobs), buffer.count):
        chunk = jobs[first : first + buffer.count]
        views = [buffer.view(i) for i in range(len(chunk))]
        files.read([slot for slot, _, _, _ in chunk], views)
        for i, (view, (_, page, page_hash, proof)) in enumerate(zip(views, chunk)):
            valid = check(view, files.digest, files.page_bytes, files.page_size)
            fine = valid is not None and valid[0] == page_hash and valid[2] == proof
            if fine:
                kv[:, :, page].copy_(buffer.page(i))
            ok.append(fine)
    return ok, time.perf_counter() - start


def slab_layout(path: Path) -> PoolCompat | None:
    """The layout (`PoolCompat`) a slab's header states; None if it is not a slab of
    this format."""
    try:
        with open(path, "rb", buffering=0) as f:
            header = f.read(HEADER_BYTES)
        magic, version, _, _, _, json_len = _SLAB.unpack_from(header)
        if (magic, version) != (SLAB_MAGIC, FORMAT_VERSION):
            return None
        return PoolCompat.from_dict(json.loads(header[_SLAB.size : _SLAB.size + json_len]))
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def newest_layout(root: Path) -> PoolCompat | None:
    """The layout of the most recently written slab in ``root`` (what a restart adopts
    before a worker says which layout it has); None when there is none."""
    if not root.is_dir():
        return None
    paths = sorted(root.glob("slab-*.kv"), key=lambda p: p.stat().st_mtime, reverse=True)
    return next((c for c in map(slab_layout, paths) if c is not None), None)


def count_records(path: Path) -> int:
    """Records written in a slab of another layout (not read further: only counted)."""
    with open(path, "rb", buffering=0) as f:
        header = f.read(HEADER_BYTES)
        if len(header) < _SLAB.size:
            return 0
        magic, _, slot_bytes, num_slots, _, _ = _SLAB.unpack_from(header)
        if magic != SLAB_MAGIC or slot_bytes < HEADER_BYTES:
            return 0
        count = 0
        for k in range(num_slots):
            f.seek(HEADER_BYTES + k * slot_bytes)
            count += not empty(memoryview(f.read(_RECORD.size)).cast("B"))
        return count


def _write_fully(fd: int, views: list[memoryview], offset: int) -> None:
    expected = sum(len(v) for v in views)
    written = os.pwritev(fd, views, offset)
    if written != expected:  # a regular file writes all or fails; never serve a part
        raise OSError(errno.EIO, f"short write: {written} of {expected} bytes")
