"""Decode routing: the worker holding the longest cached prefix wins until load makes
another cheaper (cost = uncached pages + load_weight * in-flight requests)."""

from __future__ import annotations

from radixserve.cache.block_hash import hash_namespace
from radixserve.services.gateway.router import DecodeRouter, PrefixView

PAGE = 4


def router(load_weight: float = 2.0, max_pages: int = 1000) -> DecodeRouter:
    return DecodeRouter(PAGE, hash_namespace("test-model"), load_weight, max_pages)


def test_conversation_returns_to_the_worker_that_served_it():
    r = router()
    turn1 = list(range(40))
    first = r.pick(["a", "b"], turn1)
    r.started(first, turn1)
    r.finished(first, turn1 + [100, 101, 102, 103, 104])
    turn2 = turn1 + [100, 101, 102, 103, 104, 7, 8, 9]
    assert r.pick(["a", "b"], turn2) == first
    # an unrelated prompt goes to the idle worker on ties of cache, by name
    assert r.pick(["a", "b"], [500 + i for i in range(40)]) == "a"


def test_load_spreads_shared_prefix_traffic_once_it_outweighs_the_cache():
    r = router(load_weight=2.0)
    shared = list(range(16))  # 4 pages known on "a"
    r.started("a", shared)
    r.finished("a", shared)
    prompt = shared + [99] * 4
    # cost(a) = 5 - 4 + 2 * load_a, cost(b) = 5
    assert r.pick(["a", "b"], prompt) == "a"  # 1 < 5
    r.started("a", prompt)  # from now "a" is known to hold all 5 pages
    assert r.pick(["a", "b"], prompt) == "a"  # 0 + 2 = 2 < 5
    r.started("a", prompt)
    assert r.pick(["a", "b"], prompt) == "a"  # 0 + 4 = 4 < 5
    r.started("a", prompt)
    assert r.pick(["a", "b"], prompt) == "b"  # 0 + 6 > 5
    assert r.in_flight == {"a": 3}


def test_a_restarted_worker_is_forgotten():
    r = router()
    ids = list(range(32))
    r.started("b", ids)
    r.finished("b", ids)
    assert r.pick(["a", "b"], ids) == "b"
    r.forget("b")
    assert r.known_pages("b") == 0
    assert r.pick(["a", "b"], ids) == "a"


def test_prefix_view_is_bounded_lru_and_matches_only_from_the_start():
    view = PrefixView(max_pages=3)
    view.add([1, 2, 3])
    assert view.match([1, 2, 3, 4]) == 3
    assert view.match([7, 2]) == 0  # the first page decides: hashes are chained
    view.add([9])  # evicts the least recently used (1)
    assert len(view) == 3
    assert view.match([1, 2]) == 0
