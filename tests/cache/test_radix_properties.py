"""Stateful property test: allocator + radix cache against a naive prefix-dict model.

The model maps every cached page-aligned token prefix (a tuple) to the page id that
holds its last page. Requests take references like the engine does: match and lock a
prefix, hold refs on the matched pages, allocate pages for the rest, later insert the
whole sequence, unlock and drop every ref. Tiny alphabets and page sizes make prefixes
collide, so splits, duplicate inserts and locks under splits happen all the time.

Every walk runs in one of a few scopes (the cache's own namespace, given as None or
explicitly, and two scoped namespaces, `scoped_namespace`) over one shared history of
token sequences, so the same tokens are cached in several scopes: the model keys each
prefix by its namespace too, and a match must never reach another scope's pages.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache.block_hash import cache_scope, hash_namespace, page_hashes, scoped_namespace
from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.radix_tree import RadixNode

NAMESPACE = hash_namespace("property-model", salt="s")
TENANT_A = scoped_namespace(NAMESPACE, cache_scope(tenant="a"))
TENANT_A_SALTED = scoped_namespace(NAMESPACE, cache_scope(tenant="a", salt="x"))
# what a walk passes (None: the cache's own namespace) and what the model files it under
WALK_NAMESPACES: list[bytes | None] = [None, NAMESPACE, TENANT_A, TENANT_A_SALTED]
SCOPE = st.integers(0, len(WALK_NAMESPACES) - 1)
Prefix = tuple[bytes, tuple[int, ...]]  # (namespace, tokens)
# A query or request: a cut of an earlier sequence (so it shares a prefix with the
# tree, ending anywhere, inside nodes and pages too) followed by fresh tokens.
REUSE = st.tuples(st.integers(0, 63), st.integers(0, 16), st.lists(st.integers(0, 3), max_size=8))
MAX_REQUESTS = 3
MAX_LOCKS = 3


@dataclass
class Request:
    """A running request: its aligned tokens, the node it locked, the pages it holds."""

    tokens: list[int]
    node: RadixNode
    locked_prefix: Prefix
    pages: list[int]
    walk: bytes | None  # the namespace its walks pass


@dataclass
class Lock:
    node: RadixNode
    prefix: Prefix
    pages: list[int]
    walk: bytes | None


def model_namespace(walk: bytes | None) -> bytes:
    return NAMESPACE if walk is None else walk


def tree_prefixes(cache: RadixCache) -> dict[Prefix, int]:
    """Every cached (namespace, page-aligned prefix) -> its last page's id, read without
    touching LRU, from every scope's root."""
    out: dict[Prefix, int] = {}
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(root, ()) for root in cache.roots()]
    size = cache.page_size
    while stack:
        node, prefix = stack.pop()
        for index, page in enumerate(node.page_ids):
            out[(node.namespace, prefix + tuple(node.key[: (index + 1) * size]))] = page
        stack.extend((child, prefix + tuple(node.key)) for child in node.children.values())
    return out


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.integers(1, 4), num_pages=st.integers(6, 40))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.size = page_size
        self.allocator = PageAllocator(num_pages)
        self.live_hashes: Counter[int] = Counter()
        self.cache = RadixCache(self.allocator, page_size, NAMESPACE)
        self.cache.set_event_listener(self._on_event)
        self.model: dict[Prefix, int] = {}
        self.requests: list[Request] = []
        self.locks: list[Lock] = []
        self.history: list[list[int]] = []

    def _on_event(self, kind: str, hashes: list[int]) -> None:
        if kind == "stored":
            self.live_hashes.update(hashes)
        else:
            assert kind == "removed"
            self.live_hashes.subtract(hashes)
            assert min(self.live_hashes.values(), default=0) >= 0

    # -- model helpers -------------------------------------------------------------

    def compose(self, reuse: tuple[int, int, list[int]]) -> list[int]:
        source, cut, tail = reuse
        if not self.history:
            return tail
        return self.history[source % len(self.history)][:cut] + tail

    def aligned(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) - len(tokens) % self.size]

    def expected_pages(self, tokens: list[int], walk: bytes | None) -> list[int]:
        pages = []
        namespace = model_namespace(walk)
        for end in range(self.size, len(tokens) + 1, self.size):
            page = self.model.get((namespace, tuple(tokens[:end])))
            if page is None:
                break
            pages.append(page)
        return pages

    def locked_prefixes(self) -> list[Prefix]:
        return [r.locked_prefix for r in self.requests] + [lock.prefix for lock in self.locks]

    def evict_and_sync(self, num_pages: int) -> int:
        before = dict(self.model)
        evictable = self.cache.num_evictable_pages
        released = self.cache.evict(num_pages)
        after = tree_prefixes(self.cache)
        assert after.items() <= before.items(), "eviction changed or added pages"
        assert len(before) - len(after) == released
        if num_pages >= evictable:
            assert released == evictable
        else:
            assert num_pages <= released <= evictable
        for namespace, prefix in self.locked_prefixes():
            for end in range(self.size, len(prefix) + 1, self.size):
                assert (namespace, prefix[:end]) in after, "a locked prefix was evicted"
        self.model = after
        return released

    def make_room(self, num_pages: int) -> bool:
        missing = num_pages - self.allocator.num_free
        if missing > 0:
            self.evict_and_sync(missing)
        return self.allocator.num_free >= num_pages

    def insert_and_check(self, tokens: list[int], pages: list[int], walk: bytes | None) -> None:
        self.history.append(tokens)
        expected_cached = len(self.expected_pages(tokens, walk)) * self.size
        assert self.cache.insert(tokens, pages, walk) == expected_cached
        for index in range(expected_cached // self.size, len(pages)):
            prefix = tuple(tokens[: (index + 1) * self.size])
            self.model[(model_namespace(walk), prefix)] = pages[index]

    # -- rules ---------------------------------------------------------------------

    @rule(reuse=REUSE, scope=SCOPE)
    def insert_direct(self, reuse: tuple[int, int, list[int]], scope: int) -> None:
        walk = WALK_NAMESPACES[scope]
        tokens = self.aligned(self.compose(reuse))
        num_pages = len(tokens) // self.size
        if not self.make_room(num_pages):
            return
        pages = self.allocator.alloc(num_pages)
        cached_pages = len(self.expected_pages(tokens, walk))
        self.insert_and_check(tokens, pages, walk)
        self.allocator.decref(pages)
        for index, page in enumerate(pages):
            assert self.allocator.refcount(page) == (0 if index < cached_pages else 1)

    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(reuse=REUSE, scope=SCOPE)
    def start_request(self, reuse: tuple[int, int, list[int]], scope: int) -> None:
        walk = WALK_NAMESPACES[scope]
        tokens = self.compose(reuse)
        result = self.cache.match_prefix(tokens, walk)
        assert result.page_ids == self.expected_pages(tokens, walk)
        self.cache.lock(result.node)
        self.allocator.incref(result.page_ids)
        prefix = (model_namespace(walk), tuple(tokens[: result.num_tokens]))
        num_new = len(tokens) // self.size - len(result.page_ids)
        if not self.make_room(num_new):
            self.cache.unlock(result.node)
            self.allocator.decref(result.page_ids)
            return
        pages = result.page_ids + self.allocator.alloc(num_new)
        self.requests.append(Request(self.aligned(tokens), result.node, prefix, pages, walk))

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, MAX_REQUESTS - 1))
    def finish_request(self, index: int) -> None:
        request = self.requests.pop(index % len(self.requests))
        cached = len(self.expected_pages(request.tokens, request.walk)) * self.size
        assert cached >= len(request.locked_prefix[1])
        self.insert_and_check(request.tokens, request.pages, request.walk)
        self.cache.unlock(request.node)
        self.allocator.decref(request.pages)

    @rule(reuse=REUSE, scope=SCOPE)
    def match(self, reuse: tuple[int, int, list[int]], scope: int) -> None:
        walk = WALK_NAMESPACES[scope]
        tokens = self.compose(reuse)
        result = self.cache.match_prefix(tokens, walk)
        expected = self.expected_pages(tokens, walk)
        assert result.page_ids == expected
        assert result.num_tokens == len(expected) * self.size
        if expected:
            assert result.node.page_ids[-1] == expected[-1]
            assert result.node.namespace == model_namespace(walk)
            hashes = page_hashes(tokens[: result.num_tokens], self.size, model_namespace(walk))
            assert result.node.last_hash == hashes[-1]
        else:
            assert result.node.is_root and result.node.last_hash is None
            assert result.node.namespace in (model_namespace(walk), NAMESPACE)

    @precondition(lambda self: len(self.locks) < MAX_LOCKS)
    @rule(reuse=REUSE, scope=SCOPE)
    def lock(self, reuse: tuple[int, int, list[int]], scope: int) -> None:
        walk = WALK_NAMESPACES[scope]
        tokens = self.compose(reuse)
        result = self.cache.match_prefix(tokens, walk)
        self.cache.lock(result.node)
        prefix = (model_namespace(walk), tuple(tokens[: result.num_tokens]))
        self.locks.append(Lock(result.node, prefix, result.page_ids, walk))

    @precondition(lambda self: self.locks)
    @rule(index=st.integers(0, MAX_LOCKS - 1))
    def unlock(self, index: int) -> None:
        lock = self.locks.pop(index % len(self.locks))
        self.cache.unlock(lock.node)

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages: int) -> None:
        self.evict_and_sync(num_pages)
        for lock in self.locks:
            assert self.cache.match_prefix(list(lock.prefix[1]), lock.walk).page_ids == lock.pages

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def structures_are_consistent(self) -> None:  # after every step
        self.allocator.check_integrity()
        self.cache.check_integrity()
        assert tree_prefixes(self.cache) == self.model

    @invariant()
    def pages_are_neither_leaked_nor_shared_wrongly(self) -> None:
        holders = Counter(self.model.values())
        for request in self.requests:
            holders.update(request.pages)
        assert self.allocator.num_used == len(holders)
        for page in range(self.allocator.num_pages):
            assert self.allocator.refcount(page) == holders[page]

    @invariant()
    def counters_match_the_model(self) -> None:
        locked = {
            (namespace, prefix[:end])
            for namespace, prefix in self.locked_prefixes()
            for end in range(self.size, len(prefix) + 1, self.size)
        }
        assert self.cache.num_cached_pages == len(self.model)
        assert self.cache.num_locked_pages == len(locked)
        assert self.cache.num_evictable_pages == len(self.model) - len(locked)
        assert self.cache.root.lock_ref == len(self.requests) + len(self.locks)

    @invariant()
    def events_describe_the_tree(self) -> None:
        tree_hashes = Counter(
            page_hashes(list(prefix), self.size, namespace)[-1] for namespace, prefix in self.model
        )
        assert +self.live_hashes == tree_hashes

    @invariant()
    def scope_roots_live_only_while_used(self) -> None:
        """A scope root exists exactly while its scope has pages or a lock on it."""
        held = [r.node for r in self.requests] + [lock.node for lock in self.locks]
        used = {namespace for namespace, _ in self.model} | {n.namespace for n in held}
        used.discard(NAMESPACE)
        assert {root.namespace for root in self.cache.roots()[1:]} == used
        assert self.cache.num_scopes == len(used)


RadixMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestRadixCacheStateful = RadixMachine.TestCase
