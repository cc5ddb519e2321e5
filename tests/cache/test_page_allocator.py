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


# -- runs: reservations for an owner's next pages -----------------------------------------


def test_an_owners_pages_come_in_one_run_while_others_allocate_between() -> None:
    """Two decodes growing a page at a time, interleaved, each get consecutive ids: the
    first allocation reserves the spare pages after it, the next ones take them."""
    allocator = PageAllocator(32)
    a = allocator.alloc(3, owner="a", spare=5)
    b = allocator.alloc(2, owner="b", spare=6)
    assert a == [0, 1, 2] and b == [8, 9]  # b's run starts after a's reservation
    assert allocator.num_reserved == 11 and allocator.num_free == 32 - 5
    for _ in range(5):
        a += allocator.alloc(1, owner="a", spare=5)
        b += allocator.alloc(1, owner="b", spare=6)
        allocator.alloc(1)  # someone else's page between every two decode pages
    assert a == list(range(0, 8)) and b == list(range(8, 15))
    allocator.check_integrity()


def test_a_used_up_reservation_continues_in_place_when_the_next_pages_are_open() -> None:
    allocator = PageAllocator(16)
    pages = allocator.alloc(2, owner="a", spare=2)  # [0, 1] and [2, 3] reserved
    pages += allocator.alloc(2, owner="a")  # the reservation, used up
    pages += allocator.alloc(3, owner="a", spare=1)  # open right after: it continues there
    assert pages == list(range(7)) and allocator.num_reserved == 1
    other = allocator.alloc(1)  # the lowest open page is 8: 7 is a's
    pages += allocator.alloc(2, owner="a", spare=4)  # 7, then 8 is taken: a new run at 9
    assert other == [8] and pages[-2:] == [7, 9]  # a run cut by a taken page goes on
    allocator.check_integrity()


def test_release_returns_the_reservation_and_free_counts_never_shrink() -> None:
    """Reserved pages are free (admission and the gauges count them so); `release`, as
    on finish, abort or preemption, makes them open again; releasing twice is harmless."""
    allocator = PageAllocator(10)
    held = allocator.alloc(2, owner="r", spare=6)
    assert allocator.num_free == 8 and allocator.num_used == 2 and allocator.num_reserved == 6
    allocator.decref(held)
    assert allocator.num_free == 10 and allocator.num_reserved == 6
    assert allocator.release("r") == 6 and allocator.release("r") == 0
    assert allocator.num_reserved == 0 and allocator.num_free == 10
    assert allocator.alloc(10) == list(range(10))  # every page open again, lowest first
    allocator.check_integrity()


def test_reservations_never_cause_a_refusal() -> None:
    """When open pages run out, any allocation takes reserved ones, from the end of other
    owners' reservations, so each keeps the pages that continue its run."""
    allocator = PageAllocator(12)
    a = allocator.alloc(1, owner="a", spare=5)  # [0], reserved [1, 6)
    b = allocator.alloc(1, owner="b", spare=5)  # [6], reserved [7, 12)
    assert allocator.num_free == 10
    stolen = allocator.alloc(7)  # no open page left: 5 from a's end, 2 from b's
    assert sorted(stolen) == [1, 2, 3, 4, 5, 10, 11] and allocator.num_free == 3
    assert allocator.alloc(1, owner="b") == [7]  # b keeps its run's continuation
    assert a == [0] and b == [6] and allocator.num_reserved == 2
    with pytest.raises(OutOfPagesError):
        allocator.alloc(3)
    allocator.check_integrity()


def test_a_fragmented_pool_falls_back_to_scattered_pages() -> None:
    """No two consecutive open pages: an owner's pages come one by one, lowest first, and
    nothing is reserved; its next page continues right after the last one when open."""
    allocator = PageAllocator(12)
    pages = allocator.alloc(12)
    allocator.decref(pages[::2])  # open: 0, 2, 4, 6, 8, 10
    got = allocator.alloc(3, owner="a", spare=4)
    assert got == [0, 2, 4] and allocator.num_reserved == 0
    allocator.decref([5])  # the page after a's last is open again
    assert allocator.alloc(1, owner="a", spare=4) == [5]
    allocator.check_integrity()


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "owned", "decref", "release"]),
            st.integers(0, 2),  # owner
            st.integers(0, 4),  # pages
            st.integers(0, 4),  # spare
        ),
        max_size=50,
    )
)
def test_random_operations_with_owners_keep_every_count(ops) -> None:
    """Against a model of who holds what: an allocation succeeds exactly when enough pages
    are free (reserved ones included), hands out free pages only, and every count and
    the integrity check agree after every step."""
    allocator = PageAllocator(10)
    held: Counter[int] = Counter()
    for op, owner, n, spare in ops:
        if op in ("alloc", "owned"):
            if n > 10 - len(held):
                with pytest.raises(OutOfPagesError):
                    allocator.alloc(n, owner=owner if op == "owned" else None, spare=spare)
                continue
            pages = allocator.alloc(n, owner=owner if op == "owned" else None, spare=spare)
            assert len(set(pages)) == n and not set(pages) & set(held)
            held.update(pages)
        elif op == "decref" and held:
            page = sorted(held)[n % len(held)]
            allocator.decref([page])
            held[page] -= 1
            held += Counter()
        elif op == "release":
            allocator.release(owner)
        allocator.check_integrity()
        assert allocator.num_used == len(held)
        assert allocator.num_free == 10 - len(held) >= allocator.num_reserved
