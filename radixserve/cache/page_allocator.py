"""Reference-counted allocator of KV page ids, which keeps a sequence's pages in runs.

The KV pool is a fixed array of ``num_pages`` pages; this module only hands out their
ids and counts who holds them. Every holder of a page holds exactly one reference:
a running request holds one on each page of its sequence, the radix cache holds one on
each page it owns. A page returns to the free pages when its last reference is dropped.

A page with refcount 0 is either open or reserved. An allocation made for an ``owner``
(a request) can reserve the ``spare`` pages that follow it; the owner's next allocations
take those first, so a sequence that grows a page at a time (a decode) still gets
consecutive page ids, which the CPU decode attention reads in place as one view. A
reservation is soft: reserved pages count as free (`num_free`; admission and the
``pages_free`` gauge see them so), and when the open pages run out any allocation takes
reserved ones, from the end of other owners' reservations. `release` returns what is
left of an owner's reservation (the scheduler calls it on finish, abort and preemption).

    refcounts: [ 1 | 1 | 0 | 0 | 1 | 0 | 0 | 0 ]      page id = index
    open:      [ . | . | . | . | . | x | x | x ]      reserved for "req-1": [2, 4)
    alloc(1, owner="req-1") hands out [2] (its reservation); alloc(2) hands out [5, 6]

An allocation with no reservation to use takes the lowest run of open pages long enough
for it and its spare (right after the owner's last page when those are open), else the
lowest open run for it alone, else the lowest open pages one by one, then reserved ones.
Finding a run is one search of a byte per page (C speed); the rest is O(1) per page.
Not thread-safe: one engine thread drives it.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Sequence

logger = logging.getLogger(__name__)

_OPEN, _TAKEN = 1, 0  # a byte per page in `_open`


class OutOfPagesError(RuntimeError):
    """Fewer free pages than requested; nothing was allocated."""


class PageAllocator:
    """Hands out page ids ``0..num_pages-1`` and tracks a reference count per page.

    Contracts:
    - ``alloc`` returns distinct free pages, each with refcount 1, lowest ids first on a
      fresh allocator; it is all-or-nothing, and succeeds whenever ``n <= num_free``
      (reservations never make it fail).
    - ``incref`` and ``decref`` only accept pages that are currently allocated; a
      ``decref`` of a free page (double free) raises and leaves every count unchanged.
    - An owner's reservation is pages ``[next, end)`` following the last page it was
      given; ``release(owner)`` makes them open again.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self._refcounts: list[int] = [0] * num_pages
        self._open = bytearray([_OPEN]) * num_pages  # free and not reserved
        self._num_open = num_pages
        # owner -> [next, end): its reserved pages; empty once used up, then `next` is
        # where its pages would continue
        self._reservations: dict[Hashable, list[int]] = {}
        self._num_reserved = 0
        self._num_refs = 0  # sum of the refcounts

    @property
    def num_pages(self) -> int:
        """Size of the pool."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages with refcount 0, reserved ones included."""
        return self._num_open + self._num_reserved

    @property
    def num_used(self) -> int:
        """Pages with refcount >= 1."""
        return self._num_pages - self.num_free

    @property
    def num_reserved(self) -> int:
        """Free pages reserved for an owner's next allocations."""
        return self._num_reserved

    @property
    def num_refs(self) -> int:
        """References held on all pages together (the sum of the refcounts). O(1)."""
        return self._num_refs

    def alloc(self, n: int, owner: Hashable | None = None, spare: int = 0) -> list[int]:
        """Take ``n`` free pages, each with refcount 1, in the order they are to be used.

        With an ``owner``, its reservation is used first, and when more pages are taken
        up to ``spare`` open pages right after them are reserved for it. Raises
        ``OutOfPagesError`` (allocating nothing) if fewer than ``n`` are free.
        """
        if n < 0 or spare < 0:
            raise ValueError(f"cannot allocate a negative number of pages: {n}, spare {spare}")
        if n > self.num_free:
            raise OutOfPagesError(f"asked for {n} pages, only {self.num_free} free")
        if n == 0:
            return []
        pages = self._take_reserved(owner, n) if owner is not None else []
        if len(pages) < n:
            pages += self._take_open(n - len(pages), owner, spare if owner is not None else 0)
        refcounts = self._refcounts
        for page in pages:
            refcounts[page] = 1
        self._num_refs += n
        return pages

    def release(self, owner: Hashable) -> int:
        """Return ``owner``'s reserved pages to the open ones; how many there were."""
        run = self._reservations.pop(owner, None)
        if run is None:
            return 0
        start, end = run
        self._open[start:end] = bytes([_OPEN]) * (end - start)
        self._num_open += end - start
        self._num_reserved -= end - start
        return end - start

    def incref(self, page_ids: Iterable[int]) -> None:
        """Add one reference to each page (a page listed twice gains two).

        Every page must be allocated; otherwise raises ``ValueError`` and changes nothing.
        """
        pages = list(page_ids)
        for page in pages:
            self._check_allocated(page)
        refcounts = self._refcounts
        for page in pages:
            refcounts[page] += 1
        self._num_refs += len(pages)

    def decref(self, page_ids: Iterable[int]) -> int:
        """Drop one reference from each page; pages reaching 0 become open.

        Returns the number of pages freed. Dropping a reference the pages do not have
        (a double free, or a page listed more often than it is referenced) raises
        ``ValueError`` and leaves the allocator exactly as it was.
        """
        pages = list(page_ids)
        refcounts = self._refcounts
        freed = 0
        for done, page in enumerate(pages):
            if not 0 <= page < self._num_pages or refcounts[page] <= 0:
                self._undo_decref(pages[:done])
                raise ValueError(f"decref of page {page}, which is not allocated (double free?)")
            refcounts[page] -= 1
            if refcounts[page] == 0:
                self._open[page] = _OPEN
                self._num_open += 1
                freed += 1
        self._num_refs -= len(pages)
        return freed

    def refcount(self, page_id: int) -> int:
        """Current number of references on ``page_id`` (0 when free)."""
        self._check_id(page_id)
        return self._refcounts[page_id]

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless the open pages, the reservations and the
        refcounts agree. Does not change any state. O(num_pages)."""
        refcounts = self._refcounts
        if any(count < 0 for count in refcounts):
            raise AssertionError("negative refcount")
        reserved = bytearray(self._num_pages)
        for owner, (start, end) in self._reservations.items():
            if not 0 <= start <= end <= self._num_pages:
                raise AssertionError(f"reservation of {owner!r} out of range: [{start}, {end})")
            for page in range(start, end):
                if reserved[page] or self._open[page] == _OPEN or refcounts[page]:
                    raise AssertionError(f"reserved page {page} is shared, open or held")
                reserved[page] = 1
        if sum(reserved) != self._num_reserved:
            raise AssertionError(f"{sum(reserved)} pages reserved, counter {self._num_reserved}")
        open_pages = [page for page in range(self._num_pages) if self._open[page] == _OPEN]
        if any(refcounts[page] for page in open_pages):
            raise AssertionError("an open page has a reference")
        if len(open_pages) != self._num_open:
            raise AssertionError(f"{len(open_pages)} pages open, counter {self._num_open}")
        num_zero = sum(1 for count in refcounts if count == 0)
        if num_zero != self.num_free:
            raise AssertionError(f"{num_zero} pages have refcount 0 but {self.num_free} are free")
        if sum(refcounts) != self._num_refs:
            raise AssertionError(f"refcounts sum to {sum(refcounts)}, counter {self._num_refs}")

    # -- placing pages ----------------------------------------------------------------

    def _take_reserved(self, owner: Hashable, n: int) -> list[int]:
        """Up to ``n`` pages from the front of ``owner``'s reservation."""
        run = self._reservations.get(owner)
        if run is None:
            return []
        start = run[0]
        count = min(n, run[1] - start)
        run[0] += count
        self._num_reserved -= count
        return list(range(start, start + count))

    def _take_open(self, n: int, owner: Hashable | None, spare: int) -> list[int]:
        """``n`` pages, open ones first, in one run where one is open (then up to
        ``spare`` more after it reserved for ``owner``), else piece by piece."""
        start, length = self._find_run(n, self._continuation(owner), n + spare)
        if start < 0:
            return self._take_scattered(n, owner)
        self._open[start : start + length] = bytes(length)
        self._num_open -= length
        if length > n:
            assert owner is not None
            self._reservations[owner] = [start + n, start + length]  # the spare: reserved
            self._num_reserved += length - n
        elif owner is not None:
            self._reservations[owner] = [start + n, start + n]
        return list(range(start, start + n))

    def _continuation(self, owner: Hashable | None) -> int | None:
        """The page right after ``owner``'s last one (its used-up reservation's end)."""
        run = self._reservations.get(owner) if owner is not None else None
        return run[1] if run is not None and run[1] < self._num_pages else None

    def _find_run(self, n: int, after: int | None, want: int) -> tuple[int, int]:
        """(start, length) of open pages to take: length in [n, want], starting at
        ``after`` if n pages are open there, else the lowest run of ``want``, else the
        lowest of ``n``; (-1, 0) when no n open pages are consecutive."""
        if after is not None and self._open[after] == _OPEN:
            stop = self._open.find(_TAKEN, after, after + want)
            length = (after + want if stop < 0 else stop) - after
            length = min(length, self._num_pages - after)
            if length >= n:
                return after, length
        for size in (want, n) if want > n else (n,):
            start = self._open.find(bytes([_OPEN]) * size)
            if start >= 0:
                return start, size
        return -1, 0

    def _take_scattered(self, n: int, owner: Hashable | None) -> list[int]:
        """``n`` pages when no run is open: the lowest open pages, then reserved ones."""
        pages: list[int] = []
        page = self._open.find(_OPEN)
        while page >= 0 and len(pages) < n:
            pages.append(page)
            page = self._open.find(_OPEN, page + 1)
        for page in pages:
            self._open[page] = _TAKEN
        self._num_open -= len(pages)
        if len(pages) < n:
            pages += self._take_from_reservations(n - len(pages))
        if owner is not None:
            self._reservations.pop(owner, None)
            self._reservations[owner] = [pages[-1] + 1, pages[-1] + 1]
        return pages

    def _take_from_reservations(self, n: int) -> list[int]:
        """``n`` reserved pages, from the end of each reservation in turn, so every owner
        keeps the pages that continue its run longest."""
        pages: list[int] = []
        for run in self._reservations.values():
            count = min(n - len(pages), run[1] - run[0])
            pages.extend(range(run[1] - count, run[1]))
            run[1] -= count
            if len(pages) == n:
                break
        self._num_reserved -= len(pages)
        logger.debug("took %d reserved pages: the pool has no other free ones", len(pages))
        return pages

    def _undo_decref(self, pages: Sequence[int]) -> None:
        """Revert a partial ``decref`` of ``pages``."""
        for page in pages:
            if self._refcounts[page] == 0:
                self._open[page] = _TAKEN
                self._num_open -= 1
            self._refcounts[page] += 1

    def _check_id(self, page_id: int) -> None:
        if not 0 <= page_id < self._num_pages:
            raise ValueError(f"page id {page_id} out of range [0, {self._num_pages})")

    def _check_allocated(self, page_id: int) -> None:
        self._check_id(page_id)
        if self._refcounts[page_id] <= 0:
            raise ValueError(f"page {page_id} is free; only allocated pages can be referenced")
