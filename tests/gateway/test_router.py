"""Decode routing: the worker holding the longest cached prefix wins until load makes
another cheaper (cost = uncached pages + load_weight * in-flight requests)."""

from __future__ import annotations

from radixserve.cache.block_hash import cache_scope, hash_namespace, page_hashes, scoped_namespace
from radixserve.runtime.routing.router import DecodeRouter, PrefixView, affinity_key

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


def test_scopes_hash_apart_and_route_apart():
    """A prompt of one cache scope is hashed in its namespace: another scope's requests
    (the same tokens) do not find it in a worker's view, nor a view of it in theirs."""
    r = router()
    prompt = list(range(40))
    mine = r.hashes(prompt, cache_scope(tenant="acme"))
    assert mine == page_hashes(
        prompt, PAGE, scoped_namespace(r.namespace, cache_scope(tenant="acme"))
    )
    assert mine != r.hashes(prompt) and r.hashes(prompt, "") == r.hashes(prompt)
    r.started("b", mine)
    r.finished("b", mine, prompt + [7] * 8, cache_scope(tenant="acme"))
    assert r.pick(["a", "b"], r.hashes(prompt + [7] * 8, cache_scope(tenant="acme"))) == "b"
    assert r.pick(["a", "b"], r.hashes(prompt, cache_scope(tenant="other"))) == "a"


def test_nothing_is_hashed_before_the_namespace_is_known():
    r = DecodeRouter(PAGE, b"", 2.0, 1000)
    assert r.hashes(list(range(40)), cache_scope(tenant="acme")) == [] and r.num_hashed == 0
    r.started("a", [])
    r.finished("a", [], list(range(40)))
    assert r.known_pages("a") == 0


def test_an_affinity_key_keeps_its_worker_until_it_is_overloaded():
    r = router()
    key = affinity_key("acme", "conversation-1")
    first = r.pick(["a", "b"], [], key)
    r.started(first, [])
    other = "b" if first == "a" else "a"
    for _ in range(4):  # the slack: up to 4 more in flight than the least loaded
        assert r.pick(["a", "b"], [], key) == first
        r.started(first, [])
    assert r.pick(["a", "b"], [], key) == other  # 5 over: routed by cost, the key follows
    r.started(other, [])
    assert r.pick(["a", "b"], [], key) == other
    assert r.pick([first], [], key) == first  # its worker gone from the candidates: remapped
    assert r.pick(["a", "b"], [], key) == first


def test_affinity_keys_are_per_tenant_and_bounded():
    assert affinity_key("acme", "k") != affinity_key("other", "k")
    assert affinity_key("a:1", "k") != affinity_key("a", "1:k")
    assert affinity_key("acme", "") == ""
    r = DecodeRouter(PAGE, hash_namespace("test-model"), 2.0, 1000, max_affinity_keys=2)
    assert r.pick(["a", "b"], [], "k1") == "a"
    r.started("a", [])
    assert r.pick(["a", "b"], [], "k2") == "b"  # less loaded
    assert r.pick(["a", "b"], [], "k1") == "a"  # kept: within the slack
    r.pick(["a", "b"], [], "k3")  # the third key: the least recent (k2) goes
    assert r.pick(["a", "b"], [], "k1") == "a"
    r.pick(["a", "b"], [], "k2")  # evicts k3
    r.pick(["a", "b"], [], "k3")  # evicts k1
    assert r.pick(["a", "b"], [], "k1") == "b"  # forgotten: routed by load
