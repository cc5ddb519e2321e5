"""HostPageIndex: the host tier's page bookkeeping (LRU, leases, writes in flight)."""

from __future__ import annotations

import random

import pytest

from radixserve.cache.host_index import HostPageIndex


def _store(index: HostPageIndex, hashes: list[int]) -> list[int]:
    reserved = index.reserve(hashes)
    index.commit([hashes[i] for i, _ in reserved])
    return [page for _, page in reserved]


def test_a_stored_run_is_found_and_leased_in_order() -> None:
    index = HostPageIndex(8)
    pages = _store(index, [10, 11, 12])
    assert len(set(pages)) == 3
    assert index.match([10, 11, 12, 13]) == 3
    assert index.match([11, 12]) == 2  # any run of chained hashes is a prefix
    assert index.match([99, 10]) == 0
    lease_id, leased = index.lease("w", [10, 11, 12, 13], deadline=1e9)
    assert lease_id and leased == pages
    assert index.lease("w", [99], deadline=1e9) == (0, [])
    assert index.stats()["host_hit_pages_total"] == 3
    index.check_integrity()


def test_pages_being_written_are_invisible_and_abort_frees_them() -> None:
    index = HostPageIndex(4)
    reserved = index.reserve([1, 2])
    assert index.match([1]) == 0 and index.lease("w", [1], 1e9) == (0, [])
    assert index.reserve([1, 2]) == []  # already being written: not twice
    index.abort([1, 2])
    assert index.stats()["host_pages_free"] == 4
    assert index.reserve([1]) and len(reserved) == 2
    index.check_integrity()


def test_lru_evicts_tails_first_and_never_a_leased_page() -> None:
    index = HostPageIndex(4)
    _store(index, [1, 2, 3, 4])  # one prefix of four pages
    lease_id, _ = index.lease("w", [1, 2, 3, 4], deadline=1e9)
    assert index.reserve([50]) == []  # everything is leased: nothing can go
    assert index.release(lease_id) and not index.release(lease_id)
    _store(index, [50])
    assert index.match([1, 2, 3, 4]) == 3  # the tail went, the prefix stayed
    assert index.stats()["host_evictions_total"] == 1
    index.check_integrity()


def test_leases_expire_at_their_deadline() -> None:
    index = HostPageIndex(4)
    _store(index, [1, 2])
    index.lease("dead", [1, 2], deadline=5.0)
    index.lease("alive", [1], deadline=100.0)
    assert index.expire(now=10.0) == 1
    assert index.stats()["host_leases"] == 1 and index.stats()["host_pages_leased"] == 1
    _store(index, [3, 4, 5])  # page 2 is free to go now, page 1 is still read
    assert index.match([1]) == 1 and index.match([1, 2]) == 1
    index.check_integrity()


def test_random_operations_keep_every_page_in_one_state() -> None:
    rng = random.Random(7)
    index = HostPageIndex(16)
    leases: list[int] = []
    writing: list[list[int]] = []
    for _ in range(2000):
        op = rng.random()
        hashes = [rng.randrange(40) for _ in range(rng.randrange(1, 6))]
        if op < 0.35:
            reserved = index.reserve(hashes)
            writing.append([hashes[i] for i, _ in reserved])
        elif op < 0.55 and writing:
            batch = writing.pop(rng.randrange(len(writing)))
            (index.commit if rng.random() < 0.8 else index.abort)(batch)
        elif op < 0.8:
            lease_id, pages = index.lease("w", hashes, deadline=1e9)
            assert len(pages) == index.match(hashes)
            if lease_id:
                leases.append(lease_id)
        elif leases:
            assert index.release(leases.pop(rng.randrange(len(leases))))
        index.check_integrity()
        assert index.stats()["host_pages_used"] + index.stats()["host_pages_free"] == 16


def test_a_pool_needs_a_page() -> None:
    with pytest.raises(ValueError, match="at least one page"):
        HostPageIndex(0)
