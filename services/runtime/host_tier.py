"""A worker's side of the kvstore's host-memory tier: spill on eviction, load on a miss.

**Spill** (write-back, and optionally write-through). The radix cache hands the pages it
is about to evict to `_on_spill` on the engine thread (`RadixCache.set_spill_listener`).
They are copied at once into this worker's *spill buffer*, a host tensor in the pool
layout (pinned on CUDA) registered with a transfer agent of its own, so the device pages
are free for the step that needed them. The loop then offers the buffer pages to the
kvstore (`SpillOffer`), which reads those it lacks and answers `SpillDone`; only then is
the buffer space reused. A full buffer drops the pages (counted), as the cache would
have without a host tier. With ``host_write_through_uses`` N >= 1, a prefix used by N
requests is written the same way before any eviction, so other workers can load it.

**Load.** Before a prompt is admitted (`plan`), the worker hashes its pages, finds its
own device hit in `Worker.cached_hashes` (its cache events mirrored on the loop, so no
engine call waits for a step) and, unless that already covers the prompt, asks the
kvstore to lease the longest run past it (`HostLookup` -> `HostLease`: a round trip to
the kvstore, no engine step). The engine's one admission (`Engine.admit` with the
`HostPlan`) locks the device head and allocates pages for the run; the agent reads the
host pages into them (`read`), `Engine.finish_host_admission` inserts the prefix into
the radix cache and queues the request, which finds it cached, and the lease is
released. A slow kvstore, a failed read or a cancelled request ends the load with
nothing inserted, the lease released and every page returned; the prompt is then simply
computed.

While the kvstore link is down the tier is off; on every (re)connection the worker
attaches again (`HostAttach`), since a restarted kvstore starts with an empty tier.
Memory is never reused while a peer may still be writing into it or reading it: buffer
pages the kvstore was reading when its link went down wait out its read deadline, and a
load cancelled mid-read removes the kvstore's peer (cancelling the read) first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from radixserve.cache.block_hash import page_hashes
from radixserve.engine.admission import HostPlan
from radixserve.protocol import (
    HostAttach,
    HostAttachAck,
    HostLease,
    HostLookup,
    HostRelease,
    Message,
    SpillDone,
    SpillOffer,
)
from radixserve.services.runtime.links import Link
from radixserve.services.runtime.service import transfer_network
from radixserve.transfer import KVTransferAgent, PoolCompat, TransferError, create_agent

if TYPE_CHECKING:
    from radixserve.services.runtime.worker import Worker

logger = logging.getLogger(__name__)

_MAX_PAGES_PER_OFFER = 4096
_QUARANTINE_S = 120.0  # > the kvstore's read deadline (host_transfer_timeout_s <= 100 s)


class HostTierClient:
    """Spill buffer, its agent and the load path of one worker."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        s = worker.settings
        engine = worker.engine.engine
        kv = engine.kv_pool.kv
        page_bytes = engine.kv_pool.page_bytes * 2 * engine.kv_pool.num_layers
        num_pages = max(1, s.host_spill_buffer_mib * (1 << 20) // page_bytes)
        shape = (kv.shape[0], 2, num_pages, *kv.shape[3:])
        self.buffer = torch.empty(shape, dtype=kv.dtype, pin_memory=kv.is_cuda)
        compat = PoolCompat.from_pool(engine.kv_pool, engine.config.name)
        self.buffer_agent: KVTransferAgent = create_agent(
            s.transfer_backend,
            f"{worker.name}.spill",
            self.buffer,
            compat,
            nixl_progress_thread=s.nixl_progress_thread,
            network=transfer_network(s),
        )
        self.page_bytes = page_bytes
        self.page_size = engine.page_size
        assert engine.cache is not None
        self.namespace = engine.cache.namespace
        self.link: Link | None = None
        self.attached = False
        self.kvstore_agent = ""  # peer name of the host pool's agent in the worker's agent
        self.counters: Counter[str] = Counter()  # engine thread and loop: under _lock
        self.load_seconds = 0.0
        self._lock = threading.Lock()
        self._free = list(range(num_pages - 1, -1, -1))  # buffer pages; under _lock
        self._offers: asyncio.Queue[tuple[list[int], list[int]]] = asyncio.Queue()
        self._outstanding: dict[int, list[int]] = {}  # spill id -> buffer pages
        self._spill_ids = 0
        self._queries: dict[str, asyncio.Future] = {}
        self._busy = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._tasks = [
            asyncio.create_task(self._send_offers()),
            # drive the buffer's agent while the kvstore may be reading it
            asyncio.create_task(
                self.buffer_agent.serve_reads_while(lambda: bool(self._outstanding), self._busy)
            ),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.buffer_agent.close()

    # -- the link to the kvstore --------------------------------------------------------

    def on_up(self, link: Link) -> None:
        self.link = link
        msg = HostAttach(self.worker.name, self.worker.generation, self.buffer_agent.metadata())
        self.worker.spawn_notice(self._send(msg))

    def on_down(self, link: Link, why: str) -> None:
        """The kvstore is gone (or silent): stop spilling. The buffer pages it was reading
        are reused only after `_QUARANTINE_S`, past any deadline of its reads, in case
        it was only silent."""
        self.attached = False
        self.worker.engine.submit(lambda engine: self._listen(engine, False))
        held = [page for pages in self._outstanding.values() for page in pages]
        self._outstanding.clear()
        if held:
            self._loop.call_later(_QUARANTINE_S, self._release_buffer, held)
        for reply in self._queries.values():
            if not reply.done():
                reply.set_result(None)

    def _release_buffer(self, pages: list[int]) -> None:
        with self._lock:
            self._free.extend(pages)

    def on_message(self, link: Link, msg: Message) -> bool:
        """Handle a host-tier message from the kvstore; False if it is not one."""
        if isinstance(msg, HostAttachAck):
            self._attached(link, msg)
        elif isinstance(msg, SpillDone):
            pages = self._outstanding.pop(msg.spill_id, None)
            if pages is not None:
                with self._lock:
                    self._free.extend(pages)
                    self.counters["host_spill_stored_pages_total"] += msg.stored
        elif isinstance(msg, HostLease):
            reply = self._queries.get(msg.query_id)
            if reply is not None and not reply.done():
                reply.set_result(msg)
            elif msg.lease_id:
                self.worker.spawn_notice(self._send(HostRelease(msg.lease_id)))
        else:
            return False
        return True

    def _attached(self, link: Link, ack: HostAttachAck) -> None:
        if not ack.accepted:
            logger.warning("%s: the kvstore refused the host tier: %s", self.worker.name,
                           ack.reason)  # fmt: skip
            return
        agent = self.worker.agent
        assert agent is not None
        try:
            agent.add_peer(link.name, link.generation, ack.metadata)
        except TransferError as exc:
            logger.warning("%s: cannot reach the host tier: %s", self.worker.name, exc)
            return
        self.kvstore_agent = link.name
        self.attached = True
        self.worker.engine.submit(lambda engine: self._listen(engine, True))
        logger.info("%s: attached to the host tier of %s (%d pages)", self.worker.name,
                    link.label, ack.num_pages)  # fmt: skip

    def _listen(self, engine, on: bool) -> None:  # type: ignore[no-untyped-def]
        """On the engine thread: start or stop handing evicted pages to us."""
        cache = engine.cache
        if cache is None:
            return
        if on:
            cache.clear_written()  # a (re)attached tier holds nothing of ours yet
            cache.set_spill_listener(self._on_spill, self.worker.settings.host_write_through_uses)
        else:
            cache.set_spill_listener(None)

    async def _send(self, msg: Message) -> None:
        link = self.link
        if link is None or not link.up:
            return
        with contextlib.suppress(TimeoutError):
            await link.send(msg, timeout_ms=0)

    # -- spill --------------------------------------------------------------------------

    def _on_spill(self, hashes: list[int], page_ids: list[int]) -> None:
        """On the engine thread, before the cache lets ``page_ids`` go: stage them."""
        with self._lock:
            n = min(len(page_ids), len(self._free))
            slots = [self._free.pop() for _ in range(n)]
            self.counters["host_spill_dropped_pages_total"] += len(page_ids) - n
        if not n:
            return
        kv = self.worker.engine.engine.kv_pool.kv
        src = torch.tensor(page_ids[:n], device=kv.device)
        dst = torch.tensor(slots)
        self.buffer.index_copy_(2, dst, kv.index_select(2, src).to("cpu"))
        with self._lock:
            self.counters["host_spills_total"] += 1
            self.counters["host_spill_pages_total"] += n
            self.counters["host_spill_bytes_total"] += n * self.page_bytes
        self._loop.call_soon_threadsafe(self._offers.put_nowait, (hashes[:n], slots))

    async def _send_offers(self) -> None:
        while True:
            hashes, slots = await self._offers.get()
            while not self._offers.empty() and len(hashes) < _MAX_PAGES_PER_OFFER:
                more_hashes, more_slots = self._offers.get_nowait()
                hashes, slots = hashes + more_hashes, slots + more_slots
            link = self.link
            if not self.attached or link is None or not link.up:
                with self._lock:
                    self._free.extend(slots)
                continue
            self._spill_ids += 1
            self._outstanding[self._spill_ids] = slots
            self._busy.set()
            try:
                await link.send(SpillOffer(self._spill_ids, tuple(hashes), tuple(slots)), 0)
            except TimeoutError:
                with self._lock:
                    self._free.extend(self._outstanding.pop(self._spill_ids, []))

    # -- load ---------------------------------------------------------------------------

    async def plan(
        self, request_id: str, prompt_ids: list[int]
    ) -> tuple[HostPlan, HostLease] | None:
        """Lease the longest host-tier run past this worker's device hit of the prompt;
        None when there is nothing to gain (no tier, the device holds every full page) or
        nothing is there. The caller admits with the plan, `read`s and `release`s."""
        if not self.attached or len(prompt_ids) < 2:
            return None
        size = self.page_size
        full = (len(prompt_ids) - 1) // size  # never the last token: its logits are needed
        hashes = page_hashes(prompt_ids[: full * size], size, self.namespace)
        device_pages = 0  # the device hit, from the worker's view of its cache (no step wait)
        while device_pages < full and hashes[device_pages] in self.worker.cached_hashes:
            device_pages += 1
        if device_pages == full:
            return None
        lease = await self._lookup(request_id, hashes[device_pages:])
        if lease is None or not lease.lease_id:
            return None
        return HostPlan(device_pages, len(lease.host_page_ids)), lease

    def release(self, lease: HostLease) -> None:
        self.worker.spawn_notice(self._send(HostRelease(lease.lease_id)))

    async def _lookup(self, request_id: str, hashes: list[int]) -> HostLease | None:
        link = self.link
        if link is None or not link.up:
            return None
        reply: asyncio.Future = self._loop.create_future()
        self._queries[request_id] = reply
        try:
            await link.send(HostLookup(request_id, tuple(hashes)), timeout_ms=0)
            lease: HostLease | None = await asyncio.wait_for(
                reply, self.worker.settings.host_lookup_timeout_s
            )
        except TimeoutError:
            self._count("host_lookup_timeouts_total")
            return None
        finally:
            self._queries.pop(request_id, None)
        return lease

    async def read(self, lease: HostLease, dst: tuple[int, ...]) -> bool:
        """Read the lease's first ``len(dst)`` host pages into the device pages ``dst``;
        whether it worked (a failure is logged and counted)."""
        agent = self.worker.agent
        assert agent is not None
        src = list(lease.host_page_ids[: len(dst)])
        ok = False
        start = time.perf_counter()
        try:
            handle = agent.read_pages(
                self.kvstore_agent, src, list(dst),
                timeout_s=self.worker.settings.host_load_timeout_s,
            )  # fmt: skip
            ok = await agent.wait_async(handle) == "done"
        except TransferError as exc:
            logger.warning("%s: host-tier load failed: %s", self.worker.name, exc)
        except asyncio.CancelledError:  # wait_async removed the peer: attach again
            self.attached = False
            if self.link is not None and self.link.up:
                self.on_up(self.link)  # attach again: re-adds the peer
            raise
        if not ok:
            self._count("host_load_failures_total")
            return False
        with self._lock:
            self.counters["host_loads_total"] += 1
            self.counters["host_load_pages_total"] += len(dst)
            self.counters["host_load_bytes_total"] += len(dst) * self.page_bytes
            self.load_seconds += time.perf_counter() - start
        return True

    def _count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            stats: dict[str, int | float] = dict(self.counters)
            stats["host_spill_buffer_free"] = len(self._free)
            stats["host_spill_buffer_pages"] = self.buffer.shape[2]
            stats["host_load_seconds_total"] = self.load_seconds
        stats["host_attached"] = int(self.attached)
        return stats
