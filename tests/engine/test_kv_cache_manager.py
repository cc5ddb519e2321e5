"""The cache manager's accounts: every page is free, a holder's or the cache's, and
`check_integrity` finds a reference or a lock nobody accounts for."""

from __future__ import annotations

import pytest

from radixserve.engine.kv_cache_manager import KVCacheManager
from radixserve.engine.request import Request
from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import TINY, assert_no_leaks, make_engine

PAGE = 4


def request(rid: str, tokens: int, first: int = 1) -> Request:
    # the manager reads token ids and counts only: no detokenizer is needed
    return Request(rid, list(range(first, first + tokens)), SamplingParams(max_tokens=8),
                   detokenizer=None)  # type: ignore[arg-type]  # fmt: skip


def test_pages_go_from_free_to_a_request_to_the_cache_and_are_evicted_for_the_next() -> None:
    kv = KVCacheManager(8, PAGE, run_pages=4, namespace=b"ns")
    first = request("a", 10)
    kv.admit(first)
    assert kv.grow(first, 10) and first.page_ids == [0, 1, 2]
    assert kv.allocator.num_reserved == 1  # the rest of its run of 4
    kv.check_integrity([first])
    first.num_computed = 10
    kv.release(first, cache_kv=True)  # its 2 full pages into the cache
    kv.check_integrity([])
    stats = kv.stats()
    assert (stats["pages_used"], stats["pages_cached"], stats["pages_reserved"]) == (2, 2, 0)
    second = request("b", 30, first=100)  # 8 pages: the cached ones are evicted for it
    kv.admit(second)  # nothing of it cached: no lock, no pages
    assert kv.grow(second, 30) and len(second.page_ids) == 8
    assert kv.stats()["pages_cached"] == 0 and not kv.grow(request("c", 4), 4)
    kv.check_integrity([second])
    kv.release(second, cache_kv=False)
    kv.check_integrity([])


def test_a_leaked_reference_or_lock_fails_the_check() -> None:
    kv = KVCacheManager(8, PAGE, namespace=b"ns")
    req = request("a", 8)
    kv.admit(req)  # locks the root (an empty match)
    assert kv.grow(req, 8)
    kv.check_integrity([req])
    with pytest.raises(AssertionError, match="page references"):
        kv.check_integrity([])  # the request's pages, accounted to no one
    kv.allocator.incref(req.page_ids[:1])
    with pytest.raises(AssertionError, match="page references"):
        kv.check_integrity([req])
    kv.allocator.decref(req.page_ids[:1])
    assert kv.cache is not None
    kv.cache.lock(kv.cache.root)
    with pytest.raises(AssertionError, match="cache locks"):
        kv.check_integrity([req])
    kv.cache.unlock(kv.cache.root)
    kv.release(req, cache_kv=False)
    kv.check_integrity([])


def test_a_lease_holds_its_pages_past_the_request_until_released_or_expired() -> None:
    kv = KVCacheManager(8, PAGE)  # no prefix cache
    req = request("a", 8)
    assert kv.grow(req, 8)
    kv.lease("a", req.page_ids, expires_at=10.0)
    kv.release(req, cache_kv=True)
    kv.check_integrity([])  # the lease's references are accounted for
    assert kv.stats()["pages_used"] == 2
    kv.expire_leases(now=5.0)
    assert len(kv.leases) == 1
    kv.expire_leases(now=10.0)
    assert len(kv.leases) == 0 and kv.stats()["pages_used"] == 0
    assert not kv.release_lease("a")
    kv.check_integrity([])


def test_the_engine_accounts_for_every_page_while_requests_run() -> None:
    engine = make_engine(TINY, kv_cache_memory_gib=0.05, max_num_batched_tokens=64)
    prompt = "The library opens at nine and closes at five. " * 6
    for i in range(3):
        engine.add_request(prompt + str(i), SamplingParams(max_tokens=6, n=1 + i % 2))
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert_no_leaks(engine)
