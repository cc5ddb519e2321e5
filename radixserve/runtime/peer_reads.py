"""Pages between workers: what a worker lends (`PageLending`) and what it reads from
another worker's device cache (`PeerReads`).

**Lending.** A worker's pages are read by others only while lent: the engine holds them
under a lease (`Engine.lend_prefix`, or a prefill's `lease_s`) and the transfer agent
serves them to that one reader (`grant`; the ZMQ agent refuses any other read, NIXL's
keeps the ledger), until the reader's `TransferDone`, its link going down, or the lease's
end (the grant ends first: pages the engine takes back are never readable).

**Peer reads** (`plan`, `read`, `release`). When more than ``host_load_min_tokens`` of a
prompt are missing past this worker's device hit, it asks the kvstore's index who holds
more of it (`IndexQuery`). The worker holding the longest run — on device, more than the
host tier holds, its link up (a draining worker still lends) — is asked to lend the
pages past the device hit (`PeerRead`) when reading them is quicker than computing them
(their bytes at the measured peer read rate, against the engine's measured prefill
rate). The owner matches the prompt's tokens in its own cache, so what it lends is what
these tokens computed; it may lend fewer pages, none, or refuse. The engine admits the
request with the lent run as a host-route plan (`Engine.admit(host=)`), the agent reads
the pages into the pages it allocated, and `finish_host_admission(peer=True)` counts
them as ``peer`` cached tokens. Anything that goes wrong — no answer in time, the owner
gone mid-read (its link down ends the read at once), a refusal — ends in the prompt
being computed, never in a page that was not read. Details: docs/architecture.md §9.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.engine.admission import HostPlan
from radixserve.engine.async_engine import AsyncEngine
from radixserve.protocol import RequestFailed, TransferDone
from radixserve.protocol.peer_messages import PeerPages, PeerRead
from radixserve.protocol.stats_messages import PeerReadSection, fill
from radixserve.runtime.calls import Tasks, send_quietly
from radixserve.runtime.links import Link, LinkSet
from radixserve.runtime.membership import MemberView
from radixserve.runtime.settings import WorkerSettings
from radixserve.transfer import TransferError
from radixserve.transfer.group import GroupAgent

logger = logging.getLogger(__name__)

#: the peer read rate assumed until one is measured (bytes/s), and the round trip of
#: asking for the pages (s): a first read is tried whenever computing takes longer
_FIRST_RATE = 1e9
_ASK_S = 0.005
#: how long a drained worker waits for its peers' heartbeats before it lingers: when the
#: whole cluster stops, they say they drain too within it
_SETTLE_S = 0.3


class PageLending:
    """The pages this worker lends, by lease id: to whom, and until when."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.agent: GroupAgent | None = None  # set once the worker made it
        self.counters: Counter[str] = Counter()  # peer reads served
        # lease id -> (reader, pages granted, the revoke timer)
        self._grants: dict[str, tuple[str, list[int], asyncio.TimerHandle]] = {}
        self.readers: dict[str, bytes] = {}  # a peer read's lease id -> reader identity
        self.lending = asyncio.Event()  # set when a lease is handed over

    async def lend(self, reader: str, identity: bytes, msg: PeerRead, lease_s: float) -> PeerPages:
        """Lend ``reader`` (its link's ``identity``) the cached pages its `PeerRead` asks
        for (`Engine.lend_prefix`: the prompt's tokens find them in this cache, in the
        request's namespace) for ``lease_s``; the answer to send it."""
        loop = asyncio.get_running_loop()
        until = loop.time() + lease_s  # the grant ends before the engine's lease
        pages, _ = await self.engine.call(
            lambda e: e.lend_prefix(msg.read_id, msg.token_ids, msg.first_page, msg.num_pages,
                                    lease_s, msg.cache_scope, msg.adapter)
        )  # fmt: skip
        if pages:
            self.readers[msg.read_id] = identity
            self.grant(msg.read_id, reader, pages, until)
            self.counters["peer_lends_total"] += 1
            self.counters["peer_lent_pages_total"] += len(pages)
        return PeerPages(msg.read_id, tuple(pages), max(0.0, until - loop.time()) * 1000)

    def lending_now(self) -> bool:
        """Whether the engine's lease table (the one owner of lease deadlines) holds any."""
        return self.engine.stats().leases > 0

    def grant(self, lease_id: str, reader: str, pages: list[int], until: float) -> None:
        """Lend ``pages`` to ``reader`` until `release`, or the loop's time ``until`` (no
        later than the engine's lease ends)."""
        assert self.agent is not None
        self.agent.grant(reader, pages)
        timer = asyncio.get_running_loop().call_at(until, self.revoke, lease_id)
        self._grants[lease_id] = (reader, pages, timer)
        self.lending.set()

    def revoke(self, lease_id: str) -> None:
        grant = self._grants.pop(lease_id, None)
        if grant is not None and self.agent is not None:
            reader, pages, timer = grant
            timer.cancel()
            self.agent.revoke(reader, pages)

    def release(self, lease_id: str) -> None:
        """The reader is done (or gone): the grant and the engine's lease end."""
        self.readers.pop(lease_id, None)
        self.revoke(lease_id)
        self.engine.release_lease(lease_id)

    def reader_lost(self, identity: bytes) -> None:
        for lease_id, reader in list(self.readers.items()):
            if reader == identity:
                self.release(lease_id)


@dataclass(frozen=True)
class PeerLease:
    """Pages another worker lent for a read: its link, its page ids, the lease's end
    (`time.monotonic`)."""

    read_id: str
    link: Link
    src_page_ids: tuple[int, ...]
    until: float


class PeerReads:
    """This worker's reads of other workers' cached pages (see the module notes)."""

    def __init__(self, name: str, settings: WorkerSettings, engine: AsyncEngine,
                 agent: GroupAgent, links: Callable[[], Iterable[Link]]) -> None:  # fmt: skip
        self.name, self.settings, self.engine, self.agent = name, settings, engine, agent
        self.page_size = engine.info.page_size
        self.page_bytes = engine.info.geometry.page_bytes
        self._links = links
        # read id -> the owner's link and what waits on it (the answer to the ask, then
        # the read), ended with None if the link goes down
        self._waits: dict[str, _Wait] = {}
        self._notices = Tasks(f"{name} peer reads")
        self.counters: Counter[str] = Counter()
        self.read_seconds = 0.0
        self.rate = _FIRST_RATE  # bytes/s of peer reads, a moving average once measured

    # -- plan -----------------------------------------------------------------------

    async def plan(
        self, token_ids: Sequence[int], hashes: Sequence[int], device_pages: int,
        held: Mapping[str, int], host_pages: int, cache_scope: str, adapter: str,
        fingerprint: str,
    ) -> tuple[HostPlan, PeerLease] | None:  # fmt: skip
        """Pages past the ``device_pages`` hit of the prompt ``token_ids`` (whose full
        pages hash to ``hashes``) lent by the peer holding most of them (``held``: each
        worker's run of them past that hit, per the index), when that is more than a host
        tier holds (``host_pages``) and pays; None otherwise. The caller admits with the
        plan, `read`s and `release`s."""
        size = self.page_size
        full = min(len(hashes), (len(token_ids) - 1) // size)  # never the last token
        if (full - device_pages) * size <= self.settings.host_load_min_tokens:
            return None
        links = {link.name: link for link in self._links() if link.up and link.ack is not None}
        owners = sorted(((n, name) for name, n in held.items() if name in links), reverse=True)
        if not owners:
            return None
        num_pages, owner = owners[0]
        num_pages = min(num_pages, full - device_pages)
        if num_pages <= host_pages or num_pages * size <= self.settings.host_load_min_tokens:
            return None  # the host tier has as much, or too little is there to gain
        if not self._pays(num_pages):
            self.counters["peer_reads_skipped_total"] += 1
            return None
        end = (device_pages + num_pages) * size
        msg = PeerRead(uuid.uuid4().hex, tuple(token_ids[:end]), device_pages, num_pages,
                       cache_scope, adapter, fingerprint)  # fmt: skip
        lease = await self._ask(links[owner], msg)
        if lease is None:
            return None
        return HostPlan(device_pages, len(lease.src_page_ids)), lease

    def _pays(self, num_pages: int) -> bool:
        """Whether reading ``num_pages`` at the measured rate beats computing them."""
        tokens_per_s = self.engine.stats().prefill_tokens_per_s
        if tokens_per_s <= 0:
            return True  # nothing measured yet: reading is the better bet
        read_s = _ASK_S + num_pages * self.page_bytes / self.rate
        return read_s < num_pages * self.page_size / tokens_per_s

    async def _ask(self, link: Link, msg: PeerRead) -> PeerLease | None:
        """Send ``msg``; the lease of the pages the owner lent (None: none, refused, no
        answer in time, or its link went down)."""
        self.counters["peer_read_asks_total"] += 1
        wait = self._waits[msg.read_id] = _Wait(link, asking=True)
        try:
            await link.send(msg, timeout_ms=0)
            pages = await asyncio.wait_for(wait.ended, self.settings.peer_read_timeout_s)
        except TimeoutError:
            pages = None
        finally:
            self._waits.pop(msg.read_id, None)
        if pages is None or not pages.src_page_ids:  # a late answer is released (`answer`)
            self.counters["peer_read_refusals_total"] += 1
            return None
        until = time.monotonic() + pages.lease_ms / 1000
        return PeerLease(msg.read_id, link, pages.src_page_ids, until)

    def answer(self, link: Link, msg: PeerPages | RequestFailed) -> bool:
        """An owner's answer to a `PeerRead` (False: not one this worker waits for)."""
        read_id = msg.read_id if isinstance(msg, PeerPages) else msg.request_id
        wait = self._waits.get(read_id)
        if wait is None or wait.link is not link or not wait.asking:
            if isinstance(msg, PeerPages) and msg.src_page_ids:  # too late: let them go
                self._notices.spawn(send_quietly(link, TransferDone(read_id, ok=False)))
            return isinstance(msg, PeerPages)
        wait.end(msg if isinstance(msg, PeerPages) else None)
        if isinstance(msg, RequestFailed):
            logger.info("%s: %s did not lend pages: %s", self.name, link.label, msg.message)
        return True

    def connect(self, link: Link) -> None:
        """Know ``link``'s worker as a transfer peer as soon as its link is up: the
        connection (NIXL's remote agent and the descriptors of its pool's pages) takes
        tens of milliseconds, which the first read from it would pay otherwise."""
        if link.ack is None or not link.ack.transfer_metadata:
            return
        if self.agent.peers.get(link.name) == link.generation:
            return  # its link came back: the connection stands
        try:
            self.agent.add_peer(link.name, link.generation, link.ack.transfer_metadata)
            self.counters["peer_connects_total"] += 1
        except TransferError as exc:  # the read will say it again, and compute instead
            logger.warning("%s: cannot connect to %s for page reads: %s", self.name,
                           link.label, exc)  # fmt: skip

    def link_down(self, link: Link) -> None:
        """``link``'s owner is gone: its answers and reads end now."""
        for wait in self._waits.values():
            if wait.link is link:
                wait.end(None)

    # -- read -------------------------------------------------------------------------

    async def read(self, lease: PeerLease, dst: Sequence[int]) -> bool:
        """Read the lease's first ``len(dst)`` pages into the device pages ``dst``;
        whether it worked (a failure is logged and counted)."""
        link, agent = lease.link, self.agent
        timeout_s = min(self.settings.peer_read_timeout_s, lease.until - time.monotonic())
        start = time.perf_counter()
        ok = False
        if timeout_s > 0 and link.up and link.ack is not None:
            wait = self._waits[lease.read_id] = _Wait(link, asking=False)
            try:
                if agent.peers.get(link.name) != link.generation:  # not connected as it came up
                    self.counters["peer_read_connects_total"] += 1
                agent.add_peer(link.name, link.generation, link.ack.transfer_metadata)
                handle = agent.read_pages(link.name, list(lease.src_page_ids[: len(dst)]),
                                          list(dst), timeout_s=timeout_s)  # fmt: skip
                ok = await _unless(agent.wait_async(handle), wait.ended) == "done"
            except TransferError as exc:
                logger.warning("%s: reading %s's pages failed: %s", self.name, link.label, exc)
            finally:
                self._waits.pop(lease.read_id, None)
        if not ok:
            self.counters["peer_read_failures_total"] += 1
            return False
        elapsed = time.perf_counter() - start
        nbytes = len(dst) * self.page_bytes
        self.counters["peer_reads_total"] += 1
        self.counters["peer_read_pages_total"] += len(dst)
        self.counters["peer_read_bytes_total"] += nbytes
        self.read_seconds += elapsed
        if elapsed > 0:
            self.rate = 0.8 * self.rate + 0.2 * nbytes / elapsed
        return True

    def release(self, lease: PeerLease, ok: bool) -> None:
        """Let the owner's lease go (best effort: it expires anyway)."""
        self._notices.spawn(send_quietly(lease.link, TransferDone(lease.read_id, ok=ok)))

    def stats(self, lending: PageLending) -> PeerReadSection:
        """The reads' counters and ``lending``'s."""
        return fill(PeerReadSection, {**self.counters, **lending.counters},
                    peer_read_seconds_total=self.read_seconds)  # fmt: skip

    async def close(self) -> None:
        await self._notices.close()


class _Wait:
    """What waits on an owner's link for one read id: its answer (``asking``), then the
    read; `end` ends it (with the answer, or None: the link went down)."""

    def __init__(self, link: Link, asking: bool) -> None:
        self.link, self.asking = link, asking
        self.ended: asyncio.Future[PeerPages | None] = asyncio.get_running_loop().create_future()

    def end(self, result: PeerPages | None) -> None:
        if not self.ended.done():
            self.ended.set_result(result)


async def _unless(work: Awaitable[str], down: asyncio.Future[PeerPages | None]) -> str:
    """``work``'s result, or "failed" as soon as ``down`` is done; ``work`` is cancelled
    then, or when this is (the transfer agent forgets the peer first, so a late read
    cannot land in pages the caller frees)."""
    task = asyncio.ensure_future(work)
    either: set[asyncio.Future[Any]] = {task, down}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:  # cancelled itself (the request aborted): the read is stopped first
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if not task.cancelled() else "failed"


class PeerLinks:
    """A worker's links to the other workers, one set per role (a role's set may be the
    worker's own, e.g. a decode worker's to the prefill workers it routes to), kept by
    the kvstore's membership (`view`, which gives no link to the worker itself)."""

    def __init__(self, name: str, sets: dict[str, LinkSet]) -> None:
        self.name = name
        self.sets = sets
        self._made: list[LinkSet] = []
        self.view: MemberView | None = None

    def add(self, role: str, make: Callable[[], LinkSet]) -> None:
        """A set for ``role`` made (and started) here, unless the worker has its own."""
        if role not in self.sets:
            self.sets[role] = make()
            self.sets[role].start()
            self._made.append(self.sets[role])

    def watch(self, name: str) -> None:
        """Let the membership keep the sets from now on; ``name``: this worker's member
        name (known once its port is bound), which gets no link."""
        self.name = name
        if self.sets:
            self.view = MemberView(self.sets, own=self.name)

    def links(self) -> Iterable[Link]:
        return (link for links in self.sets.values() for link in links.links)

    def link_down(self, role: str, link: Link) -> None:
        if self.view is not None:
            self.view.link_down(role, link)

    def serving(self) -> bool:
        """Whether another worker is up and not draining (one that could read our pages)."""
        return any(link.up and not link.load.draining for link in self.links())

    async def close(self) -> None:
        for links in self._made:
            await links.close()


async def linger(name: str, settings: WorkerSettings, links: PeerLinks,
                 lending: PageLending) -> None:  # fmt: skip
    """A drained worker still lends its cached pages for ``drain_linger_s`` (and while a
    lease is out, up to ``peer_lease_s`` more), so the conversations it served continue
    on other workers without recomputing them; not at all, or no longer, when no other
    worker is up and not draining (the whole cluster stops)."""
    linger_s = settings.drain_linger_s
    settle = time.monotonic() + _SETTLE_S  # peers stopping with us say so in that time
    while linger_s > 0 and links.serving() and time.monotonic() < settle:
        await asyncio.sleep(0.05)
    if linger_s <= 0 or not links.serving():
        return
    deadline = time.monotonic() + linger_s
    lease_end = deadline + settings.peer_lease_s
    logger.warning("%s: lending cached pages to other workers for %g s more", name, linger_s)
    while time.monotonic() < lease_end and links.serving():
        if time.monotonic() >= deadline and not lending.lending_now():
            break
        await asyncio.sleep(0.05)
