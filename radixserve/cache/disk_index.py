"""Bookkeeping of the kvstore's disk tier: which file slot holds which page hash.

The disk tier keeps pages evicted from the host tier in slots of preallocated files
(`radixserve.services.kvstore.disk_files`); a slot id is a page id here. The states and
the LRU are the host tier's (`HostPageIndex`: free, writing, stored, leased while a
promotion reads it), with what a tier of files needs on top:

* the slots grow as files are added (`adopt`), up to the tier's bound;
* a page whose bytes fail their checksum is dropped (`drop`): its slot is free again;
* after a restart, the pages found valid in a file are adopted as stored, and `reorder`
  puts the whole LRU back in the order they were written.

Eviction frees a slot for the write that asked for it, which overwrites it: a disk
page leaves the tier the moment its slot is reused, and never sooner.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar

from radixserve.cache.host_index import EvictCallback, HostPageIndex
from radixserve.cache.page_proof import PageProof


class DiskPageIndex(HostPageIndex):
    """Hash -> disk slot, growing by files, with LRU eviction and read holds."""

    TIER: ClassVar[str] = "disk"
    MIN_PAGES: ClassVar[int] = 0

    def __init__(self, on_evict: EvictCallback | None = None) -> None:
        """``on_evict(hash, slot, proof)``: a stored page's slot is about to be reused."""
        super().__init__(0, on_evict)

    def adopt(
        self,
        num_slots: int,
        found: Sequence[tuple[int, int]] = (),
        proofs: Sequence[PageProof] | None = None,
    ) -> range:
        """Add ``num_slots`` slots (a new file's): those in ``found`` ((hash, slot) in
        the order they were written, slots counted from the first new one; ``proofs``
        theirs) are stored, the rest free. The new slot ids."""
        slots, hashes = {slot for _, slot in found}, {h for h, _ in found}
        if len(slots) < len(found) or len(hashes) < len(found) or hashes & set(self._stored):
            raise ValueError("a slot or a page hash adopted twice")
        if not slots <= set(range(num_slots)):
            raise ValueError(f"a slot outside the file's {num_slots}")
        first = self.num_pages
        self.num_pages += num_slots
        self._stored.update((h, first + slot) for h, slot in found)
        if proofs is not None:
            self._proofs.update((h, proof) for (h, _), proof in zip(found, proofs))
        self._free.extend(first + s for s in reversed(range(num_slots)) if s not in slots)
        return range(first, self.num_pages)

    def drop(self, page_hashes: Iterable[int]) -> int:
        """Forget stored pages whose bytes cannot be trusted (no reader may hold them);
        their slots are free. How many were stored."""
        dropped = 0
        for h in page_hashes:
            page = self._stored.get(h)
            if page is None:
                continue
            if page in self._readers:
                raise ValueError(f"disk slot {page} is being read; release it first")
            del self._stored[h]
            self._proofs.pop(h, None)
            self._free.append(page)
            dropped += 1
        return dropped

    def reorder(self, written: Mapping[int, int]) -> None:
        """Put the stored pages in LRU order by ``written`` (hash -> write sequence; the
        oldest first), as they stood before a restart."""
        order = sorted(self._stored.items(), key=lambda item: written.get(item[0], 0))
        self._stored.clear()
        self._stored.update(order)

    def touch(self, page_hash: int) -> bool:
        """Whether the tier has ``page_hash`` (stored or being written); a stored one
        becomes the most recently used (the host tier evicted it again: it is in use)."""
        if page_hash in self._stored:
            self._stored.move_to_end(page_hash)
            return True
        return page_hash in self._writing

    @property
    def num_stored(self) -> int:
        return len(self._stored)

    def stored_hashes(self) -> list[int]:
        """The stored hashes, least recently used first."""
        return list(self._stored)

    def slot_of(self, page_hash: int) -> int | None:
        return self._stored.get(page_hash)
