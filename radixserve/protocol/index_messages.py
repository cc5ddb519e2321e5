"""The kvstore's cluster-wide index of cached pages (`KVEvent`, `KVResync`, `IndexQuery`,
`IndexReply`) and the cluster's membership (`Register`, `Deregister`, `WatchMembers`,
`MemberList`). Part of the protocol of `radixserve.protocol.messages`, which registers
them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

from radixserve.protocol.fields import (
    COUNT,
    ERROR_TEXT,
    LOAD_STATS,
    MAX_NAME_CHARS,
    PAGE_HASHES,
    PEER_NAME,
    REQUEST_ID,
    ROLE,
    Role,
)
from radixserve.protocol.wire import (
    BoolSpec,
    IntSpec,
    ListSpec,
    Message,
    NestedSpec,
    StrSpec,
    WireStruct,
)
from radixserve.protocol.wire import field_spec as _spec

# --- the kvstore: cluster-wide index of cached pages ---------------------------------

#: the most kvstores the cache index is sharded over
MAX_SHARDS = 64

KV_EVENT_KINDS: frozenset[str] = frozenset({"stored", "removed", "cleared"})


@dataclass(frozen=True)
class KVEvent(Message):
    """Worker -> kvstore: pages entered (``stored``) or left (``removed``) its device cache,
    or it dropped everything (``cleared``). ``seq`` counts this worker's events from 1 per
    generation; a gap tells the kvstore it missed some and must resync the worker."""

    TYPE_TAG: ClassVar[str] = "kv_event"
    worker: str = field(metadata=_spec(PEER_NAME))
    generation: int = field(metadata=_spec(COUNT))
    seq: int = field(metadata=_spec(IntSpec(1)))
    kind: str = field(metadata=_spec(StrSpec(16, choices=KV_EVENT_KINDS)))
    page_hashes: tuple[int, ...] = field(default=(), metadata=_spec(PAGE_HASHES))


@dataclass(frozen=True)
class KVResync(Message):
    """Kvstore -> worker: send ``cleared`` and then every cached page as ``stored``."""

    TYPE_TAG: ClassVar[str] = "kv_resync"
    reason: str = field(default="", metadata=_spec(ERROR_TEXT))


@dataclass(frozen=True)
class IndexQuery(Message):
    """Anyone -> kvstore: which workers hold how long a prefix of these chained page
    hashes (the pages of a prompt, `radixserve.cache.block_hash.page_hashes`)?"""

    TYPE_TAG: ClassVar[str] = "index_query"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    page_hashes: tuple[int, ...] = field(metadata=_spec(PAGE_HASHES))
    # the index sharded over ``shards`` kvstores by page hash: answer for the hashes this
    # one owns (``hash % shards == shard``), each worker's deepest page held among them
    # (`GlobalIndex.deepest`); 1 shard: the leading run (`GlobalIndex.match`)
    shard: int = field(default=0, metadata=_spec(IntSpec(0, MAX_SHARDS - 1)))
    shards: int = field(default=1, metadata=_spec(IntSpec(1, MAX_SHARDS)))


@dataclass(frozen=True)
class IndexReply(Message):
    """Kvstore -> asker: leading pages of the query each worker holds on device (workers
    with 0 left out; of a sharded query, up to each one's deepest page among the shard's),
    and ``host_pages``: leading pages any worker can load from this kvstore's tiers (host
    memory, or disk, promoted through host memory)."""

    TYPE_TAG: ClassVar[str] = "index_reply"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    device_pages: Mapping[str, int | float] = field(
        default_factory=lambda: MappingProxyType({}), metadata=_spec(LOAD_STATS)
    )
    host_pages: int = field(default=0, metadata=_spec(COUNT))


# --- membership: which services make up the cluster ----------------------------------

MAX_MEMBERS = 4096


@dataclass(frozen=True)
class MemberInfo(WireStruct):
    """One service of the cluster as the kvstore's registry knows it: reachable at
    ``address`` (its control socket, as others must dial it)."""

    name: str = field(metadata=_spec(PEER_NAME))
    role: Role = field(metadata=_spec(ROLE))
    address: str = field(metadata=_spec(StrSpec(MAX_NAME_CHARS * 2, min_chars=1)))
    generation: int = field(default=0, metadata=_spec(COUNT))
    draining: bool = field(default=False, metadata=_spec(BoolSpec()))


@dataclass(frozen=True)
class Register(Message):
    """Service -> kvstore: ``member`` is in the cluster (sent on connecting and whenever
    its state changes, e.g. when it starts draining)."""

    TYPE_TAG: ClassVar[str] = "register"
    member: MemberInfo = field(metadata=_spec(NestedSpec(MemberInfo)))


@dataclass(frozen=True)
class Deregister(Message):
    """Service -> kvstore: it leaves the cluster now (its drain is done)."""

    TYPE_TAG: ClassVar[str] = "deregister"
    name: str = field(metadata=_spec(PEER_NAME))
    generation: int = field(default=0, metadata=_spec(COUNT))


@dataclass(frozen=True)
class WatchMembers(Message):
    """Anyone -> kvstore: send me the members of these ``roles`` now and on every change."""

    TYPE_TAG: ClassVar[str] = "watch_members"
    roles: tuple[str, ...] = field(default=(), metadata=_spec(ListSpec(ROLE, 8)))


@dataclass(frozen=True)
class MemberList(Message):
    """Kvstore -> watcher: every registered member of the watched roles. ``epoch`` is the
    kvstore's generation (a new one starts with an empty registry that fills as services
    register again); ``version`` grows with every change within an epoch."""

    TYPE_TAG: ClassVar[str] = "member_list"
    epoch: int = field(metadata=_spec(COUNT))
    version: int = field(metadata=_spec(COUNT))
    members: tuple[MemberInfo, ...] = field(
        default=(), metadata=_spec(ListSpec(NestedSpec(MemberInfo), MAX_MEMBERS))
    )
