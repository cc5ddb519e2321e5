"""`PrefixLoad`: a prompt's prefix past the device hit, leased from a tier a worker reads
into its own pages — the kvstore's host tier (`HostTierClient`) or another worker's
device cache (`PeerReads`) — as one thing the admission handles the same way: the
engine's plan, the read, the release, and how its tokens are counted."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from radixserve.engine.admission import HostPlan
from radixserve.protocol import HostLease
from radixserve.runtime.host_tier import HostTierClient
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
