"""Bookkeeping of the kvstore's host-memory page pool: which page holds which hash.

The host tier stores whole KV pages keyed by their chained page hash
(`radixserve.cache.block_hash`), so a run of leading hashes present here is a cached
prefix, whatever worker computed it. This class owns page ids only; the bytes live in
the kvstore's pool tensor and move through a transfer agent. The disk tier under it
keeps its slots with the same bookkeeping (`radixserve.cache.disk_index`).

A page is in one of three states::

    free ──reserve──> writing ──commit──> stored ──evict (LRU, no readers)──> free
                         └──abort──> free

* **writing**: a spill is copying into it; lookups do not see it.
* **stored**: in LRU order. A lookup that leases a run touches it last page first, so a
  prefix is always more recent than its continuations and the tails go first.
* **leased**: a stored page with readers (`lease` or `hold` ... `release`). It is never
  evicted; a lease that is not released within its deadline (a reader that died) is
  dropped by `expire`. A lease taken while part of its run is still being written
  (`hold_run`: a promotion from disk, whose reader reads each page once it is
  committed) covers those pages too; one of them aborted while leased is *retiring*
  and free once its last reader is gone.

An evicted page's bytes are about to be overwritten: ``on_evict(hash, page, proof)`` is
called first (the kvstore copies them towards the disk tier). Each stored page keeps the
`PageProof` it was committed with (its tokens and what its hash chains from), until it
leaves the tier.

Not thread-safe: the kvstore's event loop drives it.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from radixserve.cache.page_proof import PageProof

EvictCallback = Callable[[int, int, PageProof | None], None]


@dataclass
class _Lease:
    owner: str
    pages: list[int]
    deadline: float


class HostPageIndex:
    """Hash -> host page for ``num_pages`` pages, with LRU eviction and read leases."""

    TIER: ClassVar[str] = "host"  # the prefix of the stats' keys
    MIN_PAGES: ClassVar[int] = 1

    def __init__(
        self,
        num_pages: int,
        on_evict: EvictCallback | None = None,
        on_release: Callable[[int], None] | None = None,
    ) -> None:
        if num_pages < self.MIN_PAGES:
            raise ValueError(f"a {self.TIER} pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.on_evict = on_evict
        self.on_release = on_release  # told each lease id that ends (released or expired)
        self._free = list(range(num_pages - 1, -1, -1))
        self._stored: OrderedDict[int, int] = OrderedDict()  # hash -> page, oldest first
        self._writing: dict[int, int] = {}  # hash -> page being written
        self._retiring: set[int] = set()  # aborted while leased: free once unleased
        self._readers: dict[int, int] = {}  # page -> leases on it
        self._leases: dict[int, _Lease] = {}
        self._proofs: dict[int, PageProof] = {}  # hash -> proof, of stored pages
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
        self.hit_pages_total += n
        return self._hold_pages(owner, pages, deadline), pages

    def hold(
        self, owner: str, page_hashes: Sequence[int], deadline: float
    ) -> tuple[int, list[int]]:
        """Lease exactly these stored hashes, wherever they are (a promotion keeps the
        host pages of a run while it fills the gaps between them): (lease id, pages).
        Raises KeyError if one is not stored."""
        pages = [self._stored[h] for h in page_hashes]
        return (self._hold_pages(owner, pages, deadline) if pages else 0), pages

    def hold_run(
        self, owner: str, page_hashes: Sequence[int], deadline: float
    ) -> tuple[int, list[int]]:
        """Lease a run of hashes each stored or being written (its reader reads a
        written one only once it is committed), touching it like `lease`: (lease id,
        pages in order). Raises KeyError if one is neither."""
        pages = [self._stored[h] if h in self._stored else self._writing[h] for h in page_hashes]
        for h in reversed(page_hashes):
            if h in self._stored:
                self._stored.move_to_end(h)
        self.hit_pages_total += len(pages)
        return self._hold_pages(owner, pages, deadline), pages

    def _hold_pages(self, owner: str, pages: list[int], deadline: float) -> int:
        for page in pages:
            self._readers[page] = self._readers.get(page, 0) + 1
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = _Lease(owner, pages, deadline)
        return lease_id

    def stored(self, page_hash: int) -> bool:
        return page_hash in self._stored

    def proof(self, page_hash: int) -> PageProof | None:
        """The proof a stored page was committed with (None: none given, or not stored)."""
        return self._proofs.get(page_hash)

    def stored_pages(self) -> list[tuple[int, int]]:
        """(hash, page) of every stored page, least recently used first."""
        return list(self._stored.items())

    def release(self, lease_id: int) -> bool:
        """End a lease; False if it is unknown (already released or expired)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        if self.on_release is not None:
            self.on_release(lease_id)
        for page in lease.pages:
            left = self._readers[page] - 1
            if left:
                self._readers[page] = left
            else:
                del self._readers[page]
                if page in self._retiring:
                    self._retiring.discard(page)
                    self._free.append(page)
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

    def commit(self, page_hashes: Sequence[int], proofs: Sequence[PageProof] | None = None) -> None:
        """The pages reserved for these hashes now hold their KV (and ``proofs[i]`` is
        what hash i is recomputed from): make them visible."""
        for i, h in enumerate(page_hashes):
            self._stored[h] = self._writing.pop(h)
            if proofs is not None:
                self._proofs[h] = proofs[i]
            self.stored_total += 1

    def abort(self, page_hashes: Sequence[int]) -> None:
        """The writes for these hashes failed: their pages are free again (once no
        lease holds them)."""
        for h in page_hashes:
            page = self._writing.pop(h)
            if page in self._readers:
                self._retiring.add(page)
            else:
                self._free.append(page)

    def _take_page(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, page in self._stored.items():  # oldest first
            if page not in self._readers:
                del self._stored[h]
                proof = self._proofs.pop(h, None)
                self.evictions_total += 1
                if self.on_evict is not None:
                    self.on_evict(h, page, proof)
                return page
        return None

    # -- state ------------------------------------------------------------------------

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def stats(self) -> dict[str, int]:
        tier = self.TIER
        return {
            f"{tier}_pages_total": self.num_pages,
            f"{tier}_pages_used": len(self._stored) + len(self._writing),
            f"{tier}_pages_free": len(self._free),
            f"{tier}_pages_stored": len(self._stored),
            f"{tier}_pages_leased": len(self._readers),
            f"{tier}_leases": len(self._leases),
            f"{tier}_evictions_total": self.evictions_total,
            f"{tier}_stored_pages_total": self.stored_total,
            f"{tier}_hit_pages_total": self.hit_pages_total,
        }

    def check_integrity(self) -> None:
        """Raise AssertionError unless every page is in exactly one state."""
        stored, writing = list(self._stored.values()), list(self._writing.values())
        every = stored + writing + self._free + list(self._retiring)
        if sorted(every) != list(range(self.num_pages)):
            raise AssertionError(f"a {self.TIER} page is lost or in two states")
        counted = Counter(page for lease in self._leases.values() for page in lease.pages)
        if counted != self._readers:
            raise AssertionError("reader counts disagree with the leases")
        if not set(self._readers) <= set(stored) | set(writing) | self._retiring:
            raise AssertionError("a leased page is free")
        if not self._retiring <= set(self._readers):
            raise AssertionError("a retiring page has no reader left")
