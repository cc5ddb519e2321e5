"""The operator's view over the wire: a worker's radix tree and live requests
(`CacheTreeQuery` / `CacheTreeReply`) and the cache audit's all-clear. Part of the
protocol of `radixserve.protocol.messages`, which registers them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from radixserve.protocol.cached_tokens import CACHED, CachedTokens
from radixserve.protocol.fields import COUNT, REQUEST_ID
from radixserve.protocol.wire import (
    BoolSpec,
    FloatSpec,
    IntSpec,
    ListSpec,
    Message,
    NestedSpec,
    StrSpec,
    WireStruct,
)
from radixserve.protocol.wire import field_spec as _spec

# --- the operator's view: a worker's radix tree and live requests --------------------

MAX_TREE_NODES = 1024
MAX_NODE_TEXT_TOKENS = 64
MAX_IDS_PER_NODE = 16
REQUEST_PHASES: frozenset[str] = frozenset(
    {"queued", "host_load", "awaiting_kv", "prefill", "decode", "leased"}
)
REQUEST_IDS = ListSpec(REQUEST_ID, MAX_IDS_PER_NODE)


@dataclass(frozen=True)
class CacheNodeView(WireStruct):
    """One node of a worker's radix tree as the explorer draws it. ``num_tokens``: its
    own run of tokens, ``prefix_tokens``: the prefix it ends; ``subtree_pages``: pages
    held by it and its descendants; ``locks``: its lock count (`RadixNode.lock_ref`);
    ``last_hit_s``: wall-clock time of its latest hit (0: none); ``text``: its first
    tokens as text, empty unless the asker asked for text; ``recent_request_ids`` /
    ``live_request_ids``: requests whose cached prefix ended at or below it, latest
    first / requests running from it now."""

    node_id: int = field(metadata=_spec(COUNT))
    parent_id: int = field(default=0, metadata=_spec(COUNT))  # 0: a child of the root
    num_tokens: int = field(default=0, metadata=_spec(COUNT))
    prefix_tokens: int = field(default=0, metadata=_spec(COUNT))
    num_pages: int = field(default=0, metadata=_spec(COUNT))
    subtree_pages: int = field(default=0, metadata=_spec(COUNT))
    hits: int = field(default=0, metadata=_spec(COUNT))
    locks: int = field(default=0, metadata=_spec(COUNT))
    last_hit_s: float = field(default=0.0, metadata=_spec(FloatSpec(0.0, 1e13)))
    text: str = field(default="", metadata=_spec(StrSpec(MAX_NODE_TEXT_TOKENS * 64)))
    recent_request_ids: tuple[str, ...] = field(default=(), metadata=_spec(REQUEST_IDS))
    live_request_ids: tuple[str, ...] = field(default=(), metadata=_spec(REQUEST_IDS))


@dataclass(frozen=True)
class LiveRequestView(WireStruct):
    """A request a worker holds now and its phase: ``queued`` (waiting for a step),
    ``host_load`` (reading host-tier pages), ``awaiting_kv`` (a prefill worker computes
    its prompt), ``prefill`` / ``decode`` (running), ``leased`` (a prefill worker's
    pages kept for the decode worker's read)."""

    request_id: str = field(metadata=_spec(REQUEST_ID))
    phase: str = field(metadata=_spec(StrSpec(16, choices=REQUEST_PHASES)))
    prompt_tokens: int = field(default=0, metadata=_spec(COUNT))
    computed_tokens: int = field(default=0, metadata=_spec(COUNT))
    cached: CachedTokens = field(default_factory=CachedTokens, metadata=_spec(CACHED))
    output_tokens: int = field(default=0, metadata=_spec(COUNT))


@dataclass(frozen=True)
class CacheTreeQuery(Message):
    """Gateway -> worker: describe your radix tree (its ``max_nodes`` largest nodes; 0:
    none) and your live requests. ``text_tokens`` > 0 asks for each node's first tokens
    as text (only where the gateway's operator allows prompt text to be shown)."""

    TYPE_TAG: ClassVar[str] = "cache_tree_query"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    max_nodes: int = field(default=0, metadata=_spec(IntSpec(0, MAX_TREE_NODES)))
    text_tokens: int = field(default=0, metadata=_spec(IntSpec(0, MAX_NODE_TEXT_TOKENS)))


@dataclass(frozen=True)
class CacheTreeReply(Message):
    """Worker -> gateway: the answer to `CacheTreeQuery` ``query_id``: the chosen nodes
    (parents before children), the tree's totals (``num_nodes`` 0 when no node was
    asked for), the live requests (at most ``MAX_TREE_NODES``, ``num_live`` in all)."""

    TYPE_TAG: ClassVar[str] = "cache_tree_reply"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    nodes: tuple[CacheNodeView, ...] = field(
        default=(), metadata=_spec(ListSpec(NestedSpec(CacheNodeView), MAX_TREE_NODES))
    )
    num_nodes: int = field(default=0, metadata=_spec(COUNT))
    cached_pages: int = field(default=0, metadata=_spec(COUNT))
    requests: tuple[LiveRequestView, ...] = field(
        default=(), metadata=_spec(ListSpec(NestedSpec(LiveRequestView), MAX_TREE_NODES))
    )
    num_live: int = field(default=0, metadata=_spec(COUNT))


# --- the cache audit: an operator's all-clear ----------------------------------------


@dataclass(frozen=True)
class CacheAuditClear(Message):
    """Gateway -> worker: an operator cleared the cache audit; a worker that failed
    closed (`Engine.clear_audit`) drops its cached pages and serves from its cache again."""

    TYPE_TAG: ClassVar[str] = "cache_audit_clear"
    query_id: str = field(metadata=_spec(REQUEST_ID))


@dataclass(frozen=True)
class CacheAuditCleared(Message):
    """Worker -> gateway: `CacheAuditClear` ``query_id`` is done; ``was_failed``: the
    worker had failed closed until then."""

    TYPE_TAG: ClassVar[str] = "cache_audit_cleared"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    was_failed: bool = field(default=False, metadata=_spec(BoolSpec()))
