"""DiskPageIndex: the disk tier's slot bookkeeping (growth by files, LRU, holds, drops,
adoption after a restart), with `check_integrity` after every step."""

from __future__ import annotations

import math

import pytest

from radixserve.cache.disk_index import DiskPageIndex


def _write(index: DiskPageIndex, hashes: list[int]) -> list[int]:
    reserved = index.reserve(hashes)
    index.commit([hashes[i] for i, _ in reserved])
    index.check_integrity()
    return [slot for _, slot in reserved]


def test_an_empty_tier_grows_by_files_and_evicts_its_least_recently_used_page() -> None:
    index = DiskPageIndex()
    assert index.reserve([1]) == [] and index.num_pages == 0  # no file yet: no slot
    assert index.adopt(2) == range(0, 2)
    assert sorted(_write(index, [1, 2])) == [0, 1]
    assert index.touch(1)  # 1 was used again: 2 is now the oldest
    index.adopt(1)
    _write(index, [3])  # the new file's slot, no eviction
    (slot,) = _write(index, [4])
    assert not index.stored(2) and index.stored(1) and index.stored(4)
    assert index.stats()["disk_evictions_total"] == 1 and slot == 1
    assert index.stored_hashes() == [1, 3, 4]


def test_a_held_slot_is_never_evicted_nor_dropped_until_released() -> None:
    index = DiskPageIndex()
    index.adopt(2)
    _write(index, [1, 2])
    hold, slots = index.hold("promotion", [1, 2], math.inf)
    assert slots == [index.slot_of(1), index.slot_of(2)]
    assert index.reserve([3]) == []  # every slot is being read
    with pytest.raises(ValueError, match="being read"):
        index.drop([1])
    index.release(hold)
    assert index.drop([1, 99]) == 1  # 99 is not stored
    assert not index.stored(1) and index.stats()["disk_pages_free"] == 1
    index.check_integrity()


def test_pages_found_after_a_restart_are_adopted_in_their_written_order() -> None:
    index = DiskPageIndex()
    index.adopt(4, [(30, 2), (10, 0)])  # a file: slots 0 and 2 hold pages
    index.adopt(2, [(20, 1)])  # a second file: its slot 1 (id 5)
    assert index.slot_of(30) == 2 and index.slot_of(20) == 5
    assert index.stats()["disk_pages_free"] == 3
    index.reorder({10: 1, 20: 2, 30: 3})
    assert index.stored_hashes() == [10, 20, 30]
    with pytest.raises(ValueError, match="adopted twice"):
        index.adopt(2, [(40, 0), (41, 0)])
    index.check_integrity()


def test_a_hash_being_written_is_known_but_not_stored() -> None:
    index = DiskPageIndex()
    index.adopt(1)
    index.reserve([7])
    assert index.touch(7) and not index.stored(7)
    index.abort([7])
    assert not index.touch(7)
    index.check_integrity()
