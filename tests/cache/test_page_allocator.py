"""PageAllocator: allocation, reference counts, double-free detection, integrity."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache.page_allocator import OutOfPagesError, PageAllocator


def test_alloc_hands_out_distinct_pages_lowest_first() -> None:
    allocator = PageAllocator(8)
    assert allocator.alloc(3) == [0, 1, 2]
    assert allocator.alloc(2) == [3, 4]
    assert allocator.num_free == 3
    assert allocator.num_used == 5
    assert allocator.num_pages == 8
    assert all(allocator.refcount(page) == 1 for page in range(5))
    assert all(allocator.refcount(page) == 0 for page in range(5, 8))
    allocator.check_integrity()


def test_alloc_zero_returns_empty_list() -> None:
    allocator = PageAllocator(2)
    assert allocator.alloc(0) == []
    assert allocator.num_free == 2


def test_out_of_pages_allocates_nothing() -> None:
    allocator = PageAllocator(4)
    allocator.alloc(3)
    with pytest.raises(OutOfPagesError):
        allocator.alloc(2)
    assert issubclass(OutOfPagesError, RuntimeError)
    assert allocator.num_free == 1
    allocator.check_integrity()


def test_negative_sizes_rejected() -> None:
    with pytest.raises(ValueError):
        PageAllocator(-1)
    with pytest.raises(ValueError):
        PageAllocator(3).alloc(-1)


def test_decref_frees_at_zero_and_pages_are_reused() -> None:
    allocator = PageAllocator(4)
    pages = allocator.alloc(2)
    allocator.incref([pages[0]])
    assert allocator.refcount(pages[0]) == 2
    assert allocator.decref(pages) == 1  # pages[1] freed, pages[0] still held once
    assert allocator.refcount(pages[0]) == 1
    assert allocator.refcount(pages[1]) == 0
    assert allocator.decref([pages[0]]) == 1
    assert allocator.num_free == 4
    assert sorted(allocator.alloc(4)) == [0, 1, 2, 3]
    allocator.check_integrity()


def test_double_free_raises_and_changes_nothing() -> None:
    allocator = PageAllocator(4)
    pages = allocator.alloc(3)
    allocator.decref([pages[2]])
    with pytest.raises(ValueError, match="double free"):
        allocator.decref([pages[0], pages[1], pages[2]])
    assert [allocator.refcount(page) for page in pages] == [1, 1, 0]
    assert allocator.num_free == 2
    allocator.check_integrity()
    # A page listed more often than it is referenced is a double free too.
    with pytest.raises(ValueError):
        allocator.decref([pages[0], pages[0]])
    assert allocator.refcount(pages[0]) == 1
    allocator.check_integrity()


def test_incref_of_free_or_invalid_page_raises() -> None:
    allocator = PageAllocator(3)
    held = allocator.alloc(1)
    with pytest.raises(ValueError):
        allocator.incref([held[0], 2])
    assert allocator.refcount(held[0]) == 1  # all-or-nothing
    with pytest.raises(ValueError):
        allocator.incref([3])
    with pytest.raises(ValueError):
        allocator.decref([-1])
    with pytest.raises(ValueError):
        allocator.refcount(3)


def test_check_integrity_detects_corruption() -> None:
    allocator = PageAllocator(3)
    allocator.alloc(1)
    allocator._refcounts[2] = 1  # a free page with a reference
    with pytest.raises(AssertionError):
        allocator.check_integrity()


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 5)),
        max_size=40,
    )
)
def test_random_operations_match_a_counter_model(ops: list[tuple[str, int]]) -> None:
    allocator = PageAllocator(6)
    model: Counter[int] = Counter()
    for op, arg in ops:
        held = sorted(model)
        if op == "alloc":
            if arg > 6 - len(held):
                with pytest.raises(OutOfPagesError):
                    allocator.alloc(arg)
                continue
            pages = allocator.alloc(arg)
            assert not set(pages) & set(held) and len(set(pages)) == arg
            model.update(pages)
        elif held:
            page = held[arg % len(held)]
            if op == "incref":
                allocator.incref([page])
                model[page] += 1
            else:
                freed = allocator.decref([page])
                model[page] -= 1
                assert freed == (model[page] == 0)
                model += Counter()  # drop zero counts
        allocator.check_integrity()
        assert allocator.num_used == len(model)
        assert all(allocator.refcount(page) == count for page, count in model.items())
