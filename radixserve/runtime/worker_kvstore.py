"""A worker's side of the cluster's kvstores (`KVStoreMember`, `Worker`'s base): a link
to every kvstore (the index's shards, in order, this node's among them), its membership
there (`Register`, the member view it watches), its part of the global index
(`IndexClient`) and the host tiers: this node's, which it spills into, and the other
nodes', which it only reads (`HostTierClient`). docs/architecture.md §8-§10."""

from __future__ import annotations

import asyncio
import logging

from radixserve.engine.async_engine import AsyncEngine
from radixserve.protocol import IndexReply, KVResync, MemberInfo, MemberList, Message, Register
from radixserve.runtime.calls import send_quietly
from radixserve.runtime.host_tier import HostTierClient
from radixserve.runtime.index_client import IndexClient
from radixserve.runtime.links import Link, LinkSet
from radixserve.runtime.membership import MemberView
from radixserve.runtime.peer_reads import PeerReads
from radixserve.runtime.prefix_load import PrefixSources
from radixserve.runtime.service import Handlers, Service, dispatch
from radixserve.runtime.settings import WorkerSettings
from radixserve.transfer.group import GroupAgent

logger = logging.getLogger(__name__)

#: what the kvstore sends a worker beside the host tier's answers (`HostTierClient`)
WorkerFromKVStore = KVResync | MemberList | IndexReply


class KVStoreMember(Service):
    """A service with an engine that is a member of a cluster's kvstores (with
    ``kvstore`` set: `link_kvstores`), and what it shares with them."""

    settings: WorkerSettings

    def __init__(self, settings: WorkerSettings, engine: AsyncEngine) -> None:
        super().__init__(settings)
        self.engine = engine
        self.page_size = engine.info.page_size
        self.agent: GroupAgent | None = None
        self.kvstore: LinkSet | None = None
        self.host: HostTierClient | None = None  # this node's kvstore's host tier
        # the other nodes' host tiers, by their shard: read from, never spilled into
        self.remote_hosts: dict[int, HostTierClient] = {}
        # the cache's events to the kvstore's index, and questions to it
        self.index = IndexClient(self.name, self.generation, engine, self.counters,
                                 settings.kvstore_query_timeout_s)  # fmt: skip
        self.peer_reads: PeerReads | None = None
        # where a prompt's missing prefix may come from (with a kvstore)
        self.sources: PrefixSources | None = None
        self._kvstore_handlers: Handlers = {}

    def member(self) -> MemberInfo:
        return MemberInfo(
            self.name, self.role, self.advertised_address, self.generation, self.draining
        )

    def member_view(self) -> MemberView | None:
        """Hook: the view of the roles this worker links to (watched through the
        kvstore); None: it watches none."""
        return None

    def link_kvstores(self) -> None:
        """Link to every kvstore, attach the index and the host tiers, and start (the
        transfer agent made)."""
        s, info = self.settings, self.engine.info
        assert self.context is not None and s.kvstore is not None and self.agent is not None
        # every kvstore of the cluster (the index's shards, in order), this node's among
        # them: its host tier is the one this worker spills into
        self.kvstore = kvstores = LinkSet(
            self.context,
            s.index_shards,
            self.identity(),
            on_message=self._from_kvstore,
            on_up=self._kvstore_up,
            on_down=self._kvstore_down,
        )
        self.index.attach(self.name, kvstores.links, s.index_shards.index(s.kvstore))
        if info.prefix_cache:
            if s.host_tier:
                self.host = HostTierClient(self.name, self.generation, s, self.engine,
                                           self.agent, self.index.cached_hashes)  # fmt: skip
                for shard, link in enumerate(kvstores.links):
                    if link.address != s.kvstore:
                        self.remote_hosts[shard] = HostTierClient(
                            self.name, self.generation, s, self.engine, self.agent,
                            self.index.cached_hashes, spills=False)  # fmt: skip
            self.index.listen()
            self.run_in_background(self.index.publish())
        self.sources = PrefixSources(self.index, self.page_size, s.host_load_min_tokens,
                                     self.host, self.remote_hosts, self.peer_reads)  # fmt: skip
        self._kvstore_handlers = self.kvstore_handlers()
        kvstores.start()

    def kvstore_link(self) -> Link | None:
        """The link to this node's kvstore (its host tier)."""
        if self.kvstore is None or self.settings.kvstore is None:
            return None
        return self.kvstore.by_address(self.settings.kvstore)

    async def _to_kvstore(
        self, msg: Message, timeout_ms: int = 0, link: Link | None = None
    ) -> None:
        """``msg`` to ``link``, or to every kvstore that is up (membership is kept by each)."""
        links = [link] if link is not None else self.kvstore.links if self.kvstore else []
        sent = await asyncio.gather(*(send_quietly(each, msg, timeout_ms)
                                      for each in links if each.up))  # fmt: skip
        if not all(sent):
            logger.warning("%s: cannot reach a kvstore with %s", self.name, msg.TYPE_TAG)

    def _kvstore_up(self, link: Link) -> None:
        self.spawn_notice(self._to_kvstore(Register(self.member()), link=link))
        view = self.member_view()
        if view is not None:
            self.spawn_notice(self._to_kvstore(view.watch(), link=link))
        self.index.resync(link)
        host = self._host_tier_of(link)
        if host is not None:
            host.on_up(link)

    def _kvstore_down(self, link: Link, why: str) -> None:
        self.index.link_down(link)
        view = self.member_view()
        if view is not None:
            view.source_down(link.address)
        host = self._host_tier_of(link)
        if host is not None:
            host.on_down(link, why)

    def _host_tier_of(self, link: Link) -> HostTierClient | None:
        """The client of the host tier of the kvstore behind ``link`` (None: none)."""
        if link is self.kvstore_link():
            return self.host
        shard = self.index.shard_of(link)
        return self.remote_hosts.get(shard) if shard is not None else None

    def kvstore_handlers(self) -> Handlers:
        """Hook: the handler of each type of `WorkerFromKVStore`, and the host tier's (a
        subclass adds its own)."""
        host = self.host.handlers if self.host is not None else {}
        return {KVResync: self._resync, MemberList: self._members, IndexReply: self.index.answer,
                **host}  # fmt: skip

    def _from_kvstore(self, link: Link, msg: Message) -> None:
        host = self._host_tier_of(link)
        if host is not None and host is not self.host and host.on_message(link, msg):
            return  # another node's host tier answering
        if not dispatch(self._kvstore_handlers, link, msg):
            logger.warning("%s: unexpected %s from the kvstore", self.name, msg.TYPE_TAG)

    def _members(self, link: Link, msg: MemberList) -> None:
        view = self.member_view()
        if view is not None:  # None: this worker does not watch the membership
            view.apply(msg, link.address)

    def _resync(self, link: Link, _msg: KVResync) -> None:
        self.index.resync(link)
