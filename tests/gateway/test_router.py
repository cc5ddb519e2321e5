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
    turn1 = list(range(41))  # 10 full pages and one token
    hashes = r.hashes(turn1)
    first = r.pick(["a", "b"], hashes)
    r.started(first, hashes)
    r.finished(first, hashes, turn1 + [100, 101, 102, 103, 104])
    turn2 = turn1 + [100, 101, 102, 103, 104, 7, 8, 9]
    assert r.pick(["a", "b"], r.hashes(turn2)) == first
    # an unrelated prompt goes to the idle worker on ties of cache, by name
    assert r.pick(["a", "b"], r.hashes([500 + i for i in range(40)])) == "a"


def test_a_request_is_hashed_once_and_its_answer_extends_the_chain():
    """`finished` hashes only the pages past the prompt's, chained from its last: the view
    then holds exactly what hashing the whole conversation at once gives."""
    r = router()
    prompt, answer = list(range(10)), list(range(50, 61))  # 2 pages + 2; the answer 11
    hashes = r.hashes(prompt)
    assert r.num_hashed == 1
    r.started("a", hashes)
    r.finished("a", hashes, prompt + answer)
    assert r.num_hashed == 1
    whole = r.hashes(prompt + answer)  # 5 full pages
    assert r.known_pages("a") == len(whole) == 5
    assert r.pick(["a", "b"], whole) == "a"


def test_load_spreads_shared_prefix_traffic_once_it_outweighs_the_cache():
    r = router(load_weight=2.0)
    shared = r.hashes(list(range(16)))  # 4 pages known on "a"
    r.started("a", shared)
    r.finished("a", shared, None)
    prompt = r.hashes(list(range(16)) + [99] * 4)
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
    ids = r.hashes(list(range(32)))
    r.started("b", ids)
    r.finished("b", ids, None)
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
