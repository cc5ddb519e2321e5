"""RadixCache unit tests: matching, splitting, duplicate inserts, locks, LRU eviction."""

from __future__ import annotations

import pytest

from bench.radix_match import time_match_prefix
from radixserve.cache.block_hash import cache_scope, hash_namespace, page_hashes, scoped_namespace
from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.page_proof import PageProof
from radixserve.cache.radix_cache import RadixCache

PAGE = 4
NAMESPACE = hash_namespace("test-model")


def make_cache(
    num_pages: int = 64, events: list[tuple[str, list[int]]] | None = None
) -> tuple[RadixCache, PageAllocator]:
    allocator = PageAllocator(num_pages)
    cache = RadixCache(allocator, PAGE, NAMESPACE)
    if events is not None:
        cache.set_event_listener(lambda kind, hashes: events.append((kind, hashes)))
    return cache, allocator


def run_request(cache: RadixCache, allocator: PageAllocator, tokens: list[int]) -> list[int]:
    """Allocate pages for ``tokens`` like a request, insert them, drop the request's refs."""
    pages = allocator.alloc(len(tokens) // PAGE)
    cache.insert(tokens, pages)
    allocator.decref(pages)
    cache.check_integrity()
    return pages


def seq(*page_starts: int) -> list[int]:
    """Tokens of whole pages; page ``s`` holds ``[s, s, s, s]``, easy to read in failures."""
    return [start for start in page_starts for _ in range(PAGE)]


def test_match_on_empty_tree() -> None:
    cache, _ = make_cache()
    result = cache.match_prefix(seq(1, 2))
    assert result.page_ids == []
    assert result.node is cache.root
    assert result.num_tokens == 0
    assert result.node.last_hash is None
    assert cache.num_cached_pages == 0


def test_insert_then_full_match() -> None:
    cache, allocator = make_cache()
    pages = run_request(cache, allocator, seq(1, 2, 3))
    result = cache.match_prefix(seq(1, 2, 3))
    assert result.page_ids == pages
    assert result.num_tokens == 3 * PAGE
    assert result.node.last_hash == page_hashes(seq(1, 2, 3), PAGE, NAMESPACE)[-1]
    assert cache.num_cached_pages == 3
    assert allocator.num_used == 3
    assert all(allocator.refcount(page) == 1 for page in pages)  # the tree's reference


def test_match_ending_inside_a_node_splits_it() -> None:
    cache, allocator = make_cache()
    pages = run_request(cache, allocator, seq(1, 2, 3, 4))
    [whole] = cache.root.children.values()
    result = cache.match_prefix(seq(1, 2, 9))
    assert result.page_ids == pages[:2]
    assert result.num_tokens == 2 * PAGE
    assert result.node.page_ids == pages[:2]
    assert result.node.parent is cache.root
    # The existing node object keeps the lower half.
    assert whole.parent is result.node
    assert whole.page_ids == pages[2:]
    assert result.node.last_hash == page_hashes(seq(1, 2), PAGE, NAMESPACE)[-1]
    cache.check_integrity()
    assert cache.match_prefix(seq(1, 2, 3, 4)).page_ids == pages


def test_divergence_inside_a_page_matches_only_pages_before_it() -> None:
    cache, allocator = make_cache()
    pages = run_request(cache, allocator, seq(1, 2, 3))
    tokens = seq(1, 2, 3)
    tokens[2 * PAGE + 1] = 99
    assert cache.match_prefix(tokens).page_ids == pages[:2]
    tokens[0] = 99
    assert cache.match_prefix(tokens).page_ids == []
    cache.check_integrity()


@pytest.mark.parametrize("num_pages", [2, 3, 5, 16, 17])
def test_divergence_at_every_page_of_a_long_node(num_pages: int) -> None:
    stored = seq(*range(1, num_pages + 1))
    for diverge in range(1, num_pages + 1):
        cache, allocator = make_cache()
        pages = run_request(cache, allocator, stored)
        query = stored[: diverge * PAGE] + seq(99) + stored[(diverge + 1) * PAGE :]
        result = cache.match_prefix(query)
        assert result.page_ids == pages[:diverge], f"diverging at page {diverge}"
        assert result.node.page_ids[-1] == pages[diverge - 1]
        cache.check_integrity()
        assert cache.match_prefix(stored).page_ids == pages


def test_trailing_partial_page_never_matches() -> None:
    cache, allocator = make_cache()
    pages = run_request(cache, allocator, seq(1, 2))
    assert cache.match_prefix(seq(1, 2) + [3, 3]).page_ids == pages
    assert cache.match_prefix(seq(1, 2)[: PAGE + 3]).page_ids == pages[:1]
    assert cache.match_prefix(seq(1)[: PAGE - 1]).page_ids == []
    cache.check_integrity()


def test_insert_rejects_misaligned_input() -> None:
    cache, allocator = make_cache()
    pages = allocator.alloc(2)
    with pytest.raises(ValueError):
        cache.insert(seq(1, 2)[:-1], pages)
    with pytest.raises(ValueError):
        cache.insert(seq(1, 2), pages[:1])
    assert cache.num_cached_pages == 0


def test_duplicate_insert_keeps_tree_pages_and_frees_the_callers() -> None:
    cache, allocator = make_cache(num_pages=8)
    first = run_request(cache, allocator, seq(1, 2, 3))
    duplicate = allocator.alloc(3)
    assert cache.insert(seq(1, 2, 3), duplicate) == 3 * PAGE
    assert all(allocator.refcount(page) == 1 for page in duplicate)  # tree took none
    assert allocator.decref(duplicate) == 3
    assert allocator.num_used == 3
    assert cache.match_prefix(seq(1, 2, 3)).page_ids == first
    cache.check_integrity()


def test_partially_cached_insert_takes_only_the_new_tail() -> None:
    cache, allocator = make_cache(num_pages=8)
    first = run_request(cache, allocator, seq(1, 2, 3))
    request = allocator.alloc(4)
    assert cache.insert(seq(1, 2, 7, 8), request) == 2 * PAGE
    assert allocator.decref(request) == 2  # the two duplicate head pages
    assert cache.match_prefix(seq(1, 2, 7, 8)).page_ids == first[:2] + request[2:]
    assert cache.match_prefix(seq(1, 2, 3)).page_ids == first
    assert cache.num_cached_pages == 5
    assert allocator.num_used == 5
    cache.check_integrity()


def test_eviction_is_least_recently_used_first() -> None:
    cache, allocator = make_cache()
    a = run_request(cache, allocator, seq(1, 2))
    b = run_request(cache, allocator, seq(1, 3))
    c = run_request(cache, allocator, seq(1, 4))
    cache.match_prefix(seq(1, 2))  # a is now the most recent, b the oldest
    assert cache.evict(1) == 1
    assert cache.match_prefix(seq(1, 3)).page_ids == a[:1]  # b's [3] page went first
    assert allocator.refcount(b[1]) == 0 and allocator.refcount(c[1]) == 1
    assert cache.evict(1) == 1
    assert cache.match_prefix(seq(1, 4)).page_ids == a[:1]
    assert cache.match_prefix(seq(1, 2)).page_ids == a
    assert allocator.refcount(b[1]) == 0 and allocator.refcount(c[1]) == 0
    assert cache.num_cached_pages == 2
    cache.check_integrity()


def test_evict_frees_children_before_parents() -> None:
    events: list[tuple[str, list[int]]] = []
    cache, allocator = make_cache(events=events)
    run_request(cache, allocator, seq(1, 2))
    run_request(cache, allocator, seq(1, 2, 3, 4))
    run_request(cache, allocator, seq(1, 5))
    cache.match_prefix(seq(1, 5))  # the shared head [1] is now recent too
    events.clear()
    assert cache.evict(100) == 5
    removed = [hashes for kind, hashes in events if kind == "removed"]
    head_hash = page_hashes(seq(1), PAGE, NAMESPACE)[0]
    assert removed[-1] == [head_hash]  # the shared root-level page goes last
    assert sum(len(hashes) for hashes in removed) == 5
    assert cache.num_cached_pages == 0 and allocator.num_used == 0
    assert cache.root.children == {}
    cache.check_integrity()


def test_evict_releases_whole_nodes_and_stops_when_enough() -> None:
    cache, allocator = make_cache()
    run_request(cache, allocator, seq(1, 2, 3))
    run_request(cache, allocator, seq(5))
    cache.match_prefix(seq(5))
    assert cache.evict(1) == 3  # the LRU leaf is the 3-page node
    assert cache.num_cached_pages == 1
    assert cache.evict(0) == 0
    assert cache.num_cached_pages == 1


def test_locked_path_is_never_evicted() -> None:
    cache, allocator = make_cache()
    pages = run_request(cache, allocator, seq(1, 2, 3))
    other = run_request(cache, allocator, seq(1, 7))
    result = cache.match_prefix(seq(1, 2))  # splits: [1] / [2] / [3] and [7]
    cache.lock(result.node)
    assert cache.num_locked_pages == 2
    assert cache.num_evictable_pages == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix(seq(1, 2, 3)).page_ids == pages[:2]
    assert allocator.refcount(other[1]) == 0
    cache.check_integrity()
    cache.unlock(result.node)
    assert cache.num_locked_pages == 0
    assert cache.evict(100) == 2
    assert allocator.num_used == 0
    cache.check_integrity()


def test_split_carries_locks_to_both_halves() -> None:
    cache, allocator = make_cache()
    run_request(cache, allocator, seq(1, 2, 3, 4))
    deep = cache.match_prefix(seq(1, 2, 3, 4)).node
    cache.lock(deep)
    cache.lock(deep)
    upper = cache.match_prefix(seq(1, 2)).node  # split of the locked node
    assert deep.parent is upper
    assert upper.lock_ref == deep.lock_ref == 2
    assert upper.own_locks == 0 and deep.own_locks == 2
    assert cache.root.lock_ref == 2
    assert cache.num_locked_pages == 4
    cache.check_integrity()
    run_request(cache, allocator, seq(1, 2, 9))  # a new unlocked branch under the lock
    assert cache.evict(100) == 1
    cache.unlock(deep)
    cache.unlock(deep)
    assert upper.lock_ref == 0 and cache.num_evictable_pages == 4
    cache.check_integrity()


def test_unlock_without_lock_raises() -> None:
    cache, allocator = make_cache()
    run_request(cache, allocator, seq(1, 2))
    node = cache.match_prefix(seq(1, 2)).node
    with pytest.raises(RuntimeError):
        cache.unlock(node)
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(RuntimeError):
        cache.unlock(node)
    # An ancestor that is locked only through a descendant cannot be unlocked either.
    cache.lock(node)
    with pytest.raises(RuntimeError):
        cache.unlock(cache.match_prefix(seq(1)).node)
    cache.check_integrity()


def test_locking_the_root_protects_nothing_but_is_counted() -> None:
    cache, allocator = make_cache()
    run_request(cache, allocator, seq(1))
    root = cache.match_prefix(seq(9)).node
    cache.lock(root)
    assert cache.root.lock_ref == 1 and cache.num_locked_pages == 0
    assert cache.evict(1) == 1
    cache.unlock(root)
    cache.check_integrity()


def test_locking_an_evicted_node_raises() -> None:
    cache, allocator = make_cache()
    run_request(cache, allocator, seq(1))
    node = cache.match_prefix(seq(1)).node
    cache.evict(1)
    with pytest.raises(ValueError):
        cache.lock(node)


def test_events_report_stored_and_removed_hashes() -> None:
    events: list[tuple[str, list[int]]] = []
    cache, allocator = make_cache(events=events)
    run_request(cache, allocator, seq(1, 2))
    run_request(cache, allocator, seq(1, 2, 3))
    expected = page_hashes(seq(1, 2, 3), PAGE, NAMESPACE)
    assert events == [("stored", expected[:2]), ("stored", expected[2:])]
    cache.match_prefix(seq(1))  # a split is not an event
    assert len(events) == 2
    cache.evict(1)
    assert events[-1] == ("removed", expected[2:])


def test_check_integrity_detects_corruption() -> None:
    cache, allocator = make_cache()
    run_request(cache, allocator, seq(1, 2))
    node = cache.match_prefix(seq(1, 2)).node
    node.lock_ref = 1  # a lock count that no lock() explains
    with pytest.raises(AssertionError):
        cache.check_integrity()
    node.lock_ref = 0
    node.page_hashes = [0, 0]
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_match_accepts_any_sequence_type() -> None:
    cache, allocator = make_cache()
    pages = run_request(cache, allocator, seq(1, 2))
    assert cache.match_prefix(tuple(seq(1, 2))).page_ids == pages
    assert cache.match_prefix(range(1, 2)).page_ids == []


def test_the_match_benchmark_matches_its_whole_prompt() -> None:
    """The timing is the benchmark's to report; here, that it times a full match."""
    stats = time_match_prefix(num_tokens=1024, page_size=16, repeats=5)
    assert stats["matched_tokens"] == stats["num_tokens"] == 1024
    assert stats["repeats"] == 5


# -- spilling to the host tier -------------------------------------------------------


def test_eviction_hands_pages_to_the_spill_listener_before_freeing_them() -> None:
    cache, allocator = make_cache()
    spilled: list[tuple[list[int], list[int], list[int]]] = []

    def on_spill(hashes: list[int], pages: list[int], proofs: list[PageProof]) -> None:
        # the pages are still allocated while the listener copies them, each with the
        # tokens its hash is recomputed from
        assert all(proof.verifies(h) for proof, h in zip(proofs, hashes, strict=True))
        spilled.append((hashes, pages, [allocator.refcount(p) for p in pages]))

    cache.set_spill_listener(on_spill)
    pages = run_request(cache, allocator, seq(1, 2, 3))
    assert spilled == []  # write-back: nothing until eviction
    assert cache.evict(3) == 3
    assert spilled == [(page_hashes(seq(1, 2, 3), PAGE, NAMESPACE), pages, [1, 1, 1])]
    assert allocator.num_free == 64
    cache.set_spill_listener(None)
    run_request(cache, allocator, seq(4))
    cache.evict(1)
    assert len(spilled) == 1  # no listener, no spill


def test_write_through_writes_a_prefix_once_it_is_used_enough() -> None:
    cache, allocator = make_cache()
    spilled: list[list[int]] = []
    cache.set_spill_listener(
        lambda hashes, pages, proofs: spilled.append(hashes), write_through_uses=2
    )
    run_request(cache, allocator, seq(1, 2, 3))
    assert spilled == []  # used once (computed)
    match = cache.match_prefix(seq(1, 2))  # a request starts from two pages of it
    cache.note_use(match.node)
    assert spilled == [page_hashes(seq(1, 2), PAGE, NAMESPACE)]  # root first, the used part
    cache.note_use(cache.match_prefix(seq(1, 2)).node)
    assert len(spilled) == 1  # written once
    cache.evict(64)
    tail = page_hashes(seq(1, 2, 3), PAGE, NAMESPACE)[2:]
    assert spilled[1:] == [tail]  # eviction spills only what was not written
    cache.check_integrity()


def test_write_through_on_store_and_clear_written() -> None:
    cache, allocator = make_cache()
    spilled: list[list[int]] = []
    cache.set_spill_listener(
        lambda hashes, pages, proofs: spilled.append(hashes), write_through_uses=1
    )
    run_request(cache, allocator, seq(1, 2))
    run_request(cache, allocator, seq(1, 2, 3))
    assert spilled == [
        page_hashes(seq(1, 2), PAGE, NAMESPACE),
        page_hashes(seq(1, 2, 3), PAGE, NAMESPACE)[2:],
    ]
    cache.clear_written()  # the tier was emptied: eviction spills everything again
    cache.evict(64)
    assert sorted(h for hashes in spilled[2:] for h in hashes) == sorted(
        page_hashes(seq(1, 2, 3), PAGE, NAMESPACE)
    )


def test_drop_unlocked_removes_every_unlocked_node_and_spills_none() -> None:
    events: list[tuple[str, list[int]]] = []
    cache, allocator = make_cache(events=events)
    spilled: list[list[int]] = []
    cache.set_spill_listener(lambda hashes, pages, proofs: spilled.append(pages))
    run_request(cache, allocator, seq(1, 2, 3))
    run_request(cache, allocator, seq(1, 2, 7, 8))
    run_request(cache, allocator, seq(5, 6))
    locked = cache.match_prefix(seq(5, 6))
    cache.lock(locked.node)
    assert cache.drop_unlocked() == 5  # the shared 1, 2, then 3 and 7, 8: all but 5, 6
    cache.check_integrity()
    assert spilled == []
    assert cache.num_cached_pages == 2 and allocator.num_used == 2
    assert sum(len(hashes) for kind, hashes in events if kind == "removed") == 5
    cache.unlock(locked.node)
    assert cache.drop_unlocked() == 2 and allocator.num_used == 0


# -- scopes ----------------------------------------------------------------------------

TENANT_A = scoped_namespace(NAMESPACE, cache_scope(tenant="a"))
TENANT_B = scoped_namespace(NAMESPACE, cache_scope(tenant="b"))


def run_scoped(
    cache: RadixCache, allocator: PageAllocator, tokens: list[int], namespace: bytes | None
) -> list[int]:
    pages = allocator.alloc(len(tokens) // PAGE)
    cache.insert(tokens, pages, namespace)
    allocator.decref(pages)
    cache.check_integrity()
    return pages


def test_two_scopes_never_share_a_page() -> None:
    cache, allocator = make_cache()
    own = run_scoped(cache, allocator, seq(1, 2, 3), None)
    a = run_scoped(cache, allocator, seq(1, 2, 3), TENANT_A)
    b = run_scoped(cache, allocator, seq(1, 2, 3), TENANT_B)
    assert len({*own, *a, *b}) == 9  # the same tokens, cached three times
    assert cache.match_prefix(seq(1, 2, 3)).page_ids == own
    assert cache.match_prefix(seq(1, 2, 3), NAMESPACE).page_ids == own
    assert cache.match_prefix(seq(1, 2, 3, 4), TENANT_A).page_ids == a
    assert cache.match_prefix(seq(1, 2), TENANT_B).page_ids == b[:2]
    unknown = scoped_namespace(NAMESPACE, cache_scope(tenant="c"))
    miss = cache.match_prefix(seq(1, 2, 3), unknown)
    assert (miss.page_ids, miss.num_tokens, miss.node) == ([], 0, cache.root)
    assert cache.num_scopes == 2  # a match in a scope with nothing cached makes no root


def test_scoped_pages_are_hashed_in_their_namespace() -> None:
    cache, allocator = make_cache()
    run_scoped(cache, allocator, seq(5, 6), TENANT_A)
    match = cache.match_prefix(seq(5, 6), TENANT_A)
    assert match.node.last_hash == page_hashes(seq(5, 6), PAGE, TENANT_A)[-1]
    assert match.node.last_hash != page_hashes(seq(5, 6), PAGE, NAMESPACE)[-1]
    assert sorted(cache.all_page_hashes()) == sorted(page_hashes(seq(5, 6), PAGE, TENANT_A))


def test_a_scope_root_goes_once_its_scope_holds_nothing() -> None:
    cache, allocator = make_cache()
    run_scoped(cache, allocator, seq(1, 2), TENANT_A)
    match = cache.match_prefix(seq(9), TENANT_A)  # the scope's root, nothing matched
    assert match.node.is_root and match.node is not cache.root
    cache.lock(match.node)
    assert cache.evict(64) == 2  # the scope's pages go; its locked root stays
    assert cache.num_scopes == 1
    cache.check_integrity()
    cache.unlock(match.node)
    assert cache.num_scopes == 0 and cache.num_locks == 0
    cache.check_integrity()
    with pytest.raises(ValueError, match="no longer in the tree"):
        cache.lock(match.node)


def test_locks_in_a_scope_count_on_the_root_and_protect_the_scope() -> None:
    cache, allocator = make_cache()
    run_scoped(cache, allocator, seq(1, 2), TENANT_A)
    run_scoped(cache, allocator, seq(1, 2), None)
    node = cache.match_prefix(seq(1, 2), TENANT_A).node
    cache.lock(node)
    assert cache.num_locks == 1 and cache.num_locked_pages == 2
    assert cache.evict(64) == 2  # the default scope's copy only
    assert cache.match_prefix(seq(1, 2), TENANT_A).num_tokens == 2 * PAGE
    assert cache.match_prefix(seq(1, 2)).num_tokens == 0
    cache.unlock(node)
    cache.check_integrity()


def test_views_cover_every_scope() -> None:
    cache, allocator = make_cache()
    run_scoped(cache, allocator, seq(1, 2, 3), TENANT_A)
    run_scoped(cache, allocator, seq(4), None)
    assert cache.num_nodes == 2
    assert [pages for _, pages in cache.largest(8)] == [3, 1]
    assert cache.drop_unlocked() == 4
    assert cache.num_scopes == 0 and cache.num_cached_pages == 0
    cache.check_integrity()


def test_check_integrity_detects_a_node_in_another_scope() -> None:
    cache, allocator = make_cache()
    run_scoped(cache, allocator, seq(1, 2), TENANT_A)
    node = cache.match_prefix(seq(1, 2), TENANT_A).node
    node.namespace = TENANT_B
    with pytest.raises(AssertionError, match="another scope"):
        cache.check_integrity()
