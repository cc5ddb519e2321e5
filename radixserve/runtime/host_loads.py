"""A worker's loads from the kvstore's host-memory tier (`plan`, `read`, `release`), mixed
into `HostTierClient`.

Only when more than ``host_load_min_tokens`` of a prompt are missing past its device hit
(found in the worker's view of its own cache, so no engine call waits for a step) does
the worker ask the kvstore to lease the longest run it holds (`HostLookup` ->
`HostLease`), checks the tokens the tier stored with those pages against its prompt's (a
page that differs is counted in ``kv_identity_mismatch_total``; the lease is cut before
it and the rest of the prompt computed); the engine's one admission allocates pages for
it, the agent reads the host pages into them and the lease is released. Any failure ends
the load with nothing inserted and the prompt computed. The lookup carries the worker's
measured prefill rate: the kvstore first reads the run's pages that are on its disk tier
into host memory when that is quicker than computing them, and the lease says how many
came from disk (counted as ``tier="disk"`` cached tokens). Such a lease may come while
those pages are still being read (``loading``): the worker then reads the run's pages
into its device pool chunk by chunk as `HostPagesReady` says they are in host memory, so
the two reads overlap.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence, Set
from typing import TYPE_CHECKING

from radixserve.cache.block_hash import leading_held
from radixserve.cache.page_proof import tokens_match
from radixserve.engine.admission import HostPlan
from radixserve.protocol import HostLease, HostLookup, HostPagesReady, HostRelease
from radixserve.runtime.calls import Replies, Tasks, send_quietly
from radixserve.runtime.settings import WorkerSettings
from radixserve.transfer import TransferError

if TYPE_CHECKING:
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.runtime.links import Link
    from radixserve.transfer.group import GroupAgent

logger = logging.getLogger(__name__)


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


class Loading:
    """A ``loading`` lease's progress: its leading pages in host memory so far."""

    def __init__(self, ready_pages: int) -> None:
        self.ready_pages = ready_pages
        self.failed = False  # no more pages come
        self.changed = asyncio.Event()

    def update(self, ready_pages: int, failed: bool) -> None:
        self.ready_pages = max(self.ready_pages, ready_pages)
        self.failed = self.failed or failed
        self.changed.set()


class HostLoads:
    name: str
    settings: WorkerSettings
    engine: AsyncEngine
    agent: GroupAgent
    device_hashes: Set[int]
    link: Link | None
    attached: bool
    disk_tier: bool
    kvstore_agent: str
    page_size: int
    page_bytes: int
    counters: Counter[str]
    load_seconds: float
    _lock: threading.Lock
    _leases: Replies[HostLease]
    _loading: dict[str, Loading]
    _notices: Tasks
    on_up: Callable[[Link], None]  # attaches again

    def _lease(self, _link: Link, msg: HostLease) -> None:
        if msg.loading and msg.lease_id:
            self._loading[msg.query_id] = Loading(msg.ready_pages)
        if not self._leases.answer(msg.query_id, msg) and msg.lease_id:
            self._loading.pop(msg.query_id, None)
            self._notices.spawn(send_quietly(self.link, HostRelease(msg.lease_id)))

    def _pages_ready(self, _link: Link, msg: HostPagesReady) -> None:
        loading = self._loading.get(msg.query_id)
        if loading is not None:
            loading.update(msg.ready_pages, msg.failed)

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
        done = 0
        while done < len(dst):
            ready = await self._ready_pages(lease, done, deadline)
            # ready <= done: failed, or not in time: nothing more comes
            if ready <= done or not await self._read_pages(src[done:ready], dst[done:ready]):
                self._count("host_load_failures_total")
                return False
            done = ready
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
