"""The engine's side of the host tier: loading a prefix into the cache, and every way a
load can end without leaking a page or a lock.

The host tier's bytes are played here by the pages of a second engine that computed the
prompt (the copy stands in for the NIXL read the cluster does; the real path runs in
tests/cluster/test_host_tier.py).
"""

from __future__ import annotations

import pytest

from radixserve.cache.block_hash import page_hashes
from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def source():
    """An engine that computed the prompt: its cached pages are the 'host tier'."""
    return make_engine("default", kv_cache_memory_gib=0.05)


def fresh():
    return make_engine("default", kv_cache_memory_gib=0.05)


def prompt_ids(engine) -> list[int]:
    text = "The host tier keeps what the device pool evicts. " * 12
    return engine.tokenize(text)


def path_to(engine, node) -> list:
    """The radix nodes from the root's child down to ``node``."""
    path = []
    while node is not engine.cache.root:
        path.append(node)
        node = node.parent
    return path[::-1]


def leak_free(engine) -> None:
    stats = engine.cache_stats()
    assert stats["pages_locked"] == 0 and stats["live_requests"] == 0
    assert stats["host_loads_in_flight"] == 0
    assert stats["pages_used"] == stats["pages_cached"]
    engine.cache.check_integrity()


def test_a_prefix_loaded_into_the_cache_serves_like_a_device_hit(source):
    ids = prompt_ids(source)
    expected = source.generate([ids], GREEDY)[0]
    size = source.page_size
    held = source.cache.match_prefix(ids[:-1])
    engine = fresh()
    full = (len(ids) - 1) // size
    # the "host tier" is keyed by the pages' chained hashes, the same on both engines
    assert page_hashes(ids[: full * size], size, engine.cache.namespace) == [
        h for node in path_to(source, held.node) for h in node.page_hashes
    ]

    pages = engine.begin_host_load("load-1", ids, 0, full)
    assert pages is not None and len(pages) == full
    assert engine.cache_stats()["pages_locked"] == 0  # nothing cached to lock yet
    engine.kv_pool.kv[:, :, pages] = source.kv_pool.kv[:, :, held.page_ids]  # "the read"
    assert engine.finish_host_load("load-1", ok=True) == full * size
    assert engine.cached_prefix_tokens(ids) == full * size

    rid = engine.add_request(ids, GREEDY, host_cached_tokens=full * size)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    assert outputs[0].cached_tokens == outputs[0].host_cached_tokens == full * size
    assert [t for o in outputs for t in o.new_token_ids] == expected.token_ids
    leak_free(engine)


def test_a_failed_or_refused_load_returns_everything(source):
    ids = prompt_ids(source)
    engine = fresh()
    free = engine.allocator.num_free
    pages = engine.begin_host_load("load-2", ids, 0, 3)
    assert pages is not None and engine.allocator.num_free == free - 3
    assert engine.finish_host_load("load-2", ok=False) == 0
    assert engine.allocator.num_free == free and engine.cache.num_cached_pages == 0
    assert engine.finish_host_load("load-2", ok=True) == 0  # unknown now: nothing happens

    # a device head that is no longer cached, a load reaching the last token, or a
    # pool that cannot spare the pages: refused, nothing held
    assert engine.begin_host_load("load-3", ids, 1, 2) is None
    too_many = len(ids) // engine.page_size + 1
    assert engine.begin_host_load("load-4", ids, 0, too_many) is None
    huge = engine.tokenize("word " * (engine.capacity_tokens + 64))
    assert engine.begin_host_load("load-5", huge, 0, engine.allocator.num_pages + 1) is None
    leak_free(engine)


def test_a_load_extends_the_device_head_it_locked(source):
    ids = prompt_ids(source)
    size = source.page_size
    held = source.cache.match_prefix(ids[:-1])
    engine = fresh()
    head = 2
    engine.generate([ids[: head * size + 1]], SamplingParams(max_tokens=1))  # caches 2 pages
    assert engine.cached_prefix_tokens(ids) == head * size
    rest = (len(ids) - 1) // size - head
    pages = engine.begin_host_load("load-6", ids, head, rest)
    assert pages is not None
    assert engine.cache_stats()["pages_locked"] == head  # the head cannot be evicted
    engine.kv_pool.kv[:, :, pages] = source.kv_pool.kv[:, :, held.page_ids[head:]]
    assert engine.finish_host_load("load-6", ok=True) == rest * size
    assert engine.cached_prefix_tokens(ids) == (head + rest) * size
    assert (
        engine.generate([ids], GREEDY)[0].token_ids == source.generate([ids], GREEDY)[0].token_ids
    )
    leak_free(engine)
