"""`CachedTokens`: a prompt's cache hits by tier, each token in one tier, on the wire."""

from __future__ import annotations

from radixserve.protocol import codec
from radixserve.protocol.cached_tokens import TIERS, CachedTokens
from radixserve.protocol.messages import KVReady, TokenChunk


def test_tiers_are_ordered_fastest_first_and_the_total_counts_each_once() -> None:
    hits = CachedTokens(device=32, peer=8, host=16, disk=48)
    assert TIERS == ("device", "peer", "host", "disk")
    assert list(hits.by_tier().items()) == [
        ("device", 32), ("peer", 8), ("host", 16), ("disk", 48)
    ]  # fmt: skip
    assert hits.total == 104
    assert hits.as_dict() == {"device": 32, "peer": 8, "host": 16, "disk": 48, "total": 104}
    assert hits + CachedTokens(peer=1, host=4, disk=4) == CachedTokens(32, 9, 20, 52)


def test_with_total_adds_the_device_prefix_and_trims_the_slowest_tier_first() -> None:
    loaded = CachedTokens(host=16, disk=32)  # the host read, before the device's share
    assert loaded.with_total(64) == CachedTokens(device=16, host=16, disk=32)
    assert loaded.with_total(48) == loaded
    assert loaded.with_total(40) == CachedTokens(host=16, disk=24)
    assert loaded.with_total(8) == CachedTokens(host=8)
    assert loaded.with_total(0) == CachedTokens()


def test_the_tiers_travel_in_kv_ready_and_token_chunks() -> None:
    hits = CachedTokens(device=1, host=2, disk=3)
    for msg in (KVReady("r", (5,), cached=hits), TokenChunk("r", cached=hits)):
        assert codec.decode(codec.encode(msg)) == msg
    assert codec.decode(codec.encode(TokenChunk("r"))).cached == CachedTokens()  # type: ignore[attr-defined]
