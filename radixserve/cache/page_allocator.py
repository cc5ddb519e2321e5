"""Reference-counted allocator of KV page ids.

The KV pool is a fixed array of ``num_pages`` pages; this module only hands out their
ids and counts who holds them. Every holder of a page holds exactly one reference:
a running request holds one on each page of its sequence, the radix cache holds one on
each page it owns. A page returns to the free list when its last reference is dropped.

    refcounts: [ 2 | 1 | 0 | 1 | 0 | 0 ]      page id = index
    free list (stack, top on the right): [5, 4, 2]  -> alloc(2) hands out [2, 4]

All operations cost O(1) per page id. Not thread-safe: one engine thread drives it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

logger = logging.getLogger(__name__)


class OutOfPagesError(RuntimeError):
    """Fewer free pages than requested; nothing was allocated."""


class PageAllocator:
    """Hands out page ids ``0..num_pages-1`` and tracks a reference count per page.

    Contracts:
    - ``alloc`` returns distinct free pages, each with refcount 1, lowest ids first on a
      fresh allocator; it is all-or-nothing.
    - ``incref`` and ``decref`` only accept pages that are currently allocated; a
      ``decref`` of a free page (double free) raises and leaves every count unchanged.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self._refcounts: list[int] = [0] * num_pages
        # A stack: pop() from the end hands out the lowest ids first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._num_refs = 0  # sum of the refcounts

    @property
    def num_pages(self) -> int:
        """Size of the pool."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages with refcount 0."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with refcount >= 1."""
        return self._num_pages - len(self._free)

    @property
    def num_refs(self) -> int:
        """References held on all pages together (the sum of the refcounts). O(1)."""
        return self._num_refs

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages, each with refcount 1.

        Raises ``OutOfPagesError`` (allocating nothing) if fewer than ``n`` are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages: {n}")
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, only {len(self._free)} free")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        refcounts = self._refcounts
        for page in pages:
            refcounts[page] = 1
        self._num_refs += n
        return pages

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
        """Drop one reference from each page; pages reaching 0 go back to the free list.

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
                self._free.append(page)
                freed += 1
        self._num_refs -= len(pages)
        return freed

    def refcount(self, page_id: int) -> int:
        """Current number of references on ``page_id`` (0 when free)."""
        self._check_id(page_id)
        return self._refcounts[page_id]

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless the free list and the refcounts agree.

        Does not change any state. O(num_pages).
        """
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("free list holds a page twice")
        for page in free:
            if not 0 <= page < self._num_pages:
                raise AssertionError(f"free list holds invalid page id {page}")
            if self._refcounts[page] != 0:
                raise AssertionError(f"free page {page} has refcount {self._refcounts[page]}")
        if any(count < 0 for count in self._refcounts):
            raise AssertionError("negative refcount")
        num_zero = sum(1 for count in self._refcounts if count == 0)
        if num_zero != len(free):
            raise AssertionError(f"{num_zero} pages have refcount 0 but {len(free)} are free")
        if sum(self._refcounts) != self._num_refs:
            raise AssertionError(
                f"refcounts sum to {sum(self._refcounts)}, counter {self._num_refs}"
            )

    def _undo_decref(self, pages: Sequence[int]) -> None:
        """Revert a partial ``decref`` of ``pages``, newest first (frees are a stack)."""
        for page in reversed(pages):
            if self._refcounts[page] == 0:
                popped = self._free.pop()
                if popped != page:  # pragma: no cover - would be a bug in decref itself
                    raise AssertionError("free list out of order while undoing decref")
            self._refcounts[page] += 1

    def _check_id(self, page_id: int) -> None:
        if not 0 <= page_id < self._num_pages:
            raise ValueError(f"page id {page_id} out of range [0, {self._num_pages})")

    def _check_allocated(self, page_id: int) -> None:
        self._check_id(page_id)
        if self._refcounts[page_id] <= 0:
            raise ValueError(f"page {page_id} is free; only allocated pages can be referenced")
