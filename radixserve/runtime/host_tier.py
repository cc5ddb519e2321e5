"""A worker's side of the kvstore's host-memory tier: spill on eviction, load on a miss.

**Spill.** Pages the radix cache is about to evict (or, with ``host_write_through_uses``
N >= 1, a prefix N requests used) are copied on the engine thread into this worker's
*spill buffer* (a host tensor in the pool layout with a transfer agent of its own), so
the device pages are free at once; the loop offers them to the kvstore (`SpillOffer`),
which reads those it lacks and answers `SpillDone`, and only then is the buffer space
reused. A full buffer drops the pages (counted). The buffer's agent serves only pages
on offer: each offer's pages are granted to the kvstore's agent until its `SpillDone`
(or until its link goes down), so a read of any other buffer page is refused.

**Load** (`plan`, `read`, `release`): `HostLoads` (`radixserve.runtime.host_loads`), mixed in.

While the kvstore link is down the tier is off; every (re)connection attaches again
(`HostAttach`). Memory a peer may still be writing or reading is never reused: buffer
pages the kvstore was reading when its link went down wait out its read deadline, and a
load cancelled mid-read removes the kvstore's peer first. Details:
docs/architecture.md §9 (the host tier).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import tempfile
import threading
from collections import Counter
from collections.abc import Set

import torch

from radixserve.cache.page_proof import PageProof, unpack_tokens
from radixserve.engine.async_engine import AsyncEngine
from radixserve.protocol import (
    HostAttach,
    HostAttachAck,
    HostLease,
    HostPagesReady,
    Message,
    SpillDone,
    SpillOffer,
    SpillRun,
)
from radixserve.protocol.stats_messages import HostTierSection, fill
from radixserve.protocol.wire import MAX_TOKENS_PER_MESSAGE
from radixserve.runtime.calls import Replies, Tasks, send_quietly
from radixserve.runtime.host_loads import HostLoads, Loading
from radixserve.runtime.links import Link
from radixserve.runtime.network import transfer_network
from radixserve.runtime.service import Handlers, dispatch
from radixserve.runtime.settings import WorkerSettings
from radixserve.transfer import KVTransferAgent, TransferError, create_agent
from radixserve.transfer.group import GroupAgent

logger = logging.getLogger(__name__)

_MAX_PAGES_PER_OFFER = 4096
_QUARANTINE_S = 120.0  # > the kvstore's read deadline (host_transfer_timeout_s <= 100 s)


def shared_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    """A zeroed host tensor backed by a new file, which other processes map by its path:
    (path, tensor). In /dev/shm when it has room (a container's is often 64 MiB), else in
    the temporary directory."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    where = None
    with contextlib.suppress(OSError):
        stat = os.statvfs("/dev/shm")
        if stat.f_bavail * stat.f_frsize > 2 * nbytes:
            where = "/dev/shm"
    fd, path = tempfile.mkstemp(prefix="radixserve-spill-", dir=where)
    os.ftruncate(fd, nbytes)
    os.close(fd)
    return path, torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def spill_offer(
    spill_id: int, hashes: list[int], slots: list[int], proofs: list[PageProof]
) -> SpillOffer:
    """The offer of pages ``hashes`` staged at ``slots``: their tokens, and a run per
    stretch of pages each chained from the one before it in one namespace."""
    runs: list[SpillRun] = []
    tokens: list[int] = []
    for i, proof in enumerate(proofs):
        tokens += unpack_tokens(proof.tokens)
        last = runs[-1] if runs else None
        if last is not None and proof.namespace == last.namespace and proof.parent == hashes[i - 1]:
            runs[-1] = SpillRun(last.num_pages + 1, last.namespace, last.parent)
        else:
            parent = () if proof.parent is None else (proof.parent,)
            runs.append(SpillRun(1, proof.namespace, parent))
    return SpillOffer(spill_id, tuple(hashes), tuple(slots), tuple(tokens), tuple(runs))


class HostTierClient(HostLoads):
    """Spill buffer, its agent and the load path of one worker."""

    def __init__(
        self,
        name: str,
        generation: int,
        settings: WorkerSettings,
        engine: AsyncEngine,
        agent: GroupAgent,
        device_hashes: Set[int],
        spills: bool = True,
    ) -> None:
        """``agent`` is the worker's own (it reads host pages into the pool);
        ``device_hashes`` its view of the page hashes its cache holds. ``spills``: the
        worker's evicted pages go to this kvstore (its node's); another node's kvstore
        is only read from (its buffer is one page, never offered)."""
        self.name, self.generation, self.settings = name, generation, settings
        self.engine, self.agent, self.device_hashes = engine, agent, device_hashes
        self.spills = spills
        geometry = engine.info.geometry
        kv = engine.info.kv  # (L, 2, P, page_size, H, D): H of rank 0 only, with TP
        self.page_bytes = geometry.page_bytes
        buffer_mib = settings.host_spill_buffer_mib if spills else 0  # 0: one page
        num_pages = max(1, buffer_mib * (1 << 20) // self.page_bytes)
        # whole pages, (L, 2, buffer pages, S, every KV head, D); with tensor parallelism
        # in a file every rank maps, each copying its heads of a spilled page
        shape = (kv.shape[0], 2, num_pages, kv.shape[3], geometry.num_kv_heads, kv.shape[5])
        self.buffer_path: str | None = None
        if engine.info.kv_shard.size > 1 and spills:
            self.buffer_path, self.buffer = shared_buffer(shape, kv.dtype)
        else:
            self.buffer = torch.empty(shape, dtype=kv.dtype, pin_memory=kv.is_cuda)
        self.buffer_agent: KVTransferAgent = create_agent(
            settings.transfer_backend,
            f"{name}.spill",  # the name the kvstore knows it by (`spill_agent_name`)
            self.buffer,
            geometry,
            nixl_progress_thread=settings.nixl_progress_thread,
            network=transfer_network(settings),
        )
        self.buffer_agent.enforce_grants()  # the kvstore reads only the pages offered it
        self.page_size = geometry.page_size
        self.link: Link | None = None
        self.attached = False
        self.settled = False  # the kvstore answered this link's attach (accepted or not)
        self.disk_tier = False  # the kvstore may read a lookup's pages from disk first
        self.kvstore_agent = ""  # peer name of the host pool's agent in the worker's agent
        self.counters: Counter[str] = Counter({"kv_identity_mismatch_total": 0})  # under _lock
        self.load_seconds = 0.0
        self._lock = threading.Lock()
        self._free = list(range(num_pages - 1, -1, -1))  # buffer pages; under _lock
        self._offers: asyncio.Queue[tuple[list[int], list[int], list[PageProof]]] = asyncio.Queue()
        self._outstanding: dict[int, list[int]] = {}  # spill id -> buffer pages
        self._spill_ids = 0
        self._leases: Replies[HostLease] = Replies()
        self._loading: dict[str, Loading] = {}  # query id -> a loading lease's progress
        self._notices = Tasks(f"{name} host tier")
        self.handlers: Handlers = {HostAttachAck: self._attached, SpillDone: self._spill_done,
                                   HostLease: self._lease, HostPagesReady: self._pages_ready}  # fmt: skip
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
        await self._notices.close()
        self.buffer_agent.close()
        if self.buffer_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.buffer_path)

    # -- the link to the kvstore --------------------------------------------------------

    def on_up(self, link: Link) -> None:
        self.link = link
        msg = HostAttach(self.name, self.generation, self.buffer_agent.metadata())
        self._notices.spawn(send_quietly(link, msg))

    def on_down(self, link: Link, why: str) -> None:
        """The kvstore is gone (or silent): stop spilling. The buffer pages it was reading
        are reused only after `_QUARANTINE_S`, past any deadline of its reads, in case
        it was only silent."""
        self.attached = self.settled = False
        if self.spills:
            self.engine.listen_spills(None)
        self.buffer_agent.revoke(link.name)
        held = [page for pages in self._outstanding.values() for page in pages]
        self._outstanding.clear()
        if held:
            self._loop.call_later(_QUARANTINE_S, self._release_buffer, held)
        self._leases.drop_all()
        for loading in self._loading.values():
            loading.update(0, True)

    def _release_buffer(self, pages: list[int]) -> None:
        with self._lock:
            self._free.extend(pages)

    def on_message(self, link: Link, msg: Message) -> bool:
        """Handle a host-tier message from the kvstore; False if it is not one."""
        return dispatch(self.handlers, link, msg)

    def _spill_done(self, link: Link, msg: SpillDone) -> None:
        pages = self._outstanding.pop(msg.spill_id, None)
        if pages is not None:
            self.buffer_agent.revoke(link.name, pages)
            with self._lock:
                self._free.extend(pages)
                self.counters["host_spill_stored_pages_total"] += msg.stored

    def _attached(self, link: Link, ack: HostAttachAck) -> None:
        self.settled = True
        if not ack.accepted:
            logger.warning("%s: the kvstore refused the host tier: %s", self.name, ack.reason)
            return
        try:
            self.agent.add_peer(link.name, link.generation, ack.metadata)
        except TransferError as exc:
            logger.warning("%s: cannot reach the host tier: %s", self.name, exc)
            return
        self.kvstore_agent = link.name
        self.disk_tier = ack.disk_tier
        self.attached = True
        # a (re)attached tier holds nothing of ours yet: listening starts afresh
        if self.spills:
            self.engine.listen_spills(self._on_spill, self.settings.host_write_through_uses,
                                      self.buffer, self.buffer_path)  # fmt: skip
        logger.info("%s: attached to the host tier of %s (%d pages)", self.name, link.label,
                    ack.num_pages)  # fmt: skip

    # -- spill --------------------------------------------------------------------------

    def _on_spill(self, hashes: list[int], page_ids: list[int], proofs: list[PageProof]) -> None:
        """On the engine thread, before the cache lets ``page_ids`` go: stage them (with
        what their hashes are recomputed from, ``proofs``)."""
        with self._lock:
            n = min(len(page_ids), len(self._free))
            slots = [self._free.pop() for _ in range(n)]
            self.counters["host_spill_dropped_pages_total"] += len(page_ids) - n
        if not n:
            return
        self.engine.copy_out(page_ids[:n], slots)  # on the engine thread: no step runs
        with self._lock:
            self.counters["host_spills_total"] += 1
            self.counters["host_spill_pages_total"] += n
            self.counters["host_spill_bytes_total"] += n * self.page_bytes
        self._loop.call_soon_threadsafe(self._offers.put_nowait, (hashes[:n], slots, proofs[:n]))

    async def _send_offers(self) -> None:
        while True:
            hashes, slots, proofs = await self._offers.get()
            most = min(_MAX_PAGES_PER_OFFER, MAX_TOKENS_PER_MESSAGE // self.page_size)
            while not self._offers.empty() and len(hashes) < most:
                more_hashes, more_slots, more_proofs = self._offers.get_nowait()
                hashes, slots = hashes + more_hashes, slots + more_slots
                proofs = proofs + more_proofs
            link = self.link
            if not self.attached or link is None or not link.up:
                self._release_buffer(slots)
                continue
            self._spill_ids += 1
            self._outstanding[self._spill_ids] = slots
            self.buffer_agent.grant(link.name, slots)
            self._busy.set()
            try:
                offer = spill_offer(self._spill_ids, hashes, slots, proofs)
                await link.send(offer, 0)
            except TimeoutError:
                self.buffer_agent.revoke(link.name, slots)
                self._release_buffer(self._outstanding.pop(self._spill_ids, []))

    def stats(self) -> HostTierSection:
        with self._lock:
            return fill(
                HostTierSection, self.counters,
                host_spill_buffer_free=len(self._free),
                host_spill_refused_reads_total=self.buffer_agent.refused_reads,
                host_spill_buffer_pages=self.buffer.shape[2],
                host_load_seconds_total=self.load_seconds,
                host_attached=int(self.attached),
                # 0 until the kvstore answered the attach: the gateway is not ready
                # meanwhile (a request would compute what the host and disk tiers hold)
                host_attach_settled=int(self.settled),
            )  # fmt: skip
