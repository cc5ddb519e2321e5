"""The cluster-wide index of cached pages: which worker holds which page, by page hash.

Workers publish `KVEvent`s (``stored`` / ``removed`` / ``cleared`` with chained page
hashes, `radixserve.cache.block_hash`) and the kvstore applies them here. Because a page
hash chains every page before it, the hashes of a prompt's pages name its prefixes: the
number of leading hashes a worker holds is the length of the prompt's prefix it has
cached. So the index is a map hash -> holders, and `match` walks a query's hashes once.

Ordering contract, per worker: each generation numbers its events 1, 2, 3, ...
- ``cleared`` is always accepted: it empties the worker's entries and restarts the
  expected sequence after its ``seq`` (a worker sends it first in a resync);
- event 1 of a worker or generation it has not seen starts that worker afresh (a
  restarted worker's old entries go);
- any other event must carry exactly the next ``seq`` of a known generation; a gap, or
  a later event from a worker or generation it does not know (the kvstore restarted,
  or missed the start) drops the worker's entries and `apply` returns False: ask it to
  resync. Until its ``cleared`` arrives, its other events are ignored.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class _WorkerState:
    generation: int
    seq: int | None  # last applied; None = waiting for "cleared" (resync asked)
    pages: set[int] = field(default_factory=set)
    last_event: float = 0.0


class GlobalIndex:
    """Page hash -> workers holding it, kept consistent by per-worker sequence numbers."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._workers: dict[str, _WorkerState] = {}
        self.num_events = 0
        self.num_resyncs = 0

    def apply(
        self,
        worker: str,
        generation: int,
        seq: int,
        kind: str,
        page_hashes: Sequence[int],
        now: float | None = None,
    ) -> bool:
        """Apply one event; False if the worker must resync (its entries were dropped)."""
        now = time.monotonic() if now is None else now
        state = self._workers.get(worker)
        if kind == "cleared":
            self.drop(worker)
            self._workers[worker] = _WorkerState(generation, seq, last_event=now)
            self.num_events += 1
            return True
        if state is not None and state.generation == generation and state.seq is None:
            return True  # a resync is under way: ignore until its "cleared"
        if (state is None or state.generation != generation) and seq == 1:
            self.drop(worker)  # a new worker, or the first event of a restarted one
            state = self._workers[worker] = _WorkerState(generation, 0, last_event=now)
        in_order = (
            state is not None
            and state.generation == generation
            and state.seq is not None
            and seq == state.seq + 1
        )
        if state is None or not in_order:
            self.drop(worker)
            self._workers[worker] = _WorkerState(generation, None, last_event=now)
            self.num_resyncs += 1
            return False
        state.seq, state.last_event = seq, now
        self.num_events += 1
        if kind == "stored":
            for h in page_hashes:
                state.pages.add(h)
                self._holders.setdefault(h, set()).add(worker)
        elif kind == "removed":
            state.pages.difference_update(page_hashes)
            self._unhold(worker, page_hashes)
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")
        return True

    def drop(self, worker: str) -> None:
        """Forget everything ``worker`` holds (it died, restarted or lost events)."""
        state = self._workers.pop(worker, None)
        if state is not None:
            self._unhold(worker, state.pages)

    def _unhold(self, worker: str, page_hashes: Iterable[int]) -> None:
        for h in page_hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def match(self, page_hashes: Sequence[int]) -> dict[str, int]:
        """Leading pages of ``page_hashes`` each worker holds (workers holding none left out)."""
        counts: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(page_hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for worker in alive:
                counts[worker] = i + 1
        return counts

    def deepest(self, page_hashes: Sequence[int], shard: int, shards: int) -> dict[str, int]:
        """Per worker, the pages of ``page_hashes`` up to and including the deepest one it
        holds among those this shard owns (``hash % shards == shard``). A worker holding a
        page holds every page before it (its radix cache evicts leaves first, and the
        hashes chain), so over every shard's answer the greatest is its leading run; a
        shard that is lost costs at most the pages between its hashes, never a page a
        worker lacks."""
        counts: dict[str, int] = {}
        for i in range(len(page_hashes) - 1, -1, -1):
            h = page_hashes[i]
            if h % shards != shard:
                continue
            for worker in self._holders.get(h, ()):
                counts.setdefault(worker, i + 1)
        return counts

    @property
    def num_pages(self) -> int:
        """Distinct pages cached anywhere in the cluster."""
        return len(self._holders)

    def workers(self, now: float | None = None) -> dict[str, dict[str, float]]:
        """Per worker: pages held, last applied sequence number, seconds since its last event."""
        now = time.monotonic() if now is None else now
        return {
            name: {
                "pages": len(s.pages),
                "seq": -1 if s.seq is None else s.seq,
                "since_last_event_s": now - s.last_event,
            }
            for name, s in self._workers.items()
        }
