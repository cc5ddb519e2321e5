"""The operator's view of one engine: its radix tree's largest nodes and its live requests.

A worker answers the gateway's `CacheTreeQuery` with `describe` (run on the engine
thread, between steps: the tree walk is O(nodes), paid only when an operator looks).
Prompt text leaves the engine only when the query asks for it (``text_tokens`` > 0),
which the gateway does only where its operator allowed prompt text to be shown.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from radixserve.protocol.view_messages import (
    MAX_IDS_PER_NODE,
    MAX_TREE_NODES,
    CacheNodeView,
    CacheTreeReply,
    LiveRequestView,
)

if TYPE_CHECKING:
    from radixserve.cache.radix_tree import RadixNode
    from radixserve.engine.kv_cache_manager import KVCacheManager
    from radixserve.engine.request import Request
    from radixserve.model.tokenizer import Tokenizer


def describe(
    query_id: str,
    kv: KVCacheManager,
    requests: Iterable[Request],
    tokenizer: Tokenizer,
    max_nodes: int,
    text_tokens: int,
) -> CacheTreeReply:
    """The reply to a `CacheTreeQuery`: the ``max_nodes`` largest nodes of ``kv``'s cache
    (with their first ``text_tokens`` tokens as text, none when 0) and the live requests:
    ``requests`` (the engine's own), of which some wait for a host-tier read
    (``kv.host_loads``), and the leased ids (a prefill worker's pages kept for a reader).
    With ``max_nodes`` 0 the tree is not walked (``num_nodes`` 0): the live requests only."""
    requests, cache = list(requests), kv.cache
    live = [_live(req, kv.host_loads) for req in requests]
    live += [LiveRequestView(rid, "leased") for rid in kv.leases.request_ids()]
    nodes: list[CacheNodeView] = []
    num_nodes = 0
    if cache is not None and max_nodes > 0:  # the O(nodes) walks, only when asked for
        running = _running_at(requests)
        for node, pages in cache.largest(max_nodes):
            nodes.append(_node(node, pages, running, tokenizer, text_tokens))
        num_nodes = cache.num_nodes
    cached = cache.num_cached_pages if cache is not None else 0
    return CacheTreeReply(query_id, tuple(nodes), num_nodes, cached,
                          tuple(live[:MAX_TREE_NODES]), len(live))  # fmt: skip


def _live(req: Request, host_loading: Collection[str]) -> LiveRequestView:
    status = req.status.value
    if req.request_id in host_loading:
        phase = "host_load"
    elif status == "running":
        phase = "prefill" if req.num_computed < len(req.prompt_ids) else "decode"
    else:
        phase = "queued" if status == "waiting" else status
    return LiveRequestView(req.request_id, phase, len(req.prompt_ids), req.num_computed,
                           req.cached, len(req.output_ids))  # fmt: skip


def _running_at(requests: list[Request]) -> dict[int, list[str]]:
    """id(node) -> the live requests locked on it or below it (each node's list bounded)."""
    found: dict[int, list[str]] = {}
    for req in requests:
        node = req.locked_node
        while node is not None and node.parent is not None:
            ids = found.setdefault(id(node), [])
            if len(ids) < MAX_IDS_PER_NODE:
                ids.append(req.request_id)
            node = node.parent
    return found


def _recent_below(node: RadixNode) -> tuple[str, ...]:
    """The latest request ids recorded at ``node`` and its descendants (bounded)."""
    ids: list[str] = []
    stack = [node]
    while stack and len(ids) < MAX_IDS_PER_NODE:
        current = stack.pop()
        ids.extend(reversed(current.recent_ids or ()))
        stack.extend(current.children.values())
    return tuple(dict.fromkeys(ids))[:MAX_IDS_PER_NODE]


def _prefix_tokens(node: RadixNode) -> int:
    total = 0
    current: RadixNode | None = node
    while current is not None:
        total += len(current.key)
        current = current.parent
    return total


def _node(
    node: RadixNode,
    subtree_pages: int,
    running: dict[int, list[str]],
    tokenizer: Tokenizer,
    text_tokens: int,
) -> CacheNodeView:
    parent = node.parent
    text = tokenizer.decode(node.key[:text_tokens]) if text_tokens > 0 else ""
    return CacheNodeView(
        node_id=node.node_id,
        parent_id=parent.node_id if parent is not None and not parent.is_root else 0,
        num_tokens=len(node.key),
        prefix_tokens=_prefix_tokens(node),
        num_pages=len(node.page_ids),
        subtree_pages=subtree_pages,
        hits=node.hits,
        locks=node.lock_ref,
        last_hit_s=node.last_hit_s,
        text=text,
        recent_request_ids=_recent_below(node),
        live_request_ids=tuple(running.get(id(node), ())),
    )
