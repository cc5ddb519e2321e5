"""Page leases: KV pages a prefill engine keeps alive until a decode worker has read them.

A lease holds one allocator reference on each page, so the pages survive the request's
own release (and any cache eviction) until `release` — normally on the reader's
completion notice — or until the lease expires, so a dead reader never strands them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from radixserve.cache.page_allocator import PageAllocator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    page_ids: list[int]
    expires_at: float  # time.perf_counter() deadline


class LeaseTable:
    def __init__(self, allocator: PageAllocator) -> None:
        self._allocator = allocator
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def hold(self, request_id: str, page_ids: list[int], expires_at: float) -> None:
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} already holds a lease")
        self._allocator.incref(page_ids)
        self._leases[request_id] = Lease(list(page_ids), expires_at)

    def request_ids(self) -> list[str]:
        return list(self._leases)

    def pages(self, request_id: str) -> list[int] | None:
        lease = self._leases.get(request_id)
        return None if lease is None else list(lease.page_ids)

    def release(self, request_id: str) -> bool:
        """Drop a lease's references; False if there is none (already released/expired)."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        self._allocator.decref(lease.page_ids)
        return True

    def next_deadline(self) -> float | None:
        """The earliest deadline (``time.perf_counter()``) of a lease held; None if none."""
        return min((lease.expires_at for lease in self._leases.values()), default=None)

    def expire(self, now: float) -> list[str]:
        """Release every lease past its deadline; returns their request ids."""
        expired = [rid for rid, lease in self._leases.items() if lease.expires_at <= now]
        for rid in expired:
            logger.warning("KV lease of %s expired before its transfer finished", rid)
            self.release(rid)
        return expired
