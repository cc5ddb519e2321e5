"""The kvstore: the cluster-wide radix index, the member registry, and the host-memory tier.

**Index** (`GlobalIndex`): workers publish `KVEvent`s as pages enter and leave their
device caches; an event that cannot be applied in order (a gap, an unknown worker or a
new generation) drops the worker's entries and answers `KVResync`, and a worker that
stops heartbeating is dropped. `IndexQuery` gets an `IndexReply`: per worker, how many
leading pages of the query it holds on device, and how many the host tier holds.
**Membership** (`MemberRegistry`): `Register`, `Deregister` and `WatchMembers` (see
`radixserve.runtime.membership`). **Host tier** (`HostPool`, ``host_capacity_gib`` > 0):
`HostAttach`, `SpillOffer` and `HostLookup` ... `HostRelease` (see
`services.kvstore.host_pool`). **Disk tier** (`DiskPool`, ``disk_tier_dir`` set): what
the host tier evicts is written to files; a `HostLookup` whose run continues on disk
has those pages read back into host memory first, when that is quicker than the worker
computing them, and `IndexReply.host_pages` counts them (see
`services.kvstore.disk_pool`). With a disk tier the kvstore adopts its files at start,
and is not ready (/health, ``disk_tier_ready`` in its stats, which the gateway's
/health waits for) before the pages found can be served. **KV events**
(``kv_events_endpoint`` set): the pages entering and leaving both tiers, in vLLM's
format (see `services.kvstore.tier_events`).

When the kvstore is down serving goes on, and after a restart the index and registry
rebuild as workers reconnect (docs/architecture.md §9, §10).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from radixserve.cache.global_index import GlobalIndex
from radixserve.protocol import (
    Deregister,
    HostAttach,
    HostLookup,
    HostPagesReady,
    HostRelease,
    IndexQuery,
    IndexReply,
    KVEvent,
    KVResync,
    Message,
    Register,
    SpillDone,
    SpillOffer,
    WatchMembers,
)
from radixserve.runtime.kv_events import KVEventPublisher
from radixserve.runtime.service import Peer, Service
from radixserve.services.kvstore.disk_pool import DiskPool
from radixserve.services.kvstore.host_pool import HostPool
from radixserve.services.kvstore.registry import MemberRegistry
from radixserve.services.kvstore.settings import KVStoreSettings
from radixserve.services.kvstore.tier_events import TierEvents

logger = logging.getLogger(__name__)


class KVStoreService(Service):
    role = "kvstore"
    settings: KVStoreSettings

    def __init__(self, settings: KVStoreSettings) -> None:
        super().__init__(settings)
        self.index = GlobalIndex()
        self.registry = MemberRegistry(self.generation)
        self.host: HostPool | None = None
        self.disk: DiskPool | None = None
        self.kv_events: KVEventPublisher | None = None  # vLLM's format, when configured

    async def start(self) -> None:
        s, events = self.settings, None
        if s.kv_events_endpoint is not None:  # first: AllBlocksCleared precedes every page
            self.kv_events = KVEventPublisher(s)
            events = TierEvents(self.kv_events)
            logger.info("%s: KV events on %s (replay: %s)", self.name, self.kv_events.endpoint,
                        self.kv_events.replay_endpoint)  # fmt: skip
        if s.disk_tier_dir is not None:
            self.disk = DiskPool(self.name, s, events)
            self.disk.prepare()  # its files are adopted now: not ready before
        self.host = HostPool(self.name, s, self.disk.stage if self.disk else None, events)
        self.run_in_background(self._refresh_members())

    async def stop(self) -> None:
        if self.disk is not None and self.host is not None and self.host.index is not None:
            flushed = await self.disk.flush(self.host.index, self.settings.disk_flush_s)
            logger.info("%s: %d host-tier pages written to the disk tier", self.name, flushed)
        if self.host is not None:
            await self.host.stop()
        if self.disk is not None:
            await self.disk.stop()
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Not ready while the disk tier adopts the files it found at start (a request
        that came meanwhile would compute what it holds)."""
        ok, detail = super().health()
        if self.disk is not None and not self.disk.loaded:
            ok, detail["disk_tier"] = False, "adopting its files"
        return ok, detail

    def describe(self) -> str:
        s = self.settings
        if not s.host_capacity_gib:
            return ""
        disk = f", disk tier {s.disk_tier_gib:g} GiB in {s.disk_tier_dir}" if self.disk else ""
        return f", host tier {s.host_capacity_gib:g} GiB over {s.transfer_backend}{disk}"

    def handle(self, peer: Peer, msg: Message) -> None:
        if isinstance(msg, KVEvent):
            if msg.worker != peer.name and peer.name != "?":
                logger.warning("%s: %s sent events for %s; ignored", self.name, peer.name,
                               msg.worker)  # fmt: skip
                return
            ok = self.index.apply(msg.worker, msg.generation, msg.seq, msg.kind, msg.page_hashes)
            if not ok:
                logger.info("%s: asking %s to resync (event %d, generation %d)", self.name,
                            msg.worker, msg.seq, msg.generation)  # fmt: skip
                self._send_later(peer, KVResync(f"event {msg.seq} out of order"))
        elif isinstance(msg, IndexQuery):
            hashes = list(msg.page_hashes)
            reply = IndexReply(msg.query_id, self.index.match(hashes), self._tier_pages(hashes))
            self._send_later(peer, reply)
        elif isinstance(msg, HostAttach) and self.host is not None:
            ack = self.host.attach(msg.worker, msg.generation, msg.metadata, peer.identity)
            if ack.accepted and self.disk is not None:
                assert self.host.compat is not None and self.host.kv is not None
                self.disk.open(self.host.compat, self.host.kv)  # once: the pages' layout
                ack = dataclasses.replace(ack, disk_tier=self.disk.down is None)
            self._send_later(peer, ack)
        elif isinstance(msg, Register):
            if self.registry.register(msg.member, peer.identity):
                logger.info("%s: member %s (%s) at %s%s", self.name, msg.member.name,
                            msg.member.role, msg.member.address,
                            " is draining" if msg.member.draining else "")  # fmt: skip
                self._tell_watchers()
        elif isinstance(msg, Deregister):
            if self.registry.deregister(msg.name, msg.generation):
                logger.info("%s: member %s left", self.name, msg.name)
                self._tell_watchers()
        elif isinstance(msg, WatchMembers):
            self.registry.watch(peer.identity, msg.roles)
            self._send_later(peer, self.registry.listing(msg.roles))
        elif isinstance(msg, SpillOffer) and self.host is not None:
            self.spawn_notice(self._spill(peer, msg))
        elif isinstance(msg, HostLookup) and self.host is not None:
            self.spawn_notice(self._lookup(peer, msg))
        elif isinstance(msg, HostRelease) and self.host is not None:
            self.host.release(msg.lease_id)
        else:
            super().handle(peer, msg)

    def _tier_pages(self, hashes: list[int]) -> int:
        """Leading pages of ``hashes`` a worker can load from the kvstore (host or disk)."""
        if self.host is None or self.host.index is None:
            return 0
        if self.disk is not None:
            return len(self.disk.run(hashes, self.host.index))
        return self.host.match(hashes)

    def _worker(self, peer: Peer) -> str:
        """Whose pages ``peer`` spills and leases: its name, or for a connection that spoke
        before its hello, the worker that attached on it (`HostPool.worker_on`)."""
        return self.host.worker_on(peer.identity, peer.name) if self.host else peer.name

    async def _lookup(self, peer: Peer, msg: HostLookup) -> None:
        """Lease the run of ``msg``'s hashes, after reading its disk pages into host
        memory where that beats the worker computing them (`_promote`: with
        ``disk_read_overlap`` the lease may go out first, the worker reading meanwhile)."""
        assert self.host is not None
        promoted: set[int] = set()
        if self.disk is not None and self.host.index is not None:
            promoted, leased = await self._promote(peer, msg)
            if leased:
                return
        lease = self.host.lookup(self._worker(peer), msg)
        if promoted:
            leased_hashes = msg.page_hashes[: len(lease.host_page_ids)]
            lease = dataclasses.replace(lease, disk_pages=sum(h in promoted for h in leased_hashes))
        await self.send_to(peer, lease)

    async def _promote(self, peer: Peer, msg: HostLookup) -> tuple[set[int], bool]:
        """`DiskPool.promote` for ``msg``: the hashes read from disk, and whether the
        lease went out already (overlapped, for a worker that `reads_loading`: as soon
        as the host pages were reserved, followed by a `HostPagesReady` per chunk)."""
        assert self.host is not None and self.host.index is not None and self.disk is not None
        leased = False

        async def on_plan(run: list[int], ready: int) -> None:
            nonlocal leased
            host, disk = self.host, self.disk
            lease = (
                host.lease_loading(self._worker(peer), msg, run, ready, disk.index.proof)
                if host is not None and disk is not None
                else None
            )
            if lease is not None:
                leased = True
                await self.send_to(peer, lease)

        async def on_ready(ready: int, failed: bool) -> None:
            await self.send_to(peer, HostPagesReady(msg.query_id, ready, failed))

        index, rate = self.host.index, msg.prefill_tokens_per_s
        if not (self.settings.disk_read_overlap and msg.reads_loading):
            return await self.disk.promote(msg.page_hashes, index, rate), False
        promoted = await self.disk.promote(msg.page_hashes, index, rate, on_plan, on_ready)
        return promoted, leased

    async def _spill(self, peer: Peer, offer: SpillOffer) -> None:
        assert self.host is not None
        stored = await self.host.spill(self._worker(peer), offer)
        await self.send_to(peer, SpillDone(offer.spill_id, stored))

    def _tell_watchers(self) -> None:
        for connection, listing in self.registry.watchers():
            peer = self.peers.get(connection)
            if peer is not None:
                self._send_later(peer, listing)

    async def _refresh_members(self) -> None:
        """Repeat the member list now and then: a watcher that missed one catches up."""
        while True:
            await asyncio.sleep(self.settings.member_refresh_s)
            self._tell_watchers()

    def on_peer_lost(self, peer: Peer) -> None:
        gone = self.registry.drop_connection(peer.identity)
        if gone:
            logger.warning("%s: member(s) %s went silent; dropped", self.name, ", ".join(gone))
            self._tell_watchers()
        if peer.role in ("prefill", "decode"):
            self.index.drop(peer.name)
            if self.host is not None:
                self.host.detach(peer.name, peer.identity)
            logger.info("%s: dropped %s from the index", self.name, peer.name)

    def stats(self) -> dict[str, int | float]:
        stats = super().stats()
        stats.update(self.registry.stats())
        stats["index_pages"] = self.index.num_pages
        stats["index_workers"] = len(self.index.workers())
        stats["index_events_total"] = self.index.num_events
        stats["index_resyncs_total"] = self.index.num_resyncs
        lags = [w["since_last_event_s"] for w in self.index.workers().values()]
        stats["index_max_event_age_s"] = max(lags) if lags else 0.0
        mismatches = 0  # pages refused by the host tier's and the disk tier's checks
        if self.host is not None:
            stats.update(self.host.stats())
            mismatches += self.host.counters["kv_identity_mismatch_total"]
        if self.disk is not None:
            stats.update(self.disk.stats())
            stats["disk_tier_ready"] = int(self.disk.loaded)
            mismatches += self.disk.counters["kv_identity_mismatch_total"]
        stats["kv_identity_mismatch_total"] = mismatches
        return stats

    def _send_later(self, peer: Peer, msg: Message) -> None:
        self.spawn_notice(self.send_to(peer, msg))
