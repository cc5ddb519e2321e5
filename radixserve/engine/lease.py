"""Page leases: KV pages a prefill engine keeps alive until a decode worker has read them.

A lease holds one reference on each page (taken and dropped by `KVCacheManager.lease` and
`release_lease`; this table only records which pages and until when), so the pages
survive the request's own release (and any cache eviction) until released — normally on
the reader's completion notice — or until the lease expires, so a dead reader never
strands them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    page_ids: list[int]
    expires_at: float  # time.perf_counter() deadline


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def hold(self, request_id: str, page_ids: list[int], expires_at: float) -> None:
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} already holds a lease")
        self._leases[request_id] = Lease(list(page_ids), expires_at)

    def request_ids(self) -> list[str]:
        return list(self._leases)

    def pages(self, request_id: str) -> list[int] | None:
        lease = self._leases.get(request_id)
        return None if lease is None else list(lease.page_ids)

    def pop(self, request_id: str) -> list[int] | None:
        """Forget a lease; its pages (None if there is none: released or expired)."""
        lease = self._leases.pop(request_id, None)
        return None if lease is None else lease.page_ids

    def next_deadline(self) -> float | None:
        """The earliest deadline (``time.perf_counter()``) of a lease held; None if none."""
        return min((lease.expires_at for lease in self._leases.values()), default=None)

    def expired(self, now: float) -> list[str]:
        """The request ids of the leases past their deadline (still held)."""
        expired = [rid for rid, lease in self._leases.items() if lease.expires_at <= now]
        for rid in expired:
            logger.warning("KV lease of %s expired before its transfer finished", rid)
        return expired
