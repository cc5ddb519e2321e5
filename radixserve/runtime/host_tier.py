"""A worker's side of the kvstore's host-memory tier: spill on eviction, load on a miss.

**Spill.** Pages the radix cache is about to evict (or, with ``host_write_through_uses``
N >= 1, a prefix N requests used) are copied on the engine thread into this worker's
*spill buffer* (a host tensor in the pool layout with a transfer agent of its own), so
the device pages are free at once; the loop offers them to the kvstore (`SpillOffer`),
which reads those it lacks and answers `SpillDone`, and only then is the buffer space
reused. A full buffer drops the pages (counted). The buffer's agent serves only pages
on offer: each offer's pages are granted to the kvstore's agent until its `SpillDone`
(or until its link goes down), so a read of any other buffer page is refused.

**Load** (`plan`, `read`, `release`): only when more than ``host_load_min_tokens`` of a
prompt are missing past its device hit (found in the worker's view of its own cache, so
no engine call waits for a step) does the worker ask the kvstore to lease the longest
run it holds (`HostLookup` -> `HostLease`), checks the tokens the tier stored with those
pages against its prompt's (a page that differs is counted in
``kv_identity_mismatch_total``; the lease is cut before it and the rest of the prompt
computed); the engine's one admission allocates pages
for it, the agent reads the host pages into them and the lease is released. Any failure
ends the load with nothing inserted and the prompt computed. The lookup carries the
worker's measured prefill rate: the kvstore first reads the run's pages that are on its
disk tier into host memory when that is quicker than computing them, and the lease says
how many came from disk (counted as ``tier="disk"`` cached tokens). Such a lease may come
while those pages are still being read (``loading``): the worker then reads the run's
pages into its device pool chunk by chunk as `HostPagesReady` says they are in host
memory, so the two reads overlap.

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
import time
from collections import Counter
from collections.abc import Sequence, Set

import torch

from radixserve.cache.block_hash import leading_held
from radixserve.cache.page_proof import PageProof, tokens_match, unpack_tokens
from radixserve.engine.admission import HostPlan
from radixserve.engine.async_engine import AsyncEngine
from radixserve.protocol import (
    HostAttach,
    HostAttachAck,
    HostLease,
    HostLookup,
    HostPagesReady,
    HostRelease,
    Message,
    SpillDone,
    SpillOffer,
    SpillRun,
)
from radixserve.protocol.stats_messages import HostTierSection, fill
from radixserve.protocol.wire import MAX_TOKENS_PER_MESSAGE
from radixserve.runtime.calls import Replies, Tasks, send_quietly
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


def lookup_wait_s(
    settings: WorkerSettings, num_tokens: int, prefill_tokens_per_s: float, disk_tier: bool
) -> float:
    """How long a lookup of ``num_tokens`` waits for its lease: ``host_lookup_timeout_s``;
    from a kvstore with a disk tier, up to what computing those tokens would take when
    that is longer (at most ``host_load_timeout_s``): a disk read the kvstore chose,
    being quicker than that, is not cut off, and a kvstore that does not answer costs
    no more than computing would."""
    wait_s = settings.host_lookup_timeout_s
    if disk_tier and prefill_tokens_per_s > 0:
        compute_s = num_tokens / prefill_tokens_per_s
        wait_s = max(wait_s, min(compute_s, settings.host_load_timeout_s))
    return wait_s


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


class _Loading:
    """A ``loading`` lease's progress: its leading pages in host memory so far."""

    def __init__(self, ready_pages: int) -> None:
        self.ready_pages = ready_pages
        self.failed = False  # no more pages come
        self.changed = asyncio.Event()

    def update(self, ready_pages: int, failed: bool) -> None:
        self.ready_pages = max(self.ready_pages, ready_pages)
        self.failed = self.failed or failed
        self.changed.set()


#: what the kvstore sends a worker's host tier (`handlers`, in `Worker.kvstore_handlers`)
HostTierFromKVStore = HostAttachAck | SpillDone | HostLease | HostPagesReady


class HostTierClient:
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
        num_pages = max(1, settings.host_spill_buffer_mib * (1 << 20) // self.page_bytes)
        if not spills:
            num_pages = 1
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
        self._loading: dict[str, _Loading] = {}  # query id -> a loading lease's progress
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

    def _lease(self, _link: Link, msg: HostLease) -> None:
        if msg.loading and msg.lease_id:
            self._loading[msg.query_id] = _Loading(msg.ready_pages)
        if not self._leases.answer(msg.query_id, msg) and msg.lease_id:
            self._loading.pop(msg.query_id, None)
            self._notices.spawn(send_quietly(self.link, HostRelease(msg.lease_id)))

    def _pages_ready(self, _link: Link, msg: HostPagesReady) -> None:
        loading = self._loading.get(msg.query_id)
        if loading is not None:
            loading.update(msg.ready_pages, msg.failed)

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
                with self._lock:
                    self._free.extend(slots)
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
                with self._lock:
                    self._free.extend(self._outstanding.pop(self._spill_ids, []))

    # -- load ---------------------------------------------------------------------------

    async def plan(
        self, request_id: str, token_ids: list[int], hashes: Sequence[int]
    ) -> tuple[HostPlan, HostLease] | None:
        """Lease the longest host-tier run past this worker's device hit of the prompt
        ``token_ids``, whose full pages hash to ``hashes``; None when there is nothing to
        gain (no tier; at most ``host_load_min_tokens`` missing on device) or nothing is
        there. The caller admits with the plan, `read`s and `release`s."""
        if not self.attached or len(token_ids) < 2:
            return None
        full = min(len(hashes), (len(token_ids) - 1) // self.page_size)  # never the last token
        # the device hit, from the view of the cache (no step wait)
        device_pages = leading_held(hashes, self.device_hashes, full)
        if (full - device_pages) * self.page_size <= self.settings.host_load_min_tokens:
            return None
        self._count("host_lookups_total")
        lease = await self._lookup(request_id, hashes[device_pages:full])
        if lease is None or not lease.lease_id:
            return None
        start = device_pages * self.page_size
        proved = tokens_match(lease.token_ids, token_ids[start:], self.page_size)
        if proved < len(lease.host_page_ids):  # stored under these hashes, other tokens
            self._count("kv_identity_mismatch_total", len(lease.host_page_ids) - proved)
            logger.warning("%s: %d of %d host-tier pages leased for %s hold other tokens "
                           "than the prompt's; not used", self.name,
                           len(lease.host_page_ids) - proved, len(lease.host_page_ids),
                           request_id)  # fmt: skip
        if not proved:
            self.release(lease)
            return None
        if lease.disk_pages:
            self._count("host_disk_leases_total")
        return HostPlan(device_pages, proved), lease

    def release(self, lease: HostLease) -> None:
        self._loading.pop(lease.query_id, None)
        self._notices.spawn(send_quietly(self.link, HostRelease(lease.lease_id)))

    async def _lookup(self, request_id: str, hashes: Sequence[int]) -> HostLease | None:
        """Ask for a lease of ``hashes``, telling the kvstore this worker's prefill rate
        (it reads pages from its disk tier only when that is quicker than computing
        them); wait `lookup_wait_s`."""
        link = self.link
        if link is None or not link.up:
            return None
        rate = self.engine.stats().prefill_tokens_per_s
        tokens = len(hashes) * self.page_size
        wait_s = lookup_wait_s(self.settings, tokens, rate, self.disk_tier)
        msg = HostLookup(request_id, tuple(hashes), rate, reads_loading=True)
        lease = await self._leases.ask(link, msg, request_id, wait_s)
        if lease is None and self.attached:  # not ended by the link going down
            self._count("host_lookup_timeouts_total")
        return lease

    async def read(self, lease: HostLease, dst: tuple[int, ...]) -> bool:
        """Read the lease's first ``len(dst)`` host pages into the device pages ``dst``
        (of a ``loading`` lease, each part once it is in host memory); whether it
        worked (a failure is logged and counted)."""
        start = time.perf_counter()
        deadline = time.monotonic() + self.settings.host_load_timeout_s
        src = lease.host_page_ids[: len(dst)]
        done, ok = 0, True
        while ok and done < len(dst):
            ready = await self._ready_pages(lease, done, deadline)
            if ready <= done:  # failed, or not in time: nothing more comes
                ok = False
                break
            ok = await self._read_pages(src[done:ready], dst[done:ready])
            done = ready
        if not ok:
            self._count("host_load_failures_total")
            return False
        with self._lock:
            self.counters["host_loads_total"] += 1
            self.counters["host_load_pages_total"] += len(dst)
            self.counters["host_load_bytes_total"] += len(dst) * self.page_bytes
            self.load_seconds += time.perf_counter() - start
        return True

    async def _ready_pages(self, lease: HostLease, done: int, deadline: float) -> int:
        """How many leading pages of ``lease`` are in host memory, waiting (until
        ``deadline``) for more than ``done`` of a loading one."""
        if not lease.loading:
            return len(lease.host_page_ids)
        loading = self._loading.get(lease.query_id)
        if loading is None:  # released meanwhile
            return 0
        while loading.ready_pages <= done and not loading.failed:
            loading.changed.clear()
            try:
                await asyncio.wait_for(loading.changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                logger.warning("%s: host-tier pages from disk did not come in time", self.name)
                break
        return loading.ready_pages

    async def _read_pages(self, src: Sequence[int], dst: Sequence[int]) -> bool:
        """Read host pages ``src`` into device pages ``dst``; whether it worked."""
        agent = self.agent
        try:
            handle = agent.read_pages(
                self.kvstore_agent, list(src), list(dst),
                timeout_s=self.settings.host_load_timeout_s,
            )  # fmt: skip
            return await agent.wait_async(handle) == "done"
        except TransferError as exc:
            logger.warning("%s: host-tier load failed: %s", self.name, exc)
        except asyncio.CancelledError:  # wait_async removed the peer: attach again
            self.attached = False
            if self.link is not None and self.link.up:
                self.on_up(self.link)  # attach again: re-adds the peer
            raise
        return False

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

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
