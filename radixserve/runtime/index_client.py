"""A worker's side of the kvstore's global index (docs/architecture.md §9): its radix
cache's events out, numbered in the engine thread's order (`publish`), and questions to
the index (`lookup`).

The index may be sharded over several kvstores (one per node, ``kvstores``): page hash h
belongs to shard ``h % shards``, each shard gets the events of its hashes, numbered on
their own (a gap on one shard resyncs that shard only), and a lookup asks every shard at
once and takes each worker's deepest page (a worker holding a page holds every page
before it), and the host tier's run from this node's kvstore.

The engine thread reports every page that enters or leaves the cache (`listen`); the
events go through one asyncio queue, so a resync's snapshot (`resync`: "cleared", then
every cached page) never overtakes an earlier event. The queue's consumer also keeps
`cached_hashes`, the loop's view of the device cache (the host tier and peer reads find
a prompt's device hit in it without waiting for a step). An event sent while a kvstore
is unreachable is dropped; that kvstore resyncs the worker when the link returns.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Sequence

from radixserve.cache.block_hash import leading_held
from radixserve.engine.async_engine import AsyncEngine
from radixserve.protocol import IndexQuery, IndexReply, KVEvent
from radixserve.runtime.calls import Replies
from radixserve.runtime.links import Link

logger = logging.getLogger(__name__)

#: one cache event: its kind, its page hashes, and the one shard it is for (None: each its own)
_Event = tuple[str, list[int], int | None]


class IndexClient:
    """Events to, and lookups in, the global index of the kvstores `attach` gives."""

    def __init__(self, name: str, generation: int, engine: AsyncEngine,
                 counters: Counter[str], query_timeout_s: float) -> None:  # fmt: skip
        self.name, self.generation, self.engine = name, generation, engine
        self._counters, self._query_timeout_s = counters, query_timeout_s
        self._events: asyncio.Queue[_Event] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shards: list[Link] = []  # the kvstores' links, in shard order
        self.home = 0  # the shard of this node's kvstore (its host tier)
        self._seq: list[int] = []  # per shard, the last event number sent
        self._replies: list[Replies[IndexReply]] = []
        # hashes of the pages in the engine's radix cache, as of the last event published
        self.cached_hashes: set[int] = set()

    def attach(self, name: str, shards: Sequence[Link], home: int) -> None:
        """This worker's member name (known once its port is bound), the kvstores' links
        in shard order, and which is this node's."""
        self.name = name
        self._shards, self.home = list(shards), home
        self._seq = [0] * len(shards)
        self._replies = [Replies() for _ in shards]

    def shard_of(self, link: Link) -> int | None:
        return next((i for i, own in enumerate(self._shards) if own is link), None)

    def listen(self) -> None:
        """Take the engine's cache events from now on (call on the event loop, then run
        `publish`)."""
        self._loop = asyncio.get_running_loop()
        self.engine.listen_cache(self._emitter(None))

    def _emitter(self, shard: int | None) -> Callable[[str, list[int]], None]:
        loop, queue = self._loop, self._events
        assert loop is not None

        def emit(kind: str, hashes: list[int]) -> None:  # on the engine thread
            loop.call_soon_threadsafe(queue.put_nowait, (kind, hashes, shard))

        return emit

    def resync(self, link: Link) -> None:
        """Queue "cleared" and a snapshot of every cached page for the kvstore behind
        ``link`` (its link came up, or it asked)."""
        shard = self.shard_of(link)
        if self._loop is not None and shard is not None:
            self.engine.resync_cache(self._emitter(shard))

    async def publish(self) -> None:
        """Send queued cache events to the kvstores, each its shard's hashes, numbered per
        shard; a lost one shows as a gap. They also keep `cached_hashes`."""
        while True:
            kind, hashes, target = await self._events.get()
            if kind == "stored":
                self.cached_hashes.update(hashes)
            elif kind == "removed":
                self.cached_hashes.difference_update(hashes)
            else:
                self.cached_hashes.clear()
            count = len(self._shards)
            for shard in range(count) if target is None else (target,):
                own = hashes if count == 1 or kind == "cleared" else [
                    h for h in hashes if h % count == shard]  # fmt: skip
                if own or kind == "cleared":
                    try:
                        await self._send(shard, kind, own)
                    except Exception:  # the loop must go on: a lost event resyncs
                        logger.exception("%s: cache event not sent", self.name)
                        self._counters["kv_events_dropped_total"] += 1

    async def _send(self, shard: int, kind: str, hashes: list[int]) -> None:
        self._seq[shard] += 1
        link = self._shards[shard]
        if not link.up:
            return  # the kvstore resyncs us when the link comes up
        event = KVEvent(self.name, self.generation, self._seq[shard], kind, tuple(hashes))
        try:
            await link.send(event, timeout_ms=0)
        except TimeoutError:
            self._counters["kv_events_dropped_total"] += 1

    def device_hit(self, hashes: Sequence[int]) -> int:
        """Leading pages of ``hashes`` in the device cache, per `cached_hashes`."""
        return leading_held(hashes, self.cached_hashes)

    async def lookup(self, hashes: Sequence[int]) -> tuple[dict[str, int], int]:
        """Leading pages of ``hashes`` each other worker holds on device, per every shard
        of the index that answers in time, and the leading pages this node's host tier
        holds (({}, 0) if no kvstore answers)."""
        held, hosts = await self.lookup_tiers(hashes)
        return held, hosts.get(self.home, 0)

    async def lookup_tiers(self, hashes: Sequence[int]) -> tuple[dict[str, int], dict[int, int]]:
        """`lookup`, with the leading pages of ``hashes`` each kvstore's host tier holds,
        by shard (this node's is `home`)."""
        up = [i for i, link in enumerate(self._shards) if link.up]
        if not up or not hashes:
            return {}, {}
        self._counters["index_queries_total"] += 1
        query_id, count = uuid.uuid4().hex, len(self._shards)
        answers = await asyncio.gather(*(
            self._replies[i].ask(self._shards[i], IndexQuery(f"{query_id}-{i}", tuple(hashes),
                                                             i, count),
                                 f"{query_id}-{i}", self._query_timeout_s)
            for i in up))  # fmt: skip
        got = {i: a for i, a in zip(up, answers, strict=True) if a is not None}
        if not got:
            self._counters["index_misses_total"] += 1
            return {}, {}
        if len(got) < count:
            self._counters["index_partial_answers_total"] += 1
        held: dict[str, int] = {}
        for answer in got.values():
            for name, pages in answer.device_pages.items():
                if name != self.name:
                    held[name] = max(held.get(name, 0), int(pages))
        return held, {i: answer.host_pages for i, answer in got.items()}

    def answer(self, link: Link, msg: IndexReply) -> None:
        shard = self.shard_of(link)
        if shard is not None:
            self._replies[shard].answer(msg.query_id, msg)

    def link_down(self, link: Link) -> None:
        shard = self.shard_of(link)
        if shard is not None:
            self._replies[shard].drop_all()
