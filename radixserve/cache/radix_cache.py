"""The prefix cache (RadixAttention-style): the pages of a radix tree over token ids,
owned, locked, evicted and reported.

`RadixCache` answers prefix lookups over a `radixserve.cache.radix_tree.RadixTree` (its
layout, splits and scopes are drawn there). It owns page ids, never KV data, and holds
one allocator reference on every page the tree holds.

Locks: ``lock(node)`` adds 1 to ``node.own_locks`` and 1 to ``lock_ref`` of the node and
of every ancestor *including the root*, so for every node
``lock_ref == own_locks + sum(child.lock_ref for child in children)`` and
``root.lock_ref`` is the number of outstanding locks. Nodes with ``lock_ref > 0`` are
never evicted. A split gives the new upper half the lower half's ``lock_ref`` and no
``own_locks``, which keeps the rule.

Eviction removes least-recently-used unlocked leaves (``last_access``, stamped once per
``match_prefix``/``insert`` on the walked path); a parent left as an unlocked leaf
becomes a candidate. Not thread-safe: one engine thread drives it.

Spilling (the kvstore's host tier, `set_spill_listener`): eviction hands each node's
page hashes and ids to the listener before the tree lets the pages go (write-back); with
a write-through threshold N, a cached prefix is also handed over, root first, once N
requests have used it (1: as soon as it is computed). A node handed over is marked
``written`` and not handed over again.

For the operator's view (the gateway's /explorer, `largest`): every node counts the
requests whose cached prefix ran through it (``hits``, stamped with the wall-clock
``last_hit_s``), and the node where such a prefix ended keeps the latest few request
ids; `note_use` does this in the walk up the path it already made, so a hit stays
O(depth) and the memory bounded (`RECENT_IDS` ids per node).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.page_proof import PageProof, chain_proofs
from radixserve.cache.radix_tree import RadixNode, RadixTree

logger = logging.getLogger(__name__)

RECENT_IDS = 8  # request ids a node remembers (`RadixNode.recent_ids`)

EventCallback = Callable[[str, list[int]], None]
#: ("stored", page hashes, the hash of the page before them (None at a root), their
#: tokens) or ("removed", page hashes, None, [])
BlockCallback = Callable[[str, list[int], int | None, list[int]], None]
# (page hashes, page ids, each page's proof: `radixserve.cache.page_proof`)
SpillCallback = Callable[[list[int], list[int], list[PageProof]], None]


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Longest cached page-aligned prefix: its pages and the node that ends exactly there."""

    page_ids: list[int]
    node: RadixNode
    num_tokens: int


class RadixCache:
    """Prefix cache over an allocator's pages; see the module docstring."""

    def __init__(self, allocator: PageAllocator, page_size: int, namespace: bytes) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._allocator = allocator
        self.page_size = page_size
        self.namespace = namespace
        self._on_event: EventCallback | None = None  # `set_event_listener`
        self._on_block: BlockCallback | None = None  # `set_block_listener`
        self._on_spill: SpillCallback | None = None
        self._write_through_uses = 0
        self._tree = RadixTree(page_size, namespace)
        self.root = self._tree.root
        self._evictable: set[RadixNode] = set()  # unlocked non-root leaves
        self._num_cached_pages = 0
        self._num_locked_pages = 0
        # bumped whenever a node is added or removed: a match taken at version v is still
        # the longest (and its pages still cached) while the version is v
        self.version = 0
        self.num_matches = 0  # `match_prefix` walks, counted (each admission makes one)

    @property
    def num_cached_pages(self) -> int:
        """Pages owned by the tree. O(1)."""
        return self._num_cached_pages

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the root left out. O(nodes): for views."""
        return sum(1 for _ in self._tree.nodes())

    @property
    def num_scopes(self) -> int:
        """Scope roots now held (namespaces other than the cache's own). O(1)."""
        return len(self._tree.scopes)

    @property
    def num_locked_pages(self) -> int:
        """Pages in nodes with ``lock_ref > 0``. O(1)."""
        return self._num_locked_pages

    @property
    def num_locks(self) -> int:
        """Outstanding ``lock`` calls (every lock counts on the root). O(1)."""
        return self.root.lock_ref

    @property
    def num_evictable_pages(self) -> int:
        """Pages ``evict`` could release now. O(1)."""
        return self._num_cached_pages - self._num_locked_pages

    def match_prefix(self, token_ids: Sequence[int], namespace: bytes | None = None) -> MatchResult:
        """Find the longest cached prefix of ``token_ids`` made of whole pages, among the
        pages of ``namespace`` (None: the cache's own; see the module notes on scopes).

        A trailing partial page never matches; nor does anything in a scope that holds
        nothing (the result's node is then the root, which a caller may lock). If the
        match ends inside a node's key, that node is split so ``result.node`` ends
        exactly at the match (what is cached does not change). Stamps ``last_access`` on
        the matched path; takes no references and no locks. O(len(token_ids)).
        """
        tokens = token_ids if type(token_ids) is list else list(token_ids)
        limit = len(tokens) - len(tokens) % self.page_size
        self.num_matches += 1
        start = self._tree.scope_root(namespace, create=False)
        if start is None:  # a scope with nothing cached
            return MatchResult([], self.root, 0)
        node, num_tokens, pages = self._tree.descend(start, tokens, limit, self._tree.tick())
        return MatchResult(pages, node, num_tokens)

    def insert(
        self, token_ids: Sequence[int], page_ids: Sequence[int], namespace: bytes | None = None
    ) -> int:
        """Cache ``token_ids`` (whole pages) held by ``page_ids`` in ``namespace`` (None:
        the cache's own); return tokens already cached there.

        For the uncached tail the tree takes one reference on each given page and
        hashes it. For the cached head it keeps its own pages and ignores the given ones;
        the caller still drops its own references on all of ``page_ids`` afterwards,
        which frees those duplicates. Raises ``ValueError`` if
        ``len(token_ids) != len(page_ids) * page_size``.
        """
        return self._insert(list(token_ids), page_ids, namespace)[1]

    def insert_path(
        self, token_ids: Sequence[int], page_ids: Sequence[int], namespace: bytes | None = None
    ) -> MatchResult:
        """`insert`, returning the cached path of ``token_ids`` afterwards: its canonical
        pages and the node ending there (what a running request re-points at), from the
        same walk."""
        node, _, pages = self._insert(list(token_ids), page_ids, namespace)
        return MatchResult(pages, node, len(token_ids))

    def _insert(
        self, tokens: list[int], page_ids: Sequence[int], namespace: bytes | None
    ) -> tuple[RadixNode, int, list[int]]:
        """Insert; (the node ending at ``tokens``' end, tokens already cached, the path's
        pages)."""
        if len(tokens) != len(page_ids) * self.page_size:
            raise ValueError(
                f"{len(tokens)} tokens do not fill {len(page_ids)} pages of {self.page_size}"
            )
        tick = self._tree.tick()
        # no tokens: nothing to hang anywhere (a scope without pages gets no scope root)
        start = self._tree.scope_root(namespace, create=bool(tokens)) or self.root
        node, num_cached, pages = self._tree.descend(start, tokens, len(tokens), tick)
        if num_cached < len(tokens):
            new_pages = list(page_ids[num_cached // self.page_size :])
            node = self._add_leaf(node, tokens[num_cached:], new_pages, tick)
            pages = pages + new_pages
        return node, num_cached, pages

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and all its ancestors from eviction until ``unlock(node)``."""
        self._check_attached(node)
        node.own_locks += 1
        current: RadixNode | None = node
        while current is not None:
            if current.lock_ref == 0:
                self._num_locked_pages += len(current.page_ids)
                self._evictable.discard(current)
            current.lock_ref += 1
            current = current.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``; raises ``RuntimeError`` if ``node`` holds no lock."""
        if node.own_locks <= 0:
            raise RuntimeError(f"unlock of {node!r}, which holds no lock")
        self._check_attached(node)
        node.own_locks -= 1
        current: RadixNode | None = node
        while current is not None:
            current.lock_ref -= 1
            parent = current.parent
            if current.lock_ref == 0:
                self._num_locked_pages -= len(current.page_ids)
                if not current.children and not current.is_root:
                    self._evictable.add(current)
                self._prune_scope(current)
            current = parent

    def evict(self, num_pages: int) -> int:
        """Remove least-recently-used unlocked leaves until ``num_pages`` pages are released.

        Whole nodes are removed, so more pages than asked may go. Returns the pages
        released from the tree (fewer than asked only when nothing evictable is left).
        Each page loses the tree's reference; it is freed only if no request holds it.
        """
        if num_pages <= 0:
            return 0
        heap = [(node.last_access, node.node_id, node) for node in self._evictable]
        heapq.heapify(heap)
        released = 0
        while released < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            if self._on_spill is not None and not node.written:
                self._on_spill(list(node.page_hashes), list(node.page_ids), _proofs(node))
            released += self._remove_leaf(node)
            if parent in self._evictable:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        logger.debug("evicted %d pages (asked for %d)", released, num_pages)
        return released

    def set_event_listener(self, on_event: EventCallback | None) -> None:
        """Report "stored"/"removed" page hashes to ``on_event`` from now on (None: stop)."""
        self._on_event = on_event

    def set_block_listener(self, on_block: BlockCallback | None) -> None:
        """Report stored pages with their tokens and parent hash, and removed pages, to
        ``on_block`` from now on (None: stop): what a subscriber needs to rehash them."""
        self._on_block = on_block

    def set_spill_listener(
        self, on_spill: SpillCallback | None, write_through_uses: int = 0
    ) -> None:
        """Hand evicted pages to ``on_spill`` (None: stop); with ``write_through_uses`` N
        >= 1, also every prefix used by N requests (see the module notes)."""
        if write_through_uses < 0:
            raise ValueError(f"write_through_uses must be >= 0, got {write_through_uses}")
        self._on_spill = on_spill
        self._write_through_uses = write_through_uses if on_spill is not None else 0

    def clear_written(self) -> None:
        """Forget which nodes were handed over (the tier they went to was emptied)."""
        for node in self._tree.nodes():
            node.written = False

    def note_use(self, node: RadixNode, request_id: str = "") -> None:
        """A request (``request_id``) starts from the cached prefix ending at ``node``:
        count the hit on the path (its hit count and time, the id on ``node``) and write
        the prefix through once its uses reach the threshold. O(depth)."""
        if node.is_root:
            return
        self._check_attached(node)
        now = time.time()
        threshold = self._write_through_uses
        current: RadixNode | None = node
        while current is not None and not current.is_root:
            current.hits += 1
            current.last_hit_s = now
            if threshold >= 1:
                current.uses += 1
            current = current.parent
        if request_id:
            recent = node.recent_ids if node.recent_ids is not None else []
            recent.append(request_id)
            node.recent_ids = recent[-RECENT_IDS:]
        if threshold >= 1 and node.uses >= threshold:
            self._write_path(node)

    def largest(self, max_nodes: int) -> list[tuple[RadixNode, int]]:
        """Up to ``max_nodes`` nodes holding the most pages, each with the pages of its
        subtree, chosen best first from the root so every chosen node's parent is chosen
        too (the root is left out; parents come before children). O(nodes): for views,
        not for the hot path."""
        below: dict[int, int] = {}
        for node in reversed(list(self._tree.nodes())):  # children before their parents
            below[id(node)] = len(node.page_ids) + sum(below[id(c)] for c in node.children.values())
        heap = [(-below[id(c)], c.node_id, c) for c in self._tree.top_nodes()]
        heapq.heapify(heap)
        chosen: list[tuple[RadixNode, int]] = []
        while heap and len(chosen) < max_nodes:
            pages, _, node = heapq.heappop(heap)
            chosen.append((node, -pages))
            for child in node.children.values():
                heapq.heappush(heap, (-below[id(child)], child.node_id, child))
        return chosen

    def _write_path(self, node: RadixNode) -> None:
        """Hand the not yet written nodes from the root down to ``node`` to the listener."""
        assert self._on_spill is not None
        path: list[RadixNode] = []
        current: RadixNode | None = node
        while current is not None and not current.is_root:
            if not current.written:
                path.append(current)
            current = current.parent
        if not path:
            return
        hashes: list[int] = []
        pages: list[int] = []
        proofs: list[PageProof] = []
        for current in reversed(path):
            current.written = True
            hashes.extend(current.page_hashes)
            pages.extend(current.page_ids)
            proofs.extend(_proofs(current))
        self._on_spill(hashes, pages, proofs)

    def all_page_hashes(self) -> list[int]:
        """Every cached page's hash, parents before children (a snapshot for a resync)."""
        return [h for node in self._tree.nodes() for h in node.page_hashes]

    def roots(self) -> list[RadixNode]:
        """The root, then every scope root (each a namespace's tree; `RadixNode.namespace`)."""
        return self._tree.roots()

    def check_integrity(self) -> None:
        """Walk the tree and raise ``AssertionError`` on any broken invariant.

        Checks the tree's structure (`RadixTree.check_integrity`: key alignment, child
        keying, parent links, the lock_ref sum rule, LRU stamps, scopes, every hash
        against a recomputation), the O(1) counters, the evictable set and page
        ownership (each page owned once, refcount >= 1). Changes nothing.
        """
        self._tree.check_integrity()
        owned: set[int] = set()
        locked_pages = 0
        evictable: set[RadixNode] = set()
        for node in [*self._tree.roots(), *self._tree.nodes()]:
            for page in node.page_ids:
                if page in owned:
                    raise AssertionError(f"page {page} is owned twice")
                if self._allocator.refcount(page) < 1:
                    raise AssertionError(f"owned page {page} is free in the allocator")
                owned.add(page)
            if node.lock_ref > 0:
                locked_pages += len(node.page_ids)
            elif not node.children and not node.is_root:
                evictable.add(node)
        if len(owned) != self._num_cached_pages:
            raise AssertionError(f"{len(owned)} pages owned, counter {self._num_cached_pages}")
        if locked_pages != self._num_locked_pages:
            raise AssertionError(f"{locked_pages} locked, counter {self._num_locked_pages}")
        if evictable != self._evictable:
            raise AssertionError("evictable-leaf set disagrees with the tree")

    def _add_leaf(
        self, parent: RadixNode, key: list[int], pages: list[int], tick: int
    ) -> RadixNode:
        """Attach a new unlocked leaf, taking one reference on each of its pages."""
        if len(set(pages)) != len(pages):
            raise ValueError("the same page id is given for two pages")
        self._allocator.incref(pages)
        leaf = self._tree.add_leaf(parent, key, pages, tick)
        self._evictable.discard(parent)
        self._evictable.add(leaf)
        self._num_cached_pages += len(pages)
        self.version += 1
        if self._on_event is not None:
            self._on_event("stored", list(leaf.page_hashes))
        if self._on_block is not None:
            self._on_block("stored", list(leaf.page_hashes), parent.last_hash, list(key))
        if self._write_through_uses:
            leaf.uses = 1
            if self._write_through_uses == 1:
                self._write_path(leaf)
        return leaf

    def drop_unlocked(self) -> int:
        """Remove every unlocked node, leaves first, handing none to the spill listener:
        their KV is no longer trusted (the cache audit found a page that does not
        reproduce its logits). Locked nodes stay. Returns the pages released."""
        released = 0
        while self._evictable:
            released += self._remove_leaf(self._evictable.pop())
        return released

    def _remove_leaf(self, node: RadixNode) -> int:
        """Detach an unlocked leaf and drop the tree's references; return its page count."""
        assert node.lock_ref == 0
        parent = self._tree.remove_leaf(node)
        self._evictable.discard(node)
        self._num_cached_pages -= len(node.page_ids)
        self.version += 1
        self._allocator.decref(node.page_ids)
        if not parent.is_root and not parent.children and parent.lock_ref == 0:
            self._evictable.add(parent)
        self._prune_scope(parent)
        if self._on_event is not None:
            self._on_event("removed", list(node.page_hashes))
        if self._on_block is not None:
            self._on_block("removed", list(node.page_hashes), None, [])
        return len(node.page_ids)

    def _prune_scope(self, node: RadixNode) -> None:
        """Forget ``node`` if it is a scope root with nothing under it and no locks."""
        if self._tree.prune_scope(node):
            self.version += 1  # a match that ended on it is stale

    def _check_attached(self, node: RadixNode) -> None:
        if node is not self.root and node.parent is None:  # a pruned scope root too
            raise ValueError(f"{node!r} is no longer in the tree (evicted)")


def _proofs(node: RadixNode) -> list[PageProof]:
    """What each of ``node``'s page hashes is recomputed from (for the host tier)."""
    parent = node.parent.last_hash if node.parent is not None else None
    return chain_proofs(node.namespace, parent, node.key, node.page_hashes)
