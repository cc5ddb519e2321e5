"""Bookkeeping of the kvstore's host-memory page pool: which page holds which hash.

The host tier stores whole KV pages keyed by their chained page hash
(`radixserve.cache.block_hash`), so a run of leading hashes present here is a cached
prefix, whatever worker computed it. This class owns page ids only; the bytes live in
the kvstore's pool tensor and move through a transfer agent.

A page is in one of three states::

    free ──reserve──> writing ──commit──> stored ──evict (LRU, no readers)──> free
                         └──abort──> free

* **writing**: a spill is copying into it; lookups do not see it.
* **stored**: in LRU order. A lookup that leases a run touches it last page first, so a
  prefix is always more recent than its continuations and the tails go first.
* **leased**: a stored page with readers (`lease` ... `release`). It is never evicted;
  a lease that is not released within its deadline (a reader that died) is dropped by
  `expire`.

Not thread-safe: the kvstore's event loop drives it.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class _Lease:
    owner: str
    pages: list[int]
    deadline: float


class HostPageIndex:
    """Hash -> host page for ``num_pages`` pages, with LRU eviction and read leases."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a host pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._stored: OrderedDict[int, int] = OrderedDict()  # hash -> page, oldest first
        self._writing: dict[int, int] = {}  # hash -> page being written
        self._readers: dict[int, int] = {}  # page -> leases on it
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self.evictions_total = 0
        self.stored_total = 0
        self.hit_pages_total = 0

    # -- reads ------------------------------------------------------------------------

    def match(self, page_hashes: Sequence[int]) -> int:
        """How many leading hashes are stored (no lease, no LRU touch)."""
        stored = self._stored
        return next((i for i, h in enumerate(page_hashes) if h not in stored), len(page_hashes))

    def lease(
        self, owner: str, page_hashes: Sequence[int], deadline: float
    ) -> tuple[int, list[int]]:
        """Lease the leading stored run of ``page_hashes``: (lease id, its pages in order).
        (0, []) when the first hash is not stored."""
        n = self.match(page_hashes)
        if n == 0:
            return 0, []
        pages = [self._stored[h] for h in page_hashes[:n]]
        for h in reversed(page_hashes[:n]):  # the prefix ends up the most recent
            self._stored.move_to_end(h)
        for page in pages:
            self._readers[page] = self._readers.get(page, 0) + 1
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = _Lease(owner, pages, deadline)
        self.hit_pages_total += n
        return lease_id, pages

    def release(self, lease_id: int) -> bool:
        """End a lease; False if it is unknown (already released or expired)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for page in lease.pages:
            left = self._readers[page] - 1
            if left:
                self._readers[page] = left
            else:
                del self._readers[page]
        return True

    def expire(self, now: float) -> int:
        """End the leases whose deadline passed; how many."""
        late = [lease_id for lease_id, lease in self._leases.items() if lease.deadline < now]
        for lease_id in late:
            self.release(lease_id)
        return len(late)

    # -- writes -----------------------------------------------------------------------

    def reserve(self, page_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """Pages to write for the hashes neither stored nor being written, evicting LRU
        pages without readers as needed: [(index into page_hashes, page)]. Stops early
        when nothing more can be evicted. Stored hashes among them are touched."""
        out: list[tuple[int, int]] = []
        for i, h in enumerate(page_hashes):
            if h in self._stored:
                self._stored.move_to_end(h)
                continue
            if h in self._writing:
                continue
            page = self._take_page()
            if page is None:
                break
            self._writing[h] = page
            out.append((i, page))
        return out

    def commit(self, page_hashes: Sequence[int]) -> None:
        """The pages reserved for these hashes now hold their KV: make them visible."""
        for h in page_hashes:
            self._stored[h] = self._writing.pop(h)
            self.stored_total += 1

    def abort(self, page_hashes: Sequence[int]) -> None:
        """The writes for these hashes failed: their pages are free again."""
        for h in page_hashes:
            self._free.append(self._writing.pop(h))

    def _take_page(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, page in self._stored.items():  # oldest first
            if page not in self._readers:
                del self._stored[h]
                self.evictions_total += 1
                return page
        return None

    # -- state ------------------------------------------------------------------------

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def stats(self) -> dict[str, int]:
        return {
            "host_pages_total": self.num_pages,
            "host_pages_used": len(self._stored) + len(self._writing),
            "host_pages_free": len(self._free),
            "host_pages_stored": len(self._stored),
            "host_pages_leased": len(self._readers),
            "host_leases": len(self._leases),
            "host_evictions_total": self.evictions_total,
            "host_stored_pages_total": self.stored_total,
            "host_hit_pages_total": self.hit_pages_total,
        }

    def check_integrity(self) -> None:
        """Raise AssertionError unless every page is in exactly one state."""
        stored, writing = list(self._stored.values()), list(self._writing.values())
        every = stored + writing + self._free
        if sorted(every) != list(range(self.num_pages)):
            raise AssertionError("a host page is lost or in two states")
        counted = Counter(page for lease in self._leases.values() for page in lease.pages)
        if counted != self._readers:
            raise AssertionError("reader counts disagree with the leases")
        if not set(self._readers) <= set(stored):
            raise AssertionError("a leased page is not stored")
