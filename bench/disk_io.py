"""Micro-benchmark: the I/O paths a disk tier of KV pages could take, on this machine.

A page record is a 4 KiB header and the page's bytes rounded up to 4 KiB (the default
model's 16-token float32 page: 720 KiB). Each path writes ``--mib`` of records and reads
them back *cold* (the file's page-cache pages dropped with ``posix_fadvise(DONTNEED)``
after an ``fdatasync``, so the reads come from the device, as a disk hit hours later
would), in the way the tier would use it:

* ``pwritev batched``: records staged in an aligned buffer, one ``os.pwritev`` per run of
  ``--batch`` consecutive slots of a preallocated (``posix_fallocate``) file; reads one
  ``os.preadv`` per run (what `radixserve.services.kvstore.disk_files` does);
* ``pwrite per page``: the same file, one syscall per record (what batching saves);
* ``O_DIRECT batched``: as the first, with the page cache bypassed;
* ``mmap``: the preallocated file mapped, records copied in and ``msync``-ed, read by
  copying out (page faults);
* ``file per page``: one file per record, written and renamed into place (how a tier of
  one file per block works), read by open/read/close.

Run ``python bench/disk_io.py [--dir DIR] [--mib 512]``; it prints one table (GB/s) and
removes its files.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ALIGN = 4096
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _aligned(nbytes: int) -> mmap.mmap:
    """An anonymous mapping: page-aligned memory, as O_DIRECT needs."""
    return mmap.mmap(-1, nbytes)


def _drop_cache(fd: int) -> None:
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class Case:
    """One I/O path over ``num`` records of ``slot`` bytes in ``root``."""

    def __init__(self, root: Path, slot: int, num: int, batch: int) -> None:
        self.root, self.slot, self.num, self.batch = root, slot, num, batch
        self.buf = _aligned(slot * batch)  # a batch of records, staged contiguously
        self.buf.write(os.urandom(slot * batch))
        self.path = root / "slab.kv"

    def runs(self) -> list[tuple[int, int]]:
        return [(i, min(self.batch, self.num - i)) for i in range(0, self.num, self.batch)]

    def views(self, count: int) -> list[memoryview]:
        view = memoryview(self.buf)
        return [view[k * self.slot : (k + 1) * self.slot] for k in range(count)]

    def prealloc(self, flags: int = 0) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | flags, 0o600)
        os.posix_fallocate(fd, 0, self.slot * self.num)
        return fd

    def batched(self, flags: int) -> tuple[Callable[[], None], Callable[[], None]]:
        fd = self.prealloc(flags)
        per_call = max(1, min(self.batch, IOV_MAX))

        def write() -> None:
            for start, count in self.runs():
                for k in range(0, count, per_call):
                    n = min(per_call, count - k)
                    os.pwritev(fd, self.views(n), (start + k) * self.slot)
            _drop_cache(fd)

        def read() -> None:
            for start, count in self.runs():
                for k in range(0, count, per_call):
                    n = min(per_call, count - k)
                    os.preadv(fd, self.views(n), (start + k) * self.slot)

        return write, read

    def per_page(self) -> tuple[Callable[[], None], Callable[[], None]]:
        fd = self.prealloc()
        one = self.views(1)[0]

        def write() -> None:
            for i in range(self.num):
                os.pwrite(fd, one, i * self.slot)
            _drop_cache(fd)

        def read() -> None:
            for i in range(self.num):
                os.preadv(fd, [one], i * self.slot)

        return write, read

    def mapped(self) -> tuple[Callable[[], None], Callable[[], None]]:
        fd = self.prealloc()
        size, one = self.slot * self.num, self.views(1)[0]

        def write() -> None:
            with mmap.mmap(fd, size) as mm:
                for i in range(self.num):
                    mm[i * self.slot : (i + 1) * self.slot] = one
                mm.flush()
            _drop_cache(fd)  # unmapped first: mapped pages would stay cached

        def read() -> None:
            with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
                for i in range(self.num):
                    one[:] = mm[i * self.slot : (i + 1) * self.slot]

        return write, read

    def files(self) -> tuple[Callable[[], None], Callable[[], None]]:
        folder = self.root / "pages"
        folder.mkdir()
        one = self.views(1)[0]

        def write() -> None:
            for i in range(self.num):
                tmp = folder / f"{i}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.write(fd, one)
                _drop_cache(fd)  # a page file must be durable before it is renamed in
                os.close(fd)
                os.replace(tmp, folder / f"{i}.kv")

        def read() -> None:
            for i in range(self.num):
                fd = os.open(folder / f"{i}.kv", os.O_RDONLY)
                os.readv(fd, [one])
                os.close(fd)

        return write, read


def _time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(root: Path, page_kib: int, mib: int, batch: int, repeats: int) -> list[dict]:
    slot = ALIGN + -(-page_kib * 1024 // ALIGN) * ALIGN
    num = max(batch, mib * (1 << 20) // slot)
    paths: dict[str, Callable[[Case], tuple[Callable[[], None], Callable[[], None]]]] = {
        "pwritev batched": lambda c: c.batched(0),
        "pwrite per page": lambda c: c.per_page(),
        "O_DIRECT batched": lambda c: c.batched(getattr(os, "O_DIRECT", 0)),
        "mmap": lambda c: c.mapped(),
        "file per page": lambda c: c.files(),
    }
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in paths}
    for _ in range(repeats):  # the paths take turns, so a busy spell hits every one
        for name, make in paths.items():
            folder = Path(tempfile.mkdtemp(dir=root, prefix="disk-io-"))
            try:
                write, read = make(Case(folder, slot, num, batch))
                write_s = _time(write)
                times[name][1].append(_time(read))
                times[name][0].append(write_s)
            except OSError as exc:  # e.g. O_DIRECT on a filesystem without it (tmpfs)
                print(f"  {name}: {exc}", file=sys.stderr)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    total = slot * num / 1e9
    rows = []
    for name, (writes, reads) in times.items():
        if writes and reads:
            rows.append({"path": name, "write_gb_s": total / statistics.median(writes),
                         "read_gb_s": total / statistics.median(reads)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write")
    parser.add_argument("--mib", type=int, default=512, help="bytes written per path")
    parser.add_argument("--page-kib", type=int, default=720, help="page bytes (KiB)")
    parser.add_argument("--batch", type=int, default=16, help="records per write")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = measure(Path(args.dir), args.page_kib, args.mib, args.batch, args.repeats)
    print(f"| path ({args.page_kib} KiB pages, {args.mib} MiB, batches of {args.batch}) "
          "| write GB/s | cold read GB/s |")  # fmt: skip
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['path']} | {row['write_gb_s']:.2f} | {row['read_gb_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
