"""The kvstore: the cluster-wide radix index, the member registry, and the KV tiers.

**Index** (`GlobalIndex`): workers publish `KVEvent`s as pages enter and leave their
device caches; an event that cannot be applied in order (a gap, an unknown worker or a
new generation) drops the worker's entries and answers `KVResync`, and a worker that
stops heartbeating is dropped. `IndexQuery` gets an `IndexReply`: per worker, how many
leading pages of the query it holds on device, and how many the tiers hold.
**Membership** (`MemberRegistry`): `Register`, `Deregister` and `WatchMembers` (see
`radixserve.runtime.membership`). **Tiers** (`services.kvstore.tier`), fastest first:
the host tier (`HostPool`, ``host_capacity_gib`` > 0) serves `HostAttach`, `SpillOffer`
and `HostLookup` ... `HostRelease`; the tiers the ``tiers`` setting lists below it (the
disk tier, `DiskPool`, when ``disk_tier_dir`` is set) keep what it evicts, and a lookup
whose run continues there has those pages promoted into host memory first when that
beats the worker computing them (`services.kvstore.promotion`). A tier that adopts
what it found at start keeps the kvstore not ready until it is done (/health,
``disk_tier_ready``, which the gateway's /health waits for). **KV events**
(``kv_events_endpoint`` set): the pages entering and leaving the tiers, in vLLM's
format (`services.kvstore.tier_events`).

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
from radixserve.protocol.stats_messages import (
    DiskPoolSection,
    HostPoolSection,
    KVStoreSection,
    ServiceStats,
    fill,
)
from radixserve.protocol.wire import WireStruct
from radixserve.runtime.kv_events import KVEventPublisher
from radixserve.runtime.service import Handlers, Peer, Service
from radixserve.services.kvstore.host_pool import HostPool
from radixserve.services.kvstore.promotion import Promotion
from radixserve.services.kvstore.registry import MemberRegistry
from radixserve.services.kvstore.settings import KVStoreSettings
from radixserve.services.kvstore.tier import KVTier, build_tiers
from radixserve.services.kvstore.tier_events import TierEvents

logger = logging.getLogger(__name__)


#: the heartbeat's section of each tier that has one, by tier name
_SECTIONS: dict[str, type[WireStruct]] = {"host": HostPoolSection, "disk": DiskPoolSection}


class KVStoreService(Service):
    role = "kvstore"
    settings: KVStoreSettings

    def __init__(self, settings: KVStoreSettings) -> None:
        super().__init__(settings)
        self.index = GlobalIndex()
        self.registry = MemberRegistry(self.generation)
        self.tiers: list[KVTier] = []  # fastest first: the host tier, then those below it
        self.host: HostPool | None = None  # tiers[0]: the one workers speak to
        self.promotion: Promotion | None = None  # from the tiers below into the host tier
        self.kv_events: KVEventPublisher | None = None  # vLLM's format, when configured

    async def start(self) -> None:
        s, events = self.settings, None
        if s.kv_events_endpoint is not None:  # first: AllBlocksCleared precedes every page
            self.kv_events = KVEventPublisher(s)
            events = TierEvents(self.kv_events)
            logger.info("%s: KV events on %s (replay: %s)", self.name, self.kv_events.endpoint,
                        self.kv_events.replay_endpoint)  # fmt: skip
        below = build_tiers(self.name, s, s.tiers, events)  # each adopts its pages from now
        self.host = HostPool(self.name, s, below, events)
        self.tiers, self.promotion = [self.host, *below], Promotion(self.host, below)
        self.run_in_background(self._refresh_members())

    async def stop(self) -> None:
        host = self.host
        if host is not None and host.index is not None and self.promotion is not None:
            for tier in self.promotion.below:
                flushed = await tier.flush(host.stored_pages())
                logger.info("%s: %d host-tier pages written to the %s tier", self.name,
                            flushed, tier.tier_name)  # fmt: skip
        for tier in self.tiers:
            await tier.stop()
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Not ready while a tier adopts what it found at start (the disk tier its files:
        a request that came meanwhile would compute what it holds)."""
        ok, detail = super().health()
        for tier in self.tiers:
            if not tier.loaded:
                ok, detail[f"{tier.tier_name}_tier"] = False, "adopting its files"
        return ok, detail

    def describe(self) -> str:
        s = self.settings
        if not s.host_capacity_gib:
            return ""
        disk = f" {s.disk_tier_gib:g} GiB in {s.disk_tier_dir}"
        below = "".join(f", {t.tier_name} tier{disk if t.tier_name == 'disk' else ''}"
                        for t in self.tiers[1:])  # fmt: skip
        return f", host tier {s.host_capacity_gib:g} GiB over {s.transfer_backend}{below}"

    def handlers(self) -> Handlers:
        return {KVEvent: self._apply_event, IndexQuery: self._answer_query,
                Register: self._register, Deregister: self._deregister, WatchMembers: self._watch,
                HostAttach: self._attach, SpillOffer: self._spill, HostLookup: self._lease,
                HostRelease: self._release}  # fmt: skip

    # -- the index and the membership -------------------------------------------------

    def _apply_event(self, peer: Peer, msg: KVEvent) -> None:
        if msg.worker != peer.name and peer.name != "?":
            logger.warning("%s: %s sent events for %s; ignored", self.name, peer.name,
                           msg.worker)  # fmt: skip
            return
        if not self.index.apply(msg.worker, msg.generation, msg.seq, msg.kind, msg.page_hashes):
            logger.info("%s: asking %s to resync (event %d, generation %d)", self.name,
                        msg.worker, msg.seq, msg.generation)  # fmt: skip
            self._send_later(peer, KVResync(f"event {msg.seq} out of order"))

    def _answer_query(self, peer: Peer, msg: IndexQuery) -> None:
        """Per worker its device pages of the query; and the leading pages a worker can
        load from the kvstore's tiers."""
        hashes = list(msg.page_hashes)
        tier_pages = len(self.promotion.run(hashes)) if self.promotion is not None else 0
        if msg.shards > 1:  # one shard of the index: its hashes only
            held = self.index.deepest(hashes, msg.shard, msg.shards)
        else:
            held = self.index.match(hashes)
        self._send_later(peer, IndexReply(msg.query_id, held, tier_pages))

    def _register(self, peer: Peer, msg: Register) -> None:
        if self.registry.register(msg.member, peer.identity):
            logger.info("%s: member %s (%s) at %s%s", self.name, msg.member.name,
                        msg.member.role, msg.member.address,
                        " is draining" if msg.member.draining else "")  # fmt: skip
            self._tell_watchers()

    def _deregister(self, peer: Peer, msg: Deregister) -> None:
        if self.registry.deregister(msg.name, msg.generation):
            logger.info("%s: member %s left", self.name, msg.name)
            self._tell_watchers()

    def _watch(self, peer: Peer, msg: WatchMembers) -> None:
        self.registry.watch(peer.identity, msg.roles)
        self._send_later(peer, self.registry.listing(msg.roles))

    # -- the tiers ----------------------------------------------------------------------

    def _attach(self, peer: Peer, msg: HostAttach) -> None:
        """The host tier lets the worker in (allocating its pool on the first attach);
        the tiers below it open for the pages' layout then."""
        assert self.host is not None and self.promotion is not None
        ack = self.host.attach(msg.worker, msg.generation, msg.metadata, peer.identity)
        if ack.accepted and self.promotion.below:
            assert self.host.compat is not None and self.host.kv is not None
            serving = [t.open(self.host.compat, self.host.kv) for t in self.promotion.below]
            ack = dataclasses.replace(ack, disk_tier=any(serving))
        self._send_later(peer, ack)

    async def _spill(self, peer: Peer, offer: SpillOffer) -> None:
        assert self.host is not None
        stored = await self.host.spill(self._worker(peer), offer)
        await self.send_to(peer, SpillDone(offer.spill_id, stored))

    def _release(self, peer: Peer, msg: HostRelease) -> None:
        assert self.host is not None
        self.host.release(msg.lease_id)

    def _worker(self, peer: Peer) -> str:
        """Whose pages ``peer`` spills and leases: its name, or for a connection that spoke
        before its hello, the worker that attached on it (`HostPool.worker_on`)."""
        return self.host.worker_on(peer.identity, peer.name) if self.host else peer.name

    async def _lease(self, peer: Peer, msg: HostLookup) -> None:
        """Lease the run of ``msg``'s hashes, after reading its pages held below the host
        tier into host memory where that beats the worker computing them (`_promote`:
        with ``disk_read_overlap`` the lease may go out first, the worker reading
        meanwhile)."""
        assert self.host is not None and self.promotion is not None
        promoted: set[int] = set()
        if self.promotion.below and self.host.index is not None:
            promoted, leased = await self._promote(peer, msg)
            if leased:
                return
        lease = self.host.lookup(self._worker(peer), msg)
        if promoted:
            leased_hashes = msg.page_hashes[: len(lease.host_page_ids)]
            lease = dataclasses.replace(lease, disk_pages=sum(h in promoted for h in leased_hashes))
        await self.send_to(peer, lease)

    async def _promote(self, peer: Peer, msg: HostLookup) -> tuple[set[int], bool]:
        """`Promotion.promote` for ``msg``: the hashes read from the tiers below, and
        whether the lease went out already (overlapped, for a worker that
        `reads_loading`: as soon as the host pages were reserved, followed by a
        `HostPagesReady` per chunk)."""
        host, promotion = self.host, self.promotion
        assert host is not None and promotion is not None
        leased = False

        async def on_plan(run: list[int], ready: int) -> None:
            nonlocal leased
            leased = True
            lease = host.lease_loading(self._worker(peer), msg, run, ready, promotion.proof)
            await self.send_to(peer, lease)

        async def on_ready(ready: int, failed: bool) -> None:
            await self.send_to(peer, HostPagesReady(msg.query_id, ready, failed))

        rate = msg.prefill_tokens_per_s
        if not (self.settings.disk_read_overlap and msg.reads_loading):
            return await promotion.promote(msg.page_hashes, rate), False
        promoted = await promotion.promote(msg.page_hashes, rate, on_plan, on_ready)
        return promoted, leased

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

    def stats(self) -> ServiceStats:
        """The service's numbers and the kvstore's (`store_stats`), typed."""
        flat = self.store_stats()
        sections = {t.tier_name: fill(_SECTIONS[t.tier_name], flat)
                    for t in self.tiers if t.tier_name in _SECTIONS}  # fmt: skip
        kvstore = fill(KVStoreSection, flat, **sections)
        return dataclasses.replace(super().stats(), kvstore=kvstore)

    def store_stats(self) -> dict[str, int | float]:
        """The membership's, the index's and the tiers' numbers, by field name."""
        stats: dict[str, int | float] = dict(self.registry.stats())
        stats["index_pages"] = self.index.num_pages
        stats["index_workers"] = len(self.index.workers())
        stats["index_events_total"] = self.index.num_events
        stats["index_resyncs_total"] = self.index.num_resyncs
        lags = [w["since_last_event_s"] for w in self.index.workers().values()]
        stats["index_max_event_age_s"] = max(lags) if lags else 0.0
        mismatches = 0  # pages refused by the tiers' checks
        for i, tier in enumerate(self.tiers):
            own = tier.stats()
            mismatches += int(own.pop("kv_identity_mismatch_total", 0))
            stats.update(own)
            if i:  # a tier below the host: whether it is ready
                stats[f"{tier.tier_name}_tier_ready"] = int(tier.loaded)
        stats["kv_identity_mismatch_total"] = mismatches
        return stats

    def _send_later(self, peer: Peer, msg: Message) -> None:
        self.spawn_notice(self.send_to(peer, msg))
