"""The radix cache's operator view: per-node hit counts, last hit, recent request ids
(`RadixCache.note_use`), the largest nodes (`RadixCache.largest`), and the engine's
description of its tree and live requests (`radixserve.engine.cache_view`)."""

from __future__ import annotations

import time

from radixserve.cache.block_hash import cache_scope
from radixserve.cache.radix_cache import RECENT_IDS
from radixserve.engine.sampling_params import SamplingParams
from tests.cache.test_radix_cache import make_cache, run_request, seq
from tests.engine.engine_helpers import TINY, make_engine


def test_hits_count_every_node_on_the_path_and_the_ids_stay_where_the_prefix_ended() -> None:
    cache, allocator = make_cache()
    run_request(cache, allocator, seq(1, 2, 3))
    run_request(cache, allocator, seq(1, 2, 7))  # splits: [1 2] -> {[3], [7]}
    before = time.time()
    cache.note_use(cache.match_prefix(seq(1, 2, 3)).node, "a")
    cache.note_use(cache.match_prefix(seq(1, 2, 7)).node, "b")
    cache.note_use(cache.match_prefix(seq(1, 2)).node, "c")
    shared = cache.match_prefix(seq(1, 2)).node
    three = cache.match_prefix(seq(1, 2, 3)).node
    seven = cache.match_prefix(seq(1, 2, 7)).node
    assert (shared.hits, three.hits, seven.hits) == (3, 1, 1)
    assert shared.last_hit_s >= before and three.last_hit_s >= before
    assert (shared.recent_ids, three.recent_ids, seven.recent_ids) == (["c"], ["a"], ["b"])
    assert cache.root.hits == 0  # the root is no prefix
    cache.check_integrity()


def test_recent_ids_are_bounded_and_a_split_keeps_the_hit_counts() -> None:
    cache, allocator = make_cache()
    run_request(cache, allocator, seq(1, 2, 3))
    node = cache.match_prefix(seq(1, 2, 3)).node
    for i in range(RECENT_IDS + 5):
        cache.note_use(node, f"r{i}")
    assert node.recent_ids == [f"r{i}" for i in range(5, RECENT_IDS + 5)]
    upper = cache.match_prefix(seq(1, 2)).node  # splits the node after two pages
    assert upper is not node and upper.hits == node.hits == RECENT_IDS + 5
    cache.check_integrity()


def test_largest_picks_the_nodes_holding_most_pages_parents_first() -> None:
    cache, allocator = make_cache()
    run_request(cache, allocator, seq(1, 2, 3, 4, 5))
    run_request(cache, allocator, seq(1, 2, 9))
    run_request(cache, allocator, seq(8))
    chosen = cache.largest(3)
    pages = [(node.key[0], held) for node, held in chosen]
    # [1 2] holds 2 pages + [3 4 5] (3) + [9] (1); then its largest child; then [8] or [9]
    assert pages[:2] == [(1, 6), (3, 3)]
    assert len(chosen) == 3
    seen = {id(cache.root)}
    for node, _ in chosen:
        assert id(node.parent) in seen  # every chosen node's parent came before it
        seen.add(id(node))
    assert len(cache.largest(100)) == cache.num_nodes == 4
    assert cache.largest(0) == []


def test_the_engine_describes_its_tree_and_live_requests_without_text_unless_asked() -> None:
    engine = make_engine(TINY, kv_cache_memory_gib=0.01)
    system = list(range(100, 100 + 6 * engine.page_size))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.generate([system + [5, 6, 7]], params)
    engine.generate([system + [8, 9]], params)
    engine.add_request(system + [10, 11], SamplingParams(max_tokens=50), request_id="live-1")
    engine.step()
    reply = engine.cache_view("q", max_nodes=8, text_tokens=0)
    assert reply.query_id == "q" and reply.num_nodes >= 1 and reply.cached_pages >= 6
    shared = max(reply.nodes, key=lambda n: n.hits)
    assert shared.hits >= 2 and shared.prefix_tokens >= len(system) - engine.page_size
    assert "live-1" in shared.live_request_ids and shared.locks >= 1
    assert all(n.text == "" for n in reply.nodes)
    [live] = [r for r in reply.requests if r.request_id == "live-1"]
    assert live.phase in {"prefill", "decode"} and live.prompt_tokens == len(system) + 2
    texted = engine.cache_view("q", max_nodes=8, text_tokens=4)
    assert any(n.text for n in texted.nodes)
    engine.abort("live-1")


def test_the_view_shows_every_scope_each_from_its_own_top() -> None:
    """A scoped request's nodes are described like the default scope's: its first node
    has no parent in the view (its scope root is no prefix), its hits and live ids."""
    engine = make_engine(TINY, kv_cache_memory_gib=0.01)
    system = list(range(300, 300 + 4 * engine.page_size))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    scope = cache_scope(tenant="acme")
    for tail in ([5, 6], [7, 8]):
        engine.add_request(system + tail, params, cache_scope=scope)
        while engine.has_unfinished():
            engine.step()
    engine.generate([list(range(900, 900 + 2 * engine.page_size))], params)
    reply = engine.cache_view("q", max_nodes=8, text_tokens=0)
    ids = {n.node_id for n in reply.nodes}
    assert all(n.parent_id == 0 or n.parent_id in ids for n in reply.nodes)
    scoped = max(reply.nodes, key=lambda n: n.hits)
    assert scoped.parent_id == 0 and scoped.hits >= 1 and scoped.prefix_tokens == scoped.num_tokens
    assert reply.cached_pages == engine.cache.num_cached_pages
    assert engine.cache.num_scopes == 1
