"""Page-aligned radix tree over token ids: the prefix cache (RadixAttention-style).

The tree maps token prefixes to the KV pages that hold them. It owns page ids, never
KV data, and holds one allocator reference on every page it owns. Every edge key is a
run of whole pages, so a node's ``key``, ``page_ids`` and ``page_hashes`` line up one
page per entry (page_size = 4 shown):

    root  key=[]                                   lock_ref = every outstanding lock
     ├── (1,2,3,4) -> key=[1 2 3 4 | 5 6 7 8]      system prompt, 2 pages
     │                page_ids=[ 7 |  8 ]
     │                page_hashes=[h0 | h1]        h1 = H(h0, 5 6 7 8)
     │    ├── (9,9,9,9) -> key=[9 9 9 9]           conversation A, 1 page
     │    └── (3,1,4,1) -> key=[3 1 4 1 | 5 9 2 6] conversation B, 2 pages
     └── (0,0,0,0) -> ...                          another prompt

Children are keyed by the tuple of their first page's tokens. A match that ends inside
a key splits the node at that page boundary; the existing node object keeps the lower
half (so handles held by callers keep meaning the same prefix) and a new node takes the
upper half.

Locks: ``lock(node)`` adds 1 to ``node.own_locks`` and 1 to ``lock_ref`` of the node and
of every ancestor *including the root*, so for every node
``lock_ref == own_locks + sum(child.lock_ref for child in children)`` and
``root.lock_ref`` is the number of outstanding locks. Nodes with ``lock_ref > 0`` are
never evicted. A split gives the new upper half the lower half's ``lock_ref`` and no
``own_locks``, which keeps the rule.

Eviction removes least-recently-used unlocked leaves; a parent left as an unlocked
leaf becomes a candidate. ``last_access`` is a per-cache counter bumped once per
``match_prefix``/``insert`` and stamped on every node of the walked path, so a parent is
never older than its children. Not thread-safe: one engine thread drives it.

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

Scopes (`radixserve.cache.block_hash.scoped_namespace`): every walk takes the namespace
its request's pages are hashed in (default: the cache's own). The root serves the
cache's own namespace; each other namespace has a *scope root* (no key, no pages, its
parent the root, so locks still count on the root) whose subtree holds that scope's
pages only, so a request never matches a page computed under another scope. A scope
root exists only while it has children or locks (a salt per request cannot grow the
tree's memory); it is never evicted itself, and the views walk every scope.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from radixserve.cache.block_hash import page_hashes
from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.page_proof import PageProof, chain_proofs

logger = logging.getLogger(__name__)

RECENT_IDS = 8  # request ids a node remembers (`RadixNode.recent_ids`)

EventCallback = Callable[[str, list[int]], None]
#: ("stored", page hashes, the hash of the page before them (None at a root), their
#: tokens) or ("removed", page hashes, None, [])
BlockCallback = Callable[[str, list[int], int | None, list[int]], None]
# (page hashes, page ids, each page's proof: `radixserve.cache.page_proof`)
SpillCallback = Callable[[list[int], list[int], list[PageProof]], None]


class RadixNode:
    """One edge of the tree: a page-aligned run of tokens and the pages that hold it."""

    __slots__ = (
        "node_id",
        "key",
        "page_ids",
        "page_hashes",
        "parent",
        "children",
        "lock_ref",
        "own_locks",
        "last_access",
        "uses",
        "written",
        "hits",
        "last_hit_s",
        "recent_ids",
        "namespace",
    )

    def __init__(
        self,
        node_id: int,
        key: list[int],
        page_ids: list[int],
        hashes: list[int],
        parent: RadixNode | None,
        last_access: int,
        namespace: bytes = b"",
    ) -> None:
        self.node_id = node_id
        self.key = key
        self.page_ids = page_ids
        self.page_hashes = hashes
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.own_locks = 0
        self.last_access = last_access
        self.uses = 0  # requests that started from a prefix ending in this node
        self.written = False  # handed to the spill listener already
        self.hits = 0  # requests whose cached prefix ran through this node (`note_use`)
        self.last_hit_s = 0.0  # wall-clock time of the latest of them (0: none yet)
        # ids of the latest requests whose cached prefix ended exactly here (at most
        # `RECENT_IDS`; those that ended below are on the descendants): the explorer's
        # "who used this prefix", kept on one node per hit so a hit stays O(depth)
        self.recent_ids: list[str] | None = None
        self.namespace = namespace  # what its pages are hashed in (its scope's)

    @property
    def is_root(self) -> bool:
        """The root or a scope root: no key, no pages, never evicted."""
        return not self.key

    @property
    def last_hash(self) -> int | None:
        """Chained hash of this node's last page (``None`` for the root)."""
        return self.page_hashes[-1] if self.page_hashes else None

    def __repr__(self) -> str:
        return (
            f"RadixNode(id={self.node_id}, pages={len(self.page_ids)}, "
            f"children={len(self.children)}, lock_ref={self.lock_ref})"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Longest cached page-aligned prefix: its pages and the node that ends exactly there."""

    page_ids: list[int]
    node: RadixNode
    num_tokens: int
    last_hash: int | None


class RadixCache:
    """Prefix cache over an allocator's pages; see the module docstring for the layout."""

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
        self._clock = itertools.count(1)  # `last_access` stamps
        self._node_ids = itertools.count(1)
        self.root = RadixNode(next(self._node_ids), [], [], [], None, 0, namespace)
        self._scopes: dict[bytes, RadixNode] = {}  # namespace -> scope root (not the root's)
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
        return sum(1 for _ in self._nodes())

    @property
    def num_scopes(self) -> int:
        """Scope roots now held (namespaces other than the cache's own). O(1)."""
        return len(self._scopes)

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
        start = self._scope_root(namespace, create=False)
        if start is None:  # a scope with nothing cached
            return MatchResult([], self.root, 0, None)
        node, num_tokens, pages = self._descend(start, tokens, limit, next(self._clock))
        return MatchResult(pages, node, num_tokens, node.last_hash)

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
        return MatchResult(pages, node, len(token_ids), node.last_hash)

    def _insert(
        self, tokens: list[int], page_ids: Sequence[int], namespace: bytes | None
    ) -> tuple[RadixNode, int, list[int]]:
        """Insert; (the node ending at ``tokens``' end, tokens already cached, the path's
        pages)."""
        if len(tokens) != len(page_ids) * self.page_size:
            raise ValueError(
                f"{len(tokens)} tokens do not fill {len(page_ids)} pages of {self.page_size}"
            )
        tick = next(self._clock)
        # no tokens: nothing to hang anywhere (a scope without pages gets no scope root)
        start = self._scope_root(namespace, create=bool(tokens)) or self.root
        node, num_cached, pages = self._descend(start, tokens, len(tokens), tick)
        if num_cached < len(tokens):
            new_pages = list(page_ids[num_cached // self.page_size :])
            node = self._add_leaf(node, tokens[num_cached:], new_pages, tick)
            pages = pages + new_pages
        return node, num_cached, pages

    def _scope_root(self, namespace: bytes | None, create: bool) -> RadixNode | None:
        """Where the pages of ``namespace`` hang: the root for the cache's own, else its
        scope root (made if ``create``; None if it has none)."""
        if namespace is None or namespace == self.namespace:
            return self.root
        scope = self._scopes.get(namespace)
        if scope is None and create:
            scope = RadixNode(next(self._node_ids), [], [], [], self.root, 0, namespace)
            self._scopes[namespace] = scope
        return scope

    def _prune_scope(self, node: RadixNode) -> None:
        """Forget ``node`` if it is a scope root with no children and no locks."""
        if node is self.root or not node.is_root or node.children or node.lock_ref:
            return
        del self._scopes[node.namespace]
        node.parent = None
        self.version += 1  # a match that ended on it is stale

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
        for node in self._nodes():
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
        for node in reversed(list(self._nodes())):  # children before their parents
            below[id(node)] = len(node.page_ids) + sum(below[id(c)] for c in node.children.values())
        heap = [(-below[id(c)], c.node_id, c) for c in self._top_nodes()]
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
        return [h for node in self._nodes() for h in node.page_hashes]

    def roots(self) -> list[RadixNode]:
        """The root, then every scope root (each a namespace's tree; `RadixNode.namespace`)."""
        return [self.root, *self._scopes.values()]

    def _top_nodes(self) -> list[RadixNode]:
        """The children of the root and of every scope root: each scope's first nodes."""
        tops = list(self.root.children.values())
        for scope in self._scopes.values():
            tops.extend(scope.children.values())
        return tops

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root and the scope roots, each before its children (depth
        first), every scope's."""
        stack = self._top_nodes()
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Walk the tree and raise ``AssertionError`` on any broken invariant.

        Checks key alignment, child keying, parent links, the lock_ref sum rule, LRU
        stamps, the O(1) counters, the evictable set, page ownership (each page owned
        once, refcount >= 1) and every hash against a recomputation. Changes nothing.
        """
        root = self.root
        if root.key or root.page_ids or root.page_hashes or root.parent is not None:
            raise AssertionError("root must be empty and parentless")
        if root.namespace != self.namespace:
            raise AssertionError("the root's namespace is not the cache's")
        self._check_scopes()
        owned: set[int] = set()
        locked_pages = 0
        evictable: set[RadixNode] = set()
        for node in [root, *self._scopes.values(), *self._nodes()]:
            self._check_node(node, owned)
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

    def _check_scopes(self) -> None:
        """The scope roots' part of ``check_integrity``: each is an empty node under the
        root, of its own namespace, kept only while it has children or locks."""
        for namespace, scope in self._scopes.items():
            if scope.key or scope.page_ids or scope.parent is not self.root:
                raise AssertionError(f"scope root {scope!r} is not an empty node under the root")
            if scope.namespace != namespace or namespace == self.namespace:
                raise AssertionError(f"scope root {scope!r} is filed under another namespace")
            if not scope.children and not scope.lock_ref:
                raise AssertionError(f"scope root {scope!r} is kept with nothing under it")
            if scope.last_access > self.root.last_access:
                raise AssertionError(f"scope root {scope!r} was accessed after the root")

    def _check_node(self, node: RadixNode, owned: set[int]) -> None:
        """Per-node part of ``check_integrity``; adds the node's pages to ``owned``."""
        page_size = self.page_size
        num_pages = len(node.page_ids)
        if not node.is_root and len(node.key) % page_size:
            raise AssertionError(f"{node!r} key of {len(node.key)} tokens is not page-aligned")
        if num_pages * page_size != len(node.key) or len(node.page_hashes) != num_pages:
            raise AssertionError(f"{node!r} key, page_ids and page_hashes disagree")
        below = [*node.children.values(), *(self._scopes.values() if node is self.root else ())]
        if node.own_locks < 0 or node.lock_ref != node.own_locks + sum(c.lock_ref for c in below):
            raise AssertionError(f"{node!r} breaks lock_ref == own_locks + children's")
        for first_page, child in node.children.items():
            if child.parent is not node or tuple(child.key[:page_size]) != first_page:
                raise AssertionError(f"{child!r} is keyed or linked wrongly under {node!r}")
            if child.last_access > node.last_access:
                raise AssertionError(f"{child!r} was accessed after its parent")
            if child.namespace != node.namespace:
                raise AssertionError(f"{child!r} is in another scope than its parent {node!r}")
        for page in node.page_ids:
            if page in owned:
                raise AssertionError(f"page {page} is owned twice")
            if self._allocator.refcount(page) < 1:
                raise AssertionError(f"owned page {page} is free in the allocator")
            owned.add(page)
        parent_hash = node.parent.last_hash if node.parent is not None else None
        expected = page_hashes(node.key, page_size, node.namespace, parent_hash)
        if node.page_hashes != expected:
            raise AssertionError(f"{node!r} page hashes differ from a recomputation")

    def _descend(
        self, start: RadixNode, tokens: list[int], limit: int, tick: int
    ) -> tuple[RadixNode, int, list[int]]:
        """Walk the longest cached prefix of ``tokens[:limit]`` (limit page-aligned) down
        from ``start`` (the root or a scope root).

        Splits the last node if the match ends inside it and stamps ``tick`` on the
        path (the root included). Returns (deepest node, matched token count, matched
        page ids).
        """
        page_size = self.page_size
        self.root.last_access = tick
        node = start
        node.last_access = tick
        pos = 0
        pages: list[int] = []
        while pos < limit:
            child = node.children.get(tuple(tokens[pos : pos + page_size]))
            if child is None:
                break
            key = child.key
            end = pos + len(key)
            full = end <= limit and tokens[pos:end] == key
            if not full:
                matched = self._matched_pages(key, tokens, pos, limit)
                child = self._split(child, matched)
                end = pos + matched * page_size
            child.last_access = tick
            pages.extend(child.page_ids)
            node = child
            pos = end
            if not full:
                break
        return node, pos, pages

    def _matched_pages(self, key: list[int], tokens: list[int], pos: int, limit: int) -> int:
        """Leading whole pages of ``key`` equal to ``tokens[pos:limit]`` (first page is known).

        Bisects with slice comparisons over ever smaller ranges: O(len(key)) element
        compares in C and O(log pages) Python steps.
        """
        size = self.page_size

        def same(first: int, stop: int) -> bool:  # pages [first, stop) are equal
            return key[first * size : stop * size] == tokens[pos + first * size : pos + stop * size]

        lo, hi = 1, min(len(key), limit - pos) // size
        if same(lo, hi):
            return hi
        while hi - lo > 1:  # pages [0, lo) are equal; a mismatch lies in pages [lo, hi)
            mid = (lo + hi) // 2
            if same(lo, mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut ``node`` after ``num_pages`` pages; return the new upper half.

        ``node`` keeps the lower half (and its own locks); the upper half gets the same
        ``lock_ref``. Contents, counters and the evictable set are unchanged.
        """
        page_size = self.page_size
        cut = num_pages * page_size
        parent = node.parent
        assert parent is not None and 0 < cut < len(node.key)
        upper = RadixNode(
            next(self._node_ids),
            node.key[:cut],
            node.page_ids[:num_pages],
            node.page_hashes[:num_pages],
            parent,
            node.last_access,
            node.namespace,
        )
        upper.lock_ref = node.lock_ref
        upper.uses, upper.written = node.uses, node.written
        upper.hits, upper.last_hit_s = node.hits, node.last_hit_s
        parent.children[tuple(node.key[:page_size])] = upper
        node.key = node.key[cut:]
        node.page_ids = node.page_ids[num_pages:]
        node.page_hashes = node.page_hashes[num_pages:]
        node.parent = upper
        upper.children[tuple(node.key[:page_size])] = node
        return upper

    def _add_leaf(
        self, parent: RadixNode, key: list[int], pages: list[int], tick: int
    ) -> RadixNode:
        """Attach a new unlocked leaf, taking one reference on each of its pages."""
        if len(set(pages)) != len(pages):
            raise ValueError("the same page id is given for two pages")
        hashes = page_hashes(key, self.page_size, parent.namespace, parent.last_hash)
        self._allocator.incref(pages)
        leaf = RadixNode(next(self._node_ids), key, pages, hashes, parent, tick, parent.namespace)
        parent.children[tuple(key[: self.page_size])] = leaf
        self._evictable.discard(parent)
        self._evictable.add(leaf)
        self._num_cached_pages += len(pages)
        self.version += 1
        if self._on_event is not None:
            self._on_event("stored", list(hashes))
        if self._on_block is not None:
            self._on_block("stored", list(hashes), parent.last_hash, list(key))
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
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[tuple(node.key[: self.page_size])]
        node.parent = None
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

    def _check_attached(self, node: RadixNode) -> None:
        if node is not self.root and node.parent is None:  # a pruned scope root too
            raise ValueError(f"{node!r} is no longer in the tree (evicted)")


def _proofs(node: RadixNode) -> list[PageProof]:
    """What each of ``node``'s page hashes is recomputed from (for the host tier)."""
    parent = node.parent.last_hash if node.parent is not None else None
    return chain_proofs(node.namespace, parent, node.key, node.page_hashes)
