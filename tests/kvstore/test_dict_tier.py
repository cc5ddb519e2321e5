"""A tier plugged in from outside the kvstore's package (`tests.kvstore.dict_tier`, named
only in the ``tiers`` setting and configured by its own environment variables), under a
real kvstore spoken to over ZMQ: what the host tier evicts goes to it, the index counts
it, and a lookup has it promoted back and leased, byte-exact. A run spread over two
tiers below the host is read from each. A name that is no tier is refused by name."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError

from radixserve.protocol import (
    HostAttach,
    HostAttachAck,
    HostLease,
    HostLookup,
    HostPagesReady,
    HostRelease,
    SpillDone,
)
from radixserve.services.kvstore.promotion import Promotion
from radixserve.services.kvstore.settings import KVStoreSettings
from radixserve.transfer import PoolCompat, create_agent
from tests.kvstore.dict_tier import DictTier, DictTierSettings
from tests.kvstore.test_host_pool import attach, pool, worker
from tests.kvstore.test_kvstore_service import (
    KVSTORE,
    MODEL,
    PAGE_BYTES,
    H,
    dealers,
    kvstore,
    spill_buffer,
)

DICT_TIER = "tests.kvstore.dict_tier"


@pytest.mark.parametrize("reads_loading", [False, True], ids=["read first", "overlapped"])
def test_a_plugged_in_tier_keeps_what_the_host_tier_evicts_and_serves_it_back(
    monkeypatch: pytest.MonkeyPatch, reads_loading: bool
):
    """An 8-page host tier over the dict tier (its capacity from its own environment
    variable): a worker spills pages 1..8, then 9..12 from the same buffer pages with
    other bytes, which evicts 1..4 into the dict tier. The index counts 1..8 as loadable,
    and a lookup of 1..4 is promoted from the dict tier (``disk_pages`` 4: read from
    below the host tier) and leased; the worker reads the bytes 1..4 were spilled with.
    Overlapped, the lease comes first and a `HostPagesReady` per page follows."""
    monkeypatch.setenv("RADIXSERVE_KVSTORE_TIERS", f'["{DICT_TIER}"]')
    monkeypatch.setenv("RADIXSERVE_KVSTORE_DICT_CAPACITY_PAGES", "16")
    assert KVStoreSettings().tiers == (DICT_TIER,)

    async def scenario() -> None:
        buffer, spill_agent = spill_buffer("w1")
        device = torch.zeros_like(buffer)  # the worker's device pool, (2, 2, 8, 4, 2, 8)
        reader = create_agent("zmq", "w1", device, PoolCompat.of(device, MODEL))
        spilled = buffer[:, :, :4].clone()  # pages 1..4's bytes
        try:
            async with (
                kvstore(host_capacity_gib=8 * PAGE_BYTES / (1 << 30)) as service,
                dealers(service.address, 1) as (w1,),
            ):
                (tier,) = service.tiers[1:]
                assert isinstance(tier, DictTier) and tier.capacity == 16
                await w1.hello("w1")
                ack = await w1.ask(HostAttach("w1", 1, spill_agent.metadata()))
                assert isinstance(ack, HostAttachAck) and ack.accepted and ack.disk_tier, ack
                done = await w1.ask(H.offer(1, list(range(1, 9)), list(range(8))))
                assert done == SpillDone(1, 8)
                buffer[:, :, :4] += 0.5  # pages 9..12 have other bytes
                done = await w1.ask(H.offer(2, [9, 10, 11, 12], [0, 1, 2, 3]))
                assert done == SpillDone(2, 4)
                assert H.names(tier.pages) == {1, 2, 3, 4}
                assert (await w1.index(*H(*range(1, 9)))).host_pages == 8

                lookup = HostLookup("q", tuple(H(1, 2, 3, 4)), reads_loading=reads_loading)
                lease = await w1.ask(lookup)
                assert isinstance(lease, HostLease) and lease.disk_pages == 4, lease
                assert len(lease.host_page_ids) == 4 and lease.loading == reads_loading
                ready = lease.ready_pages if lease.loading else 4
                while ready < 4:
                    msg = await w1.next()
                    assert isinstance(msg, HostPagesReady) and not msg.failed, msg
                    ready = msg.ready_pages
                reader.add_peer(KVSTORE, 42, ack.metadata)
                handle = reader.read_pages(KVSTORE, list(lease.host_page_ids), [0, 1, 2, 3])
                assert await reader.wait_async(handle) == "done"
                assert torch.equal(device[:, :, :4], spilled)
                await w1.send(HostRelease(lease.lease_id))
                stats = service.store_stats()
                assert stats["dict_hit_pages_total"] == 4
                assert stats["dict_overlapped_promotions_total"] == int(reads_loading)
        finally:
            reader.close()
            spill_agent.close()

    asyncio.run(scenario())


def test_a_run_spread_over_two_tiers_below_is_read_from_each_the_fastest_first():
    """Two dict tiers under a host tier: page 1 in both, page 2 in the second only, page
    3 in the host tier. The run 1, 2, 3 takes page 1 from the first (listed first:
    faster), page 2 from the second; the promotion reads each from its tier into host
    pages, with the bytes staged there, and the lease covers all three."""

    async def scenario() -> None:
        host, w = pool(8), worker()
        first, second = (DictTier(DictTierSettings(capacity_pages=4), None) for _ in range(2))
        try:
            attach(host, w)
            assert host.compat is not None and host.kv is not None and host.index is not None
            for tier in (first, second):
                tier.open(host.compat, host.kv)
            page = torch.zeros_like(host.kv[:, :, 0])  # (L, 2, S, H, D)
            first.stage(H[1], page + 1, H.proof(1))
            second.stage(H[1], page - 1, H.proof(1))
            second.stage(H[2], page + 2, H.proof(2))
            (stored,) = host.index.reserve([H[3]])
            host.commit([H[3]], [H.proof(3)])
            promotion = Promotion(host, [first, second])
            assert promotion.run(H(1, 2, 3, 4)) == [first, second, host]
            assert H.names(await promotion.promote(H(1, 2, 3), 0.0)) == {1, 2}
            lease = host.lookup(w.name, HostLookup("q", tuple(H(1, 2, 3))))
            pages = lease.host_page_ids
            assert len(pages) == 3 and pages[2] == stored[1]
            assert torch.equal(host.kv[:, :, pages[0]], page + 1)
            assert torch.equal(host.kv[:, :, pages[1]], page + 2)
            assert first.counters["dict_hit_pages_total"] == 1
            assert second.counters["dict_hit_pages_total"] == 1
            host.index.check_integrity()
        finally:
            await host.stop()
            w.agent.close()

    asyncio.run(scenario())


def test_a_tier_that_is_not_one_is_refused_by_name():
    with pytest.raises(ValidationError, match="no tier 'no.such.tier'"):
        KVStoreSettings(tiers=("no.such.tier",))
    with pytest.raises(ValidationError, match="exposes no TIER"):
        KVStoreSettings(tiers=("tests.kvstore.page_chain",))
    with pytest.raises(ValidationError, match="need a host tier"):
        KVStoreSettings(tiers=(DICT_TIER,), host_capacity_gib=0)
