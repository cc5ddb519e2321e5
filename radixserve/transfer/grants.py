"""The grants ledger: which pages an owner lends to which reader (the contract:
`radixserve.transfer.base`, Grants)."""

from __future__ import annotations

import re
import threading
from collections import Counter

_RANK_NAME = re.compile(r"(.+)\.tp\d+")  # a tensor-parallel rank's agent: <worker>.tp<N>


class PageGrants:
    """Which pages of an agent's pool are lent to which peer: a count per (peer, page),
    one per grant (two leases of one page to one reader are two grants). Thread-safe:
    a backend's serving thread asks `allows` while the owner's loop grants."""

    def __init__(self) -> None:
        self.enforced = False
        self._lock = threading.Lock()
        self._counts: dict[str, Counter[int]] = {}

    def grant(self, peer: str, page_ids: list[int]) -> None:
        with self._lock:
            self._counts.setdefault(peer, Counter()).update(page_ids)

    def revoke(self, peer: str, page_ids: list[int] | None = None) -> None:
        with self._lock:
            counts = self._counts.get(peer)
            if counts is None:
                return
            if page_ids is None:
                counts.clear()
            else:
                counts.subtract(page_ids)
                for page in set(page_ids):
                    if counts.get(page, 0) <= 0:
                        counts.pop(page, None)
            if not counts:
                del self._counts[peer]

    def allows(self, reader: str, page_ids: list[int]) -> bool:
        """Whether ``reader`` (an agent's name; a rank's ``<peer>.tp<N>`` counts as
        ``<peer>``) may read every page of ``page_ids`` (always, unless enforced)."""
        if not self.enforced:
            return True
        rank = _RANK_NAME.fullmatch(reader)
        peer = rank.group(1) if rank else reader
        with self._lock:
            counts = self._counts.get(peer)
            return counts is not None and all(counts[p] > 0 for p in page_ids)

    def num_pages(self) -> int:
        """Pages granted now, over every peer (a page granted to two counts twice)."""
        with self._lock:
            return sum(len(c) for c in self._counts.values())
