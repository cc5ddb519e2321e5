"""Stateful property test: allocator + radix cache against a naive prefix-dict model.

The model maps every cached page-aligned token prefix (a tuple) to the page id that
holds its last page. Requests take references like the engine does: match and lock a
prefix, hold refs on the matched pages, allocate pages for the rest, later insert the
whole sequence, unlock and drop every ref. Tiny alphabets and page sizes make prefixes
collide, so splits, duplicate inserts and locks under splits happen all the time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache.block_hash import hash_namespace, page_hashes
from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import RadixCache, RadixNode

NAMESPACE = hash_namespace("property-model", salt="s")
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
    locked_prefix: tuple[int, ...]
    pages: list[int]


@dataclass
class Lock:
    node: RadixNode
    prefix: tuple[int, ...]
    pages: list[int]


def tree_prefixes(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached page-aligned prefix -> its last page's id, read without touching LRU."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(cache.root, ())]
    size = cache.page_size
    while stack:
        node, prefix = stack.pop()
        for index, page in enumerate(node.page_ids):
            out[prefix + tuple(node.key[: (index + 1) * size])] = page
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
        self.model: dict[tuple[int, ...], int] = {}
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

    def expected_pages(self, tokens: list[int]) -> list[int]:
        pages = []
        for end in range(self.size, len(tokens) + 1, self.size):
            page = self.model.get(tuple(tokens[:end]))
            if page is None:
                break
            pages.append(page)
        return pages

    def locked_prefixes(self) -> list[tuple[int, ...]]:
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
        for prefix in self.locked_prefixes():
            for end in range(self.size, len(prefix) + 1, self.size):
                assert prefix[:end] in after, "a locked prefix was evicted"
        self.model = after
        return released

    def make_room(self, num_pages: int) -> bool:
        missing = num_pages - self.allocator.num_free
        if missing > 0:
            self.evict_and_sync(missing)
        return self.allocator.num_free >= num_pages

    def insert_and_check(self, tokens: list[int], pages: list[int]) -> None:
        self.history.append(tokens)
        expected_cached = len(self.expected_pages(tokens)) * self.size
        assert self.cache.insert(tokens, pages) == expected_cached
        for index in range(expected_cached // self.size, len(pages)):
            self.model[tuple(tokens[: (index + 1) * self.size])] = pages[index]

    # -- rules ---------------------------------------------------------------------

    @rule(reuse=REUSE)
    def insert_direct(self, reuse: tuple[int, int, list[int]]) -> None:
        tokens = self.aligned(self.compose(reuse))
        num_pages = len(tokens) // self.size
        if not self.make_room(num_pages):
            return
        pages = self.allocator.alloc(num_pages)
        cached_pages = len(self.expected_pages(tokens))
        self.insert_and_check(tokens, pages)
        self.allocator.decref(pages)
        for index, page in enumerate(pages):
            assert self.allocator.refcount(page) == (0 if index < cached_pages else 1)

    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(reuse=REUSE)
    def start_request(self, reuse: tuple[int, int, list[int]]) -> None:
        tokens = self.compose(reuse)
        result = self.cache.match_prefix(tokens)
        assert result.page_ids == self.expected_pages(tokens)
        self.cache.lock(result.node)
        self.allocator.incref(result.page_ids)
        prefix = tuple(tokens[: result.num_tokens])
        num_new = len(tokens) // self.size - len(result.page_ids)
        if not self.make_room(num_new):
            self.cache.unlock(result.node)
            self.allocator.decref(result.page_ids)
            return
        pages = result.page_ids + self.allocator.alloc(num_new)
        self.requests.append(Request(self.aligned(tokens), result.node, prefix, pages))

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, MAX_REQUESTS - 1))
    def finish_request(self, index: int) -> None:
        request = self.requests.pop(index % len(self.requests))
        assert len(self.expected_pages(request.tokens)) * self.size >= len(request.locked_prefix)
        self.insert_and_check(request.tokens, request.pages)
        self.cache.unlock(request.node)
        self.allocator.decref(request.pages)

    @rule(reuse=REUSE)
    def match(self, reuse: tuple[int, int, list[int]]) -> None:
        tokens = self.compose(reuse)
        result = self.cache.match_prefix(tokens)
        expected = self.expected_pages(tokens)
        assert result.page_ids == expected
        assert result.num_tokens == len(expected) * self.size
        if expected:
            assert result.node.page_ids[-1] == expected[-1]
            hashes = page_hashes(tokens[: result.num_tokens], self.size, NAMESPACE)
            assert result.last_hash == hashes[-1]
        else:
            assert result.node is self.cache.root and result.last_hash is None

    @precondition(lambda self: len(self.locks) < MAX_LOCKS)
    @rule(reuse=REUSE)
    def lock(self, reuse: tuple[int, int, list[int]]) -> None:
        tokens = self.compose(reuse)
        result = self.cache.match_prefix(tokens)
        self.cache.lock(result.node)
        self.locks.append(Lock(result.node, tuple(tokens[: result.num_tokens]), result.page_ids))

    @precondition(lambda self: self.locks)
    @rule(index=st.integers(0, MAX_LOCKS - 1))
    def unlock(self, index: int) -> None:
        lock = self.locks.pop(index % len(self.locks))
        self.cache.unlock(lock.node)

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages: int) -> None:
        self.evict_and_sync(num_pages)
        for lock in self.locks:
            assert self.cache.match_prefix(list(lock.prefix)).page_ids == lock.pages

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def structures_are_consistent(self) -> None:
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
            prefix[:end]
            for prefix in self.locked_prefixes()
            for end in range(self.size, len(prefix) + 1, self.size)
        }
        assert self.cache.num_cached_pages == len(self.model)
        assert self.cache.num_locked_pages == len(locked)
        assert self.cache.num_evictable_pages == len(self.model) - len(locked)
        assert self.cache.root.lock_ref == len(self.requests) + len(self.locks)

    @invariant()
    def events_describe_the_tree(self) -> None:
        tree_hashes = Counter(
            page_hashes(list(prefix), self.size, NAMESPACE)[-1] for prefix in self.model
        )
        assert +self.live_hashes == tree_hashes


RadixMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestRadixCacheStateful = RadixMachine.TestCase
