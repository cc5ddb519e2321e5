"""The kvstore: the cluster-wide radix index of which worker caches which pages.

Workers connect, say `Hello`, and publish `KVEvent`s as pages enter and leave their
device caches; the kvstore applies them to a `GlobalIndex`. An event it cannot apply in
order (a gap in the worker's sequence numbers, a worker it does not know — e.g. after
the kvstore itself restarted — or a new generation of a restarted worker) drops that
worker's entries and answers `KVResync`; the worker replies ``cleared`` plus a snapshot.
A worker that stops heartbeating is dropped from the index, so nothing is routed to a
cache that no longer exists. `IndexQuery` (from the gateway or anyone) gets an
`IndexReply`: per worker, how many leading pages of the query it holds.

The kvstore holds no KV itself (yet): when it is down, serving goes on without the
index, and it rebuilds as workers reconnect and resync.
"""

from __future__ import annotations

import logging

from pydantic_settings import SettingsConfigDict

from radixserve.cache.global_index import GlobalIndex
from radixserve.protocol import IndexQuery, IndexReply, KVEvent, KVResync, Message
from radixserve.services.service import Peer, Service, ServiceSettings

logger = logging.getLogger(__name__)


class KVStoreSettings(ServiceSettings):
    """The kvstore's settings, from ``RADIXSERVE_KVSTORE_*``."""

    model_config = SettingsConfigDict(env_prefix="RADIXSERVE_KVSTORE_", frozen=True, extra="forbid")


class KVStoreService(Service):
    role = "kvstore"

    def __init__(self, settings: KVStoreSettings) -> None:
        super().__init__(settings)
        self.index = GlobalIndex()

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
            reply = IndexReply(msg.query_id, self.index.match(msg.page_hashes))
            self._send_later(peer, reply)
        else:
            super().handle(peer, msg)

    def on_peer_lost(self, peer: Peer) -> None:
        if peer.role in ("prefill", "decode"):
            self.index.drop(peer.name)
            logger.info("%s: dropped %s from the index", self.name, peer.name)

    def load(self) -> dict[str, int | float]:
        stats = super().load()
        stats["index_pages"] = self.index.num_pages
        stats["index_workers"] = len(self.index.workers())
        stats["index_events_total"] = self.index.num_events
        stats["index_resyncs_total"] = self.index.num_resyncs
        lags = [w["since_last_event_s"] for w in self.index.workers().values()]
        stats["index_max_event_age_s"] = max(lags) if lags else 0.0
        return stats

    def _send_later(self, peer: Peer, msg: Message) -> None:
        self.spawn_notice(self.send_to(peer, msg))
