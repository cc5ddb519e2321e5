"""The engine's side of the host tier: loading a prefix into the cache, and every way a
load can end without leaking a page or a lock.

The host tier's bytes are played here by the pages of a second engine that computed the
prompt (the copy stands in for the NIXL read the cluster does; the real path runs in
tests/cluster/test_host_tier.py).
"""

from __future__ import annotations

import pytest

from radixserve.cache.block_hash import page_hashes
from radixserve.engine.admission import HostPlan
from radixserve.engine.sampling_params import SamplingParams
from radixserve.protocol.cached_tokens import CachedTokens
from tests.engine.engine_helpers import TINY, make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def source():
    """An engine that computed the prompt: its cached pages are the 'host tier'."""
    engine = make_engine(TINY, kv_cache_memory_gib=0.05)
    engine.generate([prompt_ids(engine)], GREEDY)
    return engine


def fresh():
    return make_engine(TINY, kv_cache_memory_gib=0.05)


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


def run(engine, rid: str) -> list:
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


def cached(engine, ids) -> int:
    return engine.cache.match_prefix(ids[:-1]).num_tokens


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

    admission = engine.admit(ids, GREEDY, host=HostPlan(0, full))
    assert admission.route == "host" and len(admission.page_ids) == full
    assert engine.cache_stats()["pages_locked"] == 0  # nothing cached to lock yet
    assert not engine.has_unfinished()  # not queued until its pages are read
    pages = list(admission.page_ids)
    engine.kv_pool.kv[:, :, pages] = source.kv_pool.kv[:, :, held.page_ids]  # "the read"
    engine.finish_host_admission(admission.request_id, ok=True, disk_pages=2)
    assert cached(engine, ids) == full * size
    outputs = run(engine, admission.request_id)
    assert outputs[0].cached == CachedTokens(host=(full - 2) * size, disk=2 * size)
    assert [t for o in outputs for t in o.new_token_ids] == expected.token_ids
    leak_free(engine)


def test_a_failed_aborted_or_refused_load_returns_everything(source):
    ids = prompt_ids(source)
    expected = source.generate([ids], GREEDY)[0].token_ids
    engine = fresh()
    free = engine.allocator.num_free
    admission = engine.admit(ids, GREEDY, host=HostPlan(0, 3))
    assert admission.route == "host" and engine.allocator.num_free == free - 3
    engine.finish_host_admission(admission.request_id, ok=False, disk_pages=3)  # read failed
    assert engine.allocator.num_free == free and engine.cache.num_cached_pages == 0
    engine.finish_host_admission(admission.request_id, ok=True)  # unknown now: nothing
    outputs = run(engine, admission.request_id)  # it computes the prompt instead
    assert outputs[0].cached == CachedTokens()
    assert [t for o in outputs for t in o.new_token_ids] == expected
    leak_free(engine)

    # aborted while its pages were being read: they go back, nothing runs
    engine = fresh()
    admission = engine.admit(ids, GREEDY, host=HostPlan(0, 3))
    assert engine.abort(admission.request_id) is not None
    assert not engine.has_unfinished() and engine.allocator.num_free == free
    leak_free(engine)

    # a plan whose device head is not cached here (a stale mirror), or a pool that
    # cannot spare the pages: computed here instead, nothing held
    assert engine.admit(ids, GREEDY, host=HostPlan(1, 2)).route == "local"
    run(engine, "req-1")
    engine = fresh()
    hold = engine.allocator.alloc(engine.allocator.num_free - 2)
    assert engine.admit(ids[:40], SamplingParams(max_tokens=1), host=HostPlan(0, 2)).route == (
        "host"
    )  # two pages: fine
    engine.abort("req-0")
    assert engine.admit(ids, SamplingParams(max_tokens=1), host=HostPlan(0, 5)).route == "local"
    engine.abort("req-1")
    engine.allocator.decref(hold)
    leak_free(engine)
    # a plan reaching the prompt's last token is cut short of it (its logits are needed)
    engine = fresh()
    admission = engine.admit(ids, GREEDY, host=HostPlan(0, len(ids)))
    assert len(admission.page_ids) == (len(ids) - 1) // engine.page_size
    engine.abort(admission.request_id)
    leak_free(engine)


def test_a_load_extends_the_device_head_it_locked(source):
    ids = prompt_ids(source)
    size = source.page_size
    held = source.cache.match_prefix(ids[:-1])
    engine = fresh()
    head = 2
    engine.generate([ids[: head * size + 1]], SamplingParams(max_tokens=1))  # caches 2 pages
    assert cached(engine, ids) == head * size
    rest = (len(ids) - 1) // size - head
    admission = engine.admit(ids, GREEDY, host=HostPlan(head, rest))
    assert admission.route == "host" and admission.cached_tokens == head * size
    assert engine.cache_stats()["pages_locked"] == head  # the head cannot be evicted
    engine.kv_pool.kv[:, :, list(admission.page_ids)] = source.kv_pool.kv[
        :, :, held.page_ids[head:]
    ]
    engine.finish_host_admission(admission.request_id, ok=True)
    assert cached(engine, ids) == (head + rest) * size
    outputs = run(engine, admission.request_id)
    assert [t for o in outputs for t in o.new_token_ids] == source.generate([ids], GREEDY)[
        0
    ].token_ids
    leak_free(engine)
