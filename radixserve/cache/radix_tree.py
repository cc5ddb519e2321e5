"""The radix tree's structure over token ids: its nodes and the walk that matches a prefix.

The tree maps token prefixes to the KV pages that hold them. Every edge key is a run of
whole pages, so a node's ``key``, ``page_ids`` and ``page_hashes`` line up one page per
entry (page_size = 4 shown):

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
upper half. ``last_access`` is a per-tree counter (`tick`) stamped on every node of the
walked path, so a parent is never older than its children.

Scopes (`radixserve.cache.block_hash.scoped_namespace`): every walk takes the namespace
its request's pages are hashed in. The root serves the tree's own namespace; each other
namespace has a *scope root* (no key, no pages, its parent the root, so locks still
count on the root) whose subtree holds that scope's pages only, so a request never
matches a page computed under another scope. A scope root exists only while it has
children or locks (a salt per request cannot grow the tree's memory); it is never
evicted itself, and the walks over the tree cover every scope.

`RadixTree` holds page ids, never KV data, and takes no page references: the prefix
cache (`radixserve.cache.radix_cache`) owns the pages, the locks and eviction. Not
thread-safe: one engine thread drives it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from radixserve.cache.block_hash import page_hashes


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


class RadixTree:
    """The nodes of every scope, and the walks that match, split, attach and detach them."""

    def __init__(self, page_size: int, namespace: bytes) -> None:
        self.page_size = page_size
        self.namespace = namespace
        self._clock = itertools.count(1)  # `last_access` stamps
        self._node_ids = itertools.count(1)
        self.root = RadixNode(next(self._node_ids), [], [], [], None, 0, namespace)
        self.scopes: dict[bytes, RadixNode] = {}  # namespace -> scope root (not the root's)

    def tick(self) -> int:
        """The next `last_access` stamp (one per walk)."""
        return next(self._clock)

    def scope_root(self, namespace: bytes | None, create: bool) -> RadixNode | None:
        """Where the pages of ``namespace`` hang: the root for the tree's own (or None),
        else its scope root (made if ``create``; None if it has none)."""
        if namespace is None or namespace == self.namespace:
            return self.root
        scope = self.scopes.get(namespace)
        if scope is None and create:
            scope = RadixNode(next(self._node_ids), [], [], [], self.root, 0, namespace)
            self.scopes[namespace] = scope
        return scope

    def prune_scope(self, node: RadixNode) -> bool:
        """Forget ``node`` if it is a scope root with no children and no locks; whether
        it was."""
        if node is self.root or not node.is_root or node.children or node.lock_ref:
            return False
        del self.scopes[node.namespace]
        node.parent = None
        return True

    def descend(
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
        ``lock_ref``. The pages held, and so the cache's counters, are unchanged.
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

    def add_leaf(self, parent: RadixNode, key: list[int], pages: list[int], tick: int) -> RadixNode:
        """Attach a new leaf under ``parent`` holding ``pages`` for ``key``, its pages'
        hashes chained on the parent's."""
        hashes = page_hashes(key, self.page_size, parent.namespace, parent.last_hash)
        leaf = RadixNode(next(self._node_ids), key, pages, hashes, parent, tick, parent.namespace)
        parent.children[tuple(key[: self.page_size])] = leaf
        return leaf

    def remove_leaf(self, node: RadixNode) -> RadixNode:
        """Detach a leaf; return its former parent."""
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[tuple(node.key[: self.page_size])]
        node.parent = None
        return parent

    def roots(self) -> list[RadixNode]:
        """The root, then every scope root (each a namespace's tree; `RadixNode.namespace`)."""
        return [self.root, *self.scopes.values()]

    def top_nodes(self) -> list[RadixNode]:
        """The children of the root and of every scope root: each scope's first nodes."""
        tops = list(self.root.children.values())
        for scope in self.scopes.values():
            tops.extend(scope.children.values())
        return tops

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root and the scope roots, each before its children (depth
        first), every scope's."""
        stack = self.top_nodes()
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Walk the tree and raise ``AssertionError`` on any broken structural invariant:
        the roots, key alignment, child keying, parent links, the lock_ref sum rule
        (`radixserve.cache.radix_cache`), LRU stamps, scopes and every hash against a
        recomputation. Changes nothing."""
        root = self.root
        if root.key or root.page_ids or root.page_hashes or root.parent is not None:
            raise AssertionError("root must be empty and parentless")
        if root.namespace != self.namespace:
            raise AssertionError("the root's namespace is not the cache's")
        for namespace, scope in self.scopes.items():
            if scope.key or scope.page_ids or scope.parent is not root:
                raise AssertionError(f"scope root {scope!r} is not an empty node under the root")
            if scope.namespace != namespace or namespace == self.namespace:
                raise AssertionError(f"scope root {scope!r} is filed under another namespace")
            if not scope.children and not scope.lock_ref:
                raise AssertionError(f"scope root {scope!r} is kept with nothing under it")
            if scope.last_access > root.last_access:
                raise AssertionError(f"scope root {scope!r} was accessed after the root")
        for node in [*self.roots(), *self.nodes()]:
            self._check_node(node)

    def _check_node(self, node: RadixNode) -> None:
        """Per-node part of ``check_integrity``."""
        page_size = self.page_size
        num_pages = len(node.page_ids)
        if not node.is_root and len(node.key) % page_size:
            raise AssertionError(f"{node!r} key of {len(node.key)} tokens is not page-aligned")
        if num_pages * page_size != len(node.key) or len(node.page_hashes) != num_pages:
            raise AssertionError(f"{node!r} key, page_ids and page_hashes disagree")
        below = [*node.children.values(), *(self.scopes.values() if node is self.root else ())]
        if node.own_locks < 0 or node.lock_ref != node.own_locks + sum(c.lock_ref for c in below):
            raise AssertionError(f"{node!r} breaks lock_ref == own_locks + children's")
        for first_page, child in node.children.items():
            if child.parent is not node or tuple(child.key[:page_size]) != first_page:
                raise AssertionError(f"{child!r} is keyed or linked wrongly under {node!r}")
            if child.last_access > node.last_access:
                raise AssertionError(f"{child!r} was accessed after its parent")
            if child.namespace != node.namespace:
                raise AssertionError(f"{child!r} is in another scope than its parent {node!r}")
        parent_hash = node.parent.last_hash if node.parent is not None else None
        expected = page_hashes(node.key, page_size, node.namespace, parent_hash)
        if node.page_hashes != expected:
            raise AssertionError(f"{node!r} page hashes differ from a recomputation")
