"""The cluster-wide page index: events applied in order per worker, gaps and restarts
force a resync, matches count leading pages per worker."""

from __future__ import annotations

from radixserve.cache.global_index import GlobalIndex


def test_stored_and_removed_pages_answer_prefix_matches_per_worker():
    index = GlobalIndex()
    assert index.apply("decode-0", 7, 1, "stored", [11, 12, 13])
    assert index.apply("prefill-0", 3, 1, "stored", [11, 12])
    assert index.match([11, 12, 13, 14]) == {"decode-0": 3, "prefill-0": 2}
    assert index.match([99, 11]) == {}  # hashes chain: a prefix starts at the first page
    assert index.apply("decode-0", 7, 2, "removed", [13])
    assert index.match([11, 12, 13]) == {"decode-0": 2, "prefill-0": 2}
    assert index.num_pages == 2
    assert index.workers()["decode-0"]["pages"] == 2


def test_a_gap_in_sequence_numbers_drops_the_worker_until_it_resyncs():
    index = GlobalIndex()
    assert index.apply("d", 1, 1, "stored", [1, 2])
    assert not index.apply("d", 1, 3, "stored", [3])  # event 2 was lost
    assert index.match([1, 2, 3]) == {}
    assert index.num_resyncs == 1
    assert index.apply("d", 1, 4, "stored", [3])  # ignored while the resync is under way
    assert index.match([1, 2, 3]) == {}
    assert index.apply("d", 1, 5, "cleared", [])
    assert index.apply("d", 1, 6, "stored", [1, 2, 3])
    assert index.match([1, 2, 3]) == {"d": 3}


def test_unknown_workers_and_new_generations_are_asked_to_resync():
    index = GlobalIndex()
    # the kvstore restarted: a running worker's event 40 arrives first
    assert not index.apply("d", 5, 40, "stored", [1])
    assert index.apply("d", 5, 41, "cleared", [])
    assert index.apply("d", 5, 42, "stored", [1, 2])
    # the worker restarted: its new generation's first event replaces everything
    assert index.apply("d", 6, 1, "stored", [9])
    assert index.match([1, 2]) == {} and index.match([9]) == {"d": 1}
    # a later event of a generation never seen from its start: resync
    assert not index.apply("d", 8, 5, "stored", [4])
    assert index.match([9]) == {}


def test_dropping_a_worker_removes_only_its_entries():
    index = GlobalIndex()
    index.apply("a", 1, 1, "stored", [1, 2, 3])
    index.apply("b", 1, 1, "stored", [1, 2])
    index.drop("a")
    assert index.match([1, 2, 3]) == {"b": 2}
    assert index.num_pages == 2
    assert set(index.workers()) == {"b"}


def test_shards_answer_each_workers_deepest_page_of_their_own_hashes():
    """Two shards, each fed the hashes it owns (hash % 2): the greater of their answers
    is the leading run the one unsharded index gives, and a lost shard costs only the
    pages past the other's deepest, never a page the worker lacks."""
    whole, shards = GlobalIndex(), [GlobalIndex(), GlobalIndex()]
    held = {"decode-0": [10, 21, 32, 43, 54], "decode-1": [10, 21], "prefill-0": [10]}
    for worker, hashes in held.items():
        whole.apply(worker, 1, 1, "stored", hashes)
        for s, shard in enumerate(shards):
            shard.apply(worker, 1, 1, "stored", [h for h in hashes if h % 2 == s])
    query = [10, 21, 32, 43, 54, 65]
    answers = [shard.deepest(query, s, 2) for s, shard in enumerate(shards)]
    merged = {w: max(a.get(w, 0) for a in answers) for w in held}
    assert merged == whole.match(query) == {"decode-0": 5, "decode-1": 2, "prefill-0": 1}
    # shard 1 (hashes 21, 43, 65) lost: shard 0 alone still gives decode-0's 5 pages
    # (54 is its), decode-1 its first page only
    assert answers[0] == {"decode-0": 5, "decode-1": 1, "prefill-0": 1}
    # a shard answers only for the hashes it owns, whatever else it was sent
    assert shards[1].deepest([10], 1, 2) == {}
