"""`PrefixLoad`: a prompt's prefix past the device hit, leased from a tier a worker reads
into its own pages — a kvstore's host tier (`HostTierClient`) or another worker's
device cache (`PeerReads`) — as one thing the admission handles the same way: the
engine's plan, the read, the release, and how its tokens are counted; and
`PrefixSources`, which picks where a prompt's missing prefix comes from."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from radixserve.engine.admission import HostPlan
from radixserve.protocol import HostLease
from radixserve.protocol.stats_messages import HostTierSection
from radixserve.runtime.host_tier import HostTierClient
from radixserve.runtime.index_client import IndexClient
from radixserve.runtime.peer_reads import PeerLease, PeerReads


@dataclass(frozen=True)
class PrefixLoad:
    """A leased prefix: ``plan`` for `Engine.admit`, ``read`` into the pages it
    allocated (whether it worked), ``release`` once done (whether it was read), the tier
    its tokens count in (``disk_pages`` of a host-tier load came from disk) and its
    span's name and attributes."""

    plan: HostPlan
    tier: Literal["host", "peer"]
    read: Callable[[Sequence[int]], Awaitable[bool]]
    release: Callable[[bool], None]
    disk_pages: int = 0
    span: str = ""
    attributes: Mapping[str, int | str] = field(default_factory=dict)


def host_load(client: HostTierClient, plan: HostPlan, lease: HostLease) -> PrefixLoad:
    """A host-tier lease (`HostTierClient.plan`) as a `PrefixLoad`."""
    return PrefixLoad(
        plan, "host", lambda dst: client.read(lease, tuple(dst)), lambda _ok: client.release(lease),
        lease.disk_pages, "host_load",
        {"host_pages": len(lease.host_page_ids), "disk_pages": lease.disk_pages},
    )  # fmt: skip


def peer_load(reads: PeerReads, plan: HostPlan, lease: PeerLease) -> PrefixLoad:
    """A peer's lent pages (`PeerReads.plan`) as a `PrefixLoad`."""
    return PrefixLoad(
        plan, "peer", lambda dst: reads.read(lease, dst), lambda ok: reads.release(lease, ok),
        0, "peer_read", {"peer": lease.link.label, "peer_pages": len(lease.src_page_ids)},
    )  # fmt: skip


@dataclass
class PrefixSources:
    """Where a worker's prompts' missing prefixes can come from: its node's host tier
    (``host``), other nodes' host tiers (``remote_hosts``, by their index shard) and
    other workers' device caches (``peer_reads``), with the index saying who holds what
    (docs/architecture.md §9)."""

    index: IndexClient
    page_size: int
    min_tokens: int  # a load is considered only past this many missing tokens
    host: HostTierClient | None = None
    remote_hosts: dict[int, HostTierClient] = field(default_factory=dict)
    peer_reads: PeerReads | None = None

    async def plan(
        self, request_id: str, known: Sequence[int], hashes: Sequence[int], cache_scope: str,
        adapter: str, fingerprint: str,
    ) -> PrefixLoad | None:  # fmt: skip
        """The prefix of ``known`` (whose full pages hash to ``hashes``) past the device
        hit, from where most of it is: a peer's device cache, when one holds more than
        this node's host tier (`PeerReads.plan`); else this node's host tier, or another
        node's when it holds more (per the index); None if none has enough. The index is
        asked only when a peer or another node could serve."""
        host = self.host
        device_pages = self.index.device_hit(hashes)
        full = min(len(hashes), (len(known) - 1) // self.page_size)  # never the last token
        missing = (full - device_pages) * self.page_size
        if missing > self.min_tokens and (self.peer_reads is not None or self.remote_hosts):
            held, hosts = await self.index.lookup_tiers(hashes[device_pages:full])
            home = hosts.get(self.index.home, 0)
            remote = max(((pages, shard) for shard, pages in hosts.items()
                          if shard in self.remote_hosts and self.remote_hosts[shard].attached),
                         default=(0, -1))  # fmt: skip
            if self.peer_reads is not None:  # a peer's device pages over another node's host
                peer = await self.peer_reads.plan(known, hashes, device_pages, held, home,
                                                  cache_scope, adapter, fingerprint)  # fmt: skip
                if peer is not None:
                    return peer_load(self.peer_reads, *peer)
            if remote[0] > home:
                host = self.remote_hosts[remote[1]]
        planned = await host.plan(request_id, list(known), hashes) if host else None
        return host_load(host, *planned) if host and planned else None

    def host_stats(self) -> HostTierSection | None:
        """This node's host tier's numbers, with the loads from other nodes' tiers."""
        if self.host is None:
            return None
        own = self.host.stats()
        if not self.remote_hosts:
            return own
        remote = [r.stats() for r in self.remote_hosts.values()]
        return dataclasses.replace(
            own,
            host_remote_loads_total=sum(r.host_loads_total for r in remote),
            host_remote_load_pages_total=sum(r.host_load_pages_total for r in remote),
            host_lookups_total=own.host_lookups_total + sum(r.host_lookups_total for r in remote),
        )
