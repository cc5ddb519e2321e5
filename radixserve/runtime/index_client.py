"""A worker's side of the kvstore's global index (docs/architecture.md §9): its radix
cache's events out, numbered in the engine thread's order (`publish`), and questions to
the index (`lookup`).

The engine thread reports every page that enters or leaves the cache (`listen`); the
events go through one asyncio queue, so a resync's snapshot (`resync`: "cleared", then
every cached page) never overtakes an earlier event. The queue's consumer also keeps
`cached_hashes`, the loop's view of the device cache (the host tier and peer reads find
a prompt's device hit in it without waiting for a step). An event sent while the
kvstore is unreachable is dropped; the kvstore resyncs the worker when the link returns.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Callable, Sequence

from radixserve.cache.block_hash import leading_held
from radixserve.engine.async_engine import AsyncEngine
from radixserve.protocol import IndexQuery, IndexReply, KVEvent
from radixserve.runtime.calls import Replies
from radixserve.runtime.links import Link


class IndexClient:
    """Events to, and lookups in, the global index of the kvstore behind ``link()``."""

    def __init__(self, name: str, generation: int, engine: AsyncEngine,
                 link: Callable[[], Link | None], counters: Counter[str],
                 query_timeout_s: float) -> None:  # fmt: skip
        self.name, self.generation, self.engine = name, generation, engine
        self._link, self._counters, self._query_timeout_s = link, counters, query_timeout_s
        self._events: asyncio.Queue[tuple[str, list[int]]] = asyncio.Queue()
        self._seq = 0
        self._emit: Callable[[str, list[int]], None] | None = None  # engine thread -> queue
        self._replies: Replies[IndexReply] = Replies()
        # hashes of the pages in the engine's radix cache, as of the last event published
        self.cached_hashes: set[int] = set()

    def listen(self) -> None:
        """Take the engine's cache events from now on (call on the event loop, then run
        `publish`)."""
        loop = asyncio.get_running_loop()

        def emit(kind: str, hashes: list[int]) -> None:  # on the engine thread
            loop.call_soon_threadsafe(self._events.put_nowait, (kind, hashes))

        self._emit = emit
        self.engine.listen_cache(emit)

    def resync(self) -> None:
        """Queue "cleared" and a snapshot of every cached page (the link came up, or the
        kvstore asked)."""
        if self._emit is not None:
            self.engine.resync_cache(self._emit)

    async def publish(self) -> None:
        """Send queued cache events to the kvstore, numbered; a lost one shows as a gap.
        They also keep `cached_hashes`."""
        while True:
            kind, hashes = await self._events.get()
            if kind == "stored":
                self.cached_hashes.update(hashes)
            elif kind == "removed":
                self.cached_hashes.difference_update(hashes)
            else:
                self.cached_hashes.clear()
            self._seq += 1
            link = self._link()
            if link is None or not link.up:
                continue  # the kvstore resyncs us when the link comes up
            event = KVEvent(self.name, self.generation, self._seq, kind, tuple(hashes))
            try:
                await link.send(event, timeout_ms=0)
            except TimeoutError:
                self._counters["kv_events_dropped_total"] += 1

    def device_hit(self, hashes: Sequence[int]) -> int:
        """Leading pages of ``hashes`` in the device cache, per `cached_hashes`."""
        return leading_held(hashes, self.cached_hashes)

    async def lookup(self, hashes: Sequence[int]) -> tuple[dict[str, int], int]:
        """Leading pages of ``hashes`` each other worker holds on device and the host tier
        holds, per the index (({}, 0) if the kvstore is down or slow)."""
        link = self._link()
        if link is None or not link.up or not hashes:
            return {}, 0
        query_id = uuid.uuid4().hex
        self._counters["index_queries_total"] += 1
        answer = await self._replies.ask(link, IndexQuery(query_id, tuple(hashes)), query_id,
                                         self._query_timeout_s)  # fmt: skip
        if answer is None:
            self._counters["index_misses_total"] += 1
            return {}, 0
        held = {name: int(p) for name, p in answer.device_pages.items() if name != self.name}
        return held, answer.host_pages

    def answer(self, _link: Link, msg: IndexReply) -> None:
        self._replies.answer(msg.query_id, msg)

    def link_down(self) -> None:
        self._replies.drop_all()
