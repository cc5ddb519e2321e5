"""A worker's side of the host tier in one process: `HostTierClient` over a real
`AsyncEngine` (a tiny random-weight model on the CPU), a real `LinkSet` and real ZMQ
transfer agents, linked to a kvstore the test plays on a ROUTER socket.

`plan` asks the kvstore only when more than ``host_load_min_tokens`` are missing on
device; a kvstore that never answers costs one ``host_lookup_timeout_s`` and one counted
timeout; the link going down ends a waiting lookup at once; a lease nobody waits for is
released; a refused attach leaves the tier off; spill buffer pages come back on
`SpillDone`, but those the kvstore was reading when its link went down only after the
quarantine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import zmq
import zmq.asyncio

from radixserve.bench.random_checkpoint import random_checkpoint
from radixserve.cache.block_hash import page_hashes
from radixserve.engine.admission import HostPlan
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model.config import ModelConfig
from radixserve.protocol import (
    AsyncChannel,
    Heartbeat,
    Hello,
    HelloAck,
    HostAttach,
    HostAttachAck,
    HostLease,
    HostLookup,
    HostPagesReady,
    HostRelease,
    Message,
    SpillDone,
    SpillOffer,
)
from radixserve.runtime import host_tier
from radixserve.runtime.host_loads import lookup_wait_s
from radixserve.runtime.host_tier import HostTierClient
from radixserve.runtime.links import Link, LinkIdentity, LinkSet
from radixserve.runtime.settings import WorkerSettings
from radixserve.settings import EngineSettings
from radixserve.transfer import KVTransferAgent, PoolCompat, create_agent

CONFIG = ModelConfig(
    architecture="llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=128, tie_word_embeddings=False, name="host-tier-client-test",
)  # fmt: skip
PAGE = 4
MIN_TOKENS = 16  # host_load_min_tokens: 4 pages
PROMPT = list(range(1, 42))  # 41 tokens: 10 full pages before the last token
HOST_PAGES = 16


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    settings = EngineSettings(device="cpu", dtype="float32", kv_cache_memory_gib=0.001,
                              page_size=PAGE)  # fmt: skip
    engine = AsyncEngine(Engine(settings, random_checkpoint(CONFIG)))
    yield engine
    engine.close()


async def until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


class FakeKVStore:
    """The kvstore's end of the worker's link, played by the test: it answers hellos
    (while ``answer_hellos``) and attaches (with ``ack``, by default accepting with its
    host pool agent's metadata), and queues every other message for the test; it
    answers nothing else unless the test sends it."""

    def __init__(self, context: zmq.asyncio.Context, geometry: PoolCompat,
                 ack: HostAttachAck | None) -> None:  # fmt: skip
        self.channel = AsyncChannel.open(context, zmq.ROUTER, "tcp://127.0.0.1:0", bind=True)
        self.address = self.channel.endpoint
        shape = (geometry.num_layers, 2, HOST_PAGES, geometry.page_size,
                 geometry.num_kv_heads, geometry.head_dim)  # fmt: skip  # (L, 2, P, S, H, D)
        self.kv = torch.zeros(shape)
        self.agent = create_agent("zmq", "kv", self.kv, geometry)
        self.ack = ack or HostAttachAck(True, self.agent.metadata(), HOST_PAGES)
        self.answer_hellos = True
        self.attaches = 0
        self.received: asyncio.Queue[Message] = asyncio.Queue()
        self._worker = b""
        self._task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, msg = await self.channel.recv_from()  # type: ignore[misc]
            self._worker = identity
            if isinstance(msg, Hello):
                if self.answer_hellos:
                    await self.send(HelloAck("kv", "kvstore", 7))
            elif isinstance(msg, HostAttach):
                self.attaches += 1
                await self.send(self.ack)
            elif not isinstance(msg, Heartbeat):
                self.received.put_nowait(msg)

    async def send(self, msg: Message) -> None:
        await self.channel.send_to(self._worker, msg, timeout_ms=1000)

    async def next(self, timeout_s: float = 5.0) -> Message:
        return await asyncio.wait_for(self.received.get(), timeout_s)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.channel.close()
        self.agent.close()


@dataclass
class Tier:
    client: HostTierClient
    kvstore: FakeKVStore
    links: LinkSet
    device: set[int]  # the worker's view of its device cache's page hashes
    hashes: list[int]  # of PROMPT's full pages

    @property
    def link(self) -> Link:
        return self.links.links[0]

    def count(self, key: str) -> int:
        return int(getattr(self.client.stats(), key))


@contextlib.asynccontextmanager
async def linked_tier(
    engine: AsyncEngine, ack: HostAttachAck | None = None, attached: bool = True, **settings
) -> AsyncIterator[Tier]:
    """A client linked to a fake kvstore; waits until it is attached (if ``attached``)."""
    values = {"transfer_backend": "zmq", "host_spill_buffer_mib": 1,
              "host_load_min_tokens": MIN_TOKENS, "host_lookup_timeout_s": 5.0}  # fmt: skip
    values.update(settings)
    info = engine.info
    context = zmq.asyncio.Context()
    kvstore = FakeKVStore(context, info.geometry, ack)
    agent: KVTransferAgent = create_agent("zmq", "w1", info.kv, info.geometry)
    device: set[int] = set()
    client = HostTierClient("w1", 1, WorkerSettings(**values), engine, agent, device)
    me = LinkIdentity("w1", "decode", 1, interval_s=0.05, peer_timeout_s=30.0)
    links = LinkSet(context, [kvstore.address], me, on_message=client.on_message,
                    on_up=client.on_up, on_down=client.on_down)  # fmt: skip
    links.start()
    try:
        if attached:
            await until(lambda: client.attached, 5.0, "the client to attach")
        hashes = page_hashes(PROMPT, PAGE, info.hash_namespace)
        yield Tier(client, kvstore, links, device, hashes)
    finally:
        await links.close()
        await client.close()
        await kvstore.close()
        agent.close()
        context.term()


def test_plan_asks_the_kvstore_only_when_more_than_the_minimum_is_missing(engine):
    """No lookup (none counted, none sent) for a one-token prompt, a prompt of at most
    ``host_load_min_tokens`` pages, a prompt the device holds, or one missing exactly
    the minimum; missing one page more, exactly one lookup goes out for the pages past
    the device hit, its lease becomes the plan, and the release goes back."""

    async def scenario() -> None:
        async with linked_tier(engine) as tier:
            client, kv, hashes = tier.client, tier.kvstore, tier.hashes
            assert await client.plan("one", [7], []) is None
            short = PROMPT[:17]  # 4 full pages = MIN_TOKENS, nothing on device
            assert await client.plan("short", short, hashes[:4]) is None
            tier.device.update(hashes)
            assert await client.plan("held", PROMPT, hashes) is None
            tier.device.difference_update(hashes[6:])  # 4 pages = MIN_TOKENS missing
            assert await client.plan("at-min", PROMPT, hashes) is None
            assert tier.count("host_lookups_total") == 0

            tier.device.discard(hashes[5])  # 5 pages = 20 tokens missing
            planning = asyncio.ensure_future(client.plan("ask", PROMPT, hashes))
            assert await kv.next() == HostLookup("ask", tuple(hashes[5:]), reads_loading=True)
            stored = tuple(PROMPT[5 * PAGE : 8 * PAGE])  # the tokens the tier holds
            await kv.send(HostLease("ask", 3, (0, 1, 2), token_ids=stored))
            plan, lease = await asyncio.wait_for(planning, 5.0)
            assert plan == HostPlan(5, 3) and lease == HostLease("ask", 3, (0, 1, 2),
                                                                 token_ids=stored)  # fmt: skip
            client.release(lease)
            assert await kv.next() == HostRelease(3)
            assert tier.count("host_lookups_total") == 1
            assert tier.count("host_lookup_timeouts_total") == 0

    asyncio.run(scenario())


def test_a_kvstore_that_never_answers_costs_one_timeout_and_its_late_lease_is_released(engine):
    """The lookup ends with None after ``host_lookup_timeout_s`` (not sooner, not much
    later), counted once; the lease the kvstore sends afterwards is released."""

    async def scenario() -> None:
        async with linked_tier(engine, host_lookup_timeout_s=0.3) as tier:
            started = time.monotonic()
            assert await tier.client.plan("slow", PROMPT, tier.hashes) is None
            elapsed = time.monotonic() - started
            assert 0.29 <= elapsed < 1.3, elapsed
            assert await tier.kvstore.next() == HostLookup(
                "slow", tuple(tier.hashes), reads_loading=True
            )
            assert tier.count("host_lookups_total") == 1
            assert tier.count("host_lookup_timeouts_total") == 1
            await tier.kvstore.send(HostLease("slow", 5, (0, 1)))
            assert await tier.kvstore.next() == HostRelease(5)
            assert tier.count("host_lookup_timeouts_total") == 1

    asyncio.run(scenario())


def test_the_link_going_down_ends_a_waiting_lookup_at_once(engine):
    """A lookup waits (10 s allowed); the kvstore's link goes down: `plan` returns None
    at once, the tier is off, and the next plan asks nothing."""

    async def scenario() -> None:
        async with linked_tier(engine, host_lookup_timeout_s=10.0) as tier:
            assert tier.client.stats().host_attach_settled == 1  # attached
            planning = asyncio.ensure_future(tier.client.plan("r", PROMPT, tier.hashes))
            assert await tier.kvstore.next() == HostLookup(
                "r", tuple(tier.hashes), reads_loading=True
            )
            tier.kvstore.answer_hellos = False  # it stays down
            started = time.monotonic()
            tier.links.mark_down(tier.link, "the test took it down")
            assert await asyncio.wait_for(planning, 5.0) is None
            assert time.monotonic() - started < 1.0
            assert not tier.client.attached
            assert tier.client.stats().host_attach_settled == 0  # the gateway waits
            assert await tier.client.plan("after", PROMPT, tier.hashes) is None
            assert tier.count("host_lookups_total") == 1
            assert tier.client.stats().host_attached == 0

    asyncio.run(scenario())


def test_a_lease_for_a_query_nobody_waits_on_is_released(engine):
    """A `HostLease` for a query this worker is not waiting on: its lease goes straight
    back as a `HostRelease`, so the kvstore's pages are not held until the lease runs
    out."""

    async def scenario() -> None:
        async with linked_tier(engine) as tier:
            await tier.kvstore.send(HostLease("nobody-asked", 9, (0, 1)))
            assert await tier.kvstore.next() == HostRelease(9)
            assert tier.count("host_lookups_total") == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("ack", "logged"),
    [
        (HostAttachAck(False, reason="no room"), "the kvstore refused the host tier: no room"),
        (HostAttachAck(True, b"\x93junk", HOST_PAGES), "cannot reach the host tier"),
    ],
    ids=["refused", "unreachable"],
)
def test_a_refused_attach_leaves_the_tier_off(engine, caplog, ack, logged):
    """The kvstore refuses the attach, or accepts with metadata the worker's agent cannot
    use: the client stays detached, its agent knows no kvstore, and `plan` asks nothing."""

    def seen() -> bool:
        return any(logged in r.getMessage() for r in caplog.records
                   if r.name == "radixserve.runtime.host_tier")  # fmt: skip

    async def scenario() -> None:
        async with linked_tier(engine, ack=ack, attached=False) as tier:
            await until(seen, 5.0, "the attach to be answered")
            assert tier.kvstore.attaches == 1
            assert not tier.client.attached and tier.client.agent.peers == {}
            assert await tier.client.plan("r", PROMPT, tier.hashes) is None
            assert tier.count("host_lookups_total") == 0

    with caplog.at_level(logging.WARNING, logger="radixserve.runtime.host_tier"):
        asyncio.run(scenario())


async def compute(engine: AsyncEngine, prompt: list[int]) -> None:
    """Run ``prompt`` for one token: its full pages enter the cache (and, with write
    through on first use, the spill buffer)."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    async for _ in engine.stream(prompt, params):
        pass


def test_spilled_buffer_pages_come_back_on_spill_done_or_after_the_quarantine(engine, monkeypatch):
    """Write-through on first use: a computed 13-token prompt offers its 3 full pages from
    buffer pages 0-2, and `SpillDone` returns them. A second offer is still being read
    when the link goes down: its pages stay out of use (a late `SpillDone` does not
    return them) until the quarantine ends, then come back exactly once."""
    monkeypatch.setattr(host_tier, "_QUARANTINE_S", 0.3)

    async def scenario() -> None:
        async with linked_tier(engine, host_write_through_uses=1) as tier:
            client, kv = tier.client, tier.kvstore
            total = client.stats().host_spill_buffer_pages
            first = list(range(1, 14))
            await compute(engine, first)
            offer = await kv.next()
            assert isinstance(offer, SpillOffer)
            assert offer.page_hashes == tuple(page_hashes(first, PAGE, engine.info.hash_namespace))
            assert (offer.spill_id, offer.buffer_page_ids) == (1, (0, 1, 2))
            assert client.stats().host_spill_buffer_free == total - 3
            await kv.send(SpillDone(1, 3))
            await until(lambda: client.stats().host_spill_buffer_free == total, 5.0,
                        "the buffer pages to come back")  # fmt: skip
            assert tier.count("host_spill_stored_pages_total") == 3

            await compute(engine, list(range(100, 113)))
            second = await kv.next()
            assert isinstance(second, SpillOffer) and len(second.buffer_page_ids) == 3
            kv.answer_hellos = False
            tier.links.mark_down(tier.link, "the test took it down")
            client.on_message(tier.link, SpillDone(second.spill_id, 3))  # too late
            assert client.stats().host_spill_buffer_free == total - 3
            assert tier.count("host_spill_stored_pages_total") == 3
            await until(lambda: client.stats().host_spill_buffer_free >= total, 5.0,
                        "the quarantine to end")  # fmt: skip
            assert client.stats().host_spill_buffer_free == total

    asyncio.run(scenario())


def test_a_lookup_carries_the_workers_measured_prefill_rate(engine):
    """Before any prefill the lookup says 0 (not measured); after one, it carries the
    engine's prefill tokens per second, from which the kvstore decides whether reading
    its disk pages beats computing them. A lease with pages from disk is counted."""

    async def scenario() -> None:
        async with linked_tier(engine) as tier:
            client, kv = tier.client, tier.kvstore
            assert engine.stats().prefill_tokens_per_s == 0.0
            await compute(engine, list(range(200, 240)))
            rate = engine.stats().prefill_tokens_per_s
            steps = engine.stats().steps
            assert (
                rate == steps["engine_prefill_tokens_total"] / steps["engine_prefill_seconds_total"]
                and rate > 0
            )
            planning = asyncio.ensure_future(client.plan("r", PROMPT, tier.hashes))
            lookup = await kv.next()
            assert isinstance(lookup, HostLookup) and lookup.prefill_tokens_per_s == rate
            await kv.send(HostLease("r", 4, (0, 1, 2, 3, 4), disk_pages=2,
                                    token_ids=tuple(PROMPT[: 5 * PAGE])))  # fmt: skip
            plan, lease = await asyncio.wait_for(planning, 5.0)
            assert plan == HostPlan(0, 5) and lease.disk_pages == 2
            assert tier.count("host_disk_leases_total") == 1
            client.release(lease)

    asyncio.run(scenario())


@pytest.mark.parametrize("fails", [False, True], ids=["all ready", "a disk page fails"])
def test_a_loading_lease_is_read_part_by_part_as_its_pages_are_ready(engine, fails):
    """A lease of 5 host pages still loading from disk, 2 of them ready: the worker reads
    those 2 into its device pages at once, while the other 3 are still being "read from
    disk" (filled in the kvstore's pool only afterwards, so an early read would copy
    zeros); `HostPagesReady` for all 5 lets it read the rest, and the device pages hold
    the host pages' bytes. When the kvstore says the rest failed, the read fails
    (counted) and the prompt is computed."""

    async def scenario() -> None:
        async with linked_tier(engine) as tier:
            client, kv = tier.client, tier.kvstore
            serving = asyncio.Event()
            server = asyncio.ensure_future(kv.agent.serve_reads_while(lambda: True, serving))
            serving.set()
            try:
                kv.kv[:, :, :2] = torch.rand_like(kv.kv[:, :, :2])
                planning = asyncio.ensure_future(client.plan("r", PROMPT, tier.hashes))
                assert isinstance(await kv.next(), HostLookup)
                lease = HostLease("r", 4, (0, 1, 2, 3, 4), 3, loading=True, ready_pages=2,
                                  token_ids=tuple(PROMPT[: 5 * PAGE]))  # fmt: skip
                await kv.send(lease)
                plan, got = await asyncio.wait_for(planning, 5.0)
                assert plan == HostPlan(0, 5) and got == lease
                device = engine.info.kv  # (L, 2, P, S, H, D); pages 1..5 are free
                dst = (1, 2, 3, 4, 5)
                reading = asyncio.ensure_future(client.read(lease, dst))
                await until(lambda: torch.equal(device[:, :, 1:3], kv.kv[:, :, :2]), 5.0,
                            "the ready pages on device")  # fmt: skip
                await asyncio.sleep(0.05)
                assert not reading.done()  # it waits for the pages still on disk
                kv.kv[:, :, 2:5] = torch.rand_like(kv.kv[:, :, 2:5])
                await kv.send(HostPagesReady("r", 2 if fails else 5, failed=fails))
                assert await asyncio.wait_for(reading, 5.0) is not fails
                assert torch.equal(device[:, :, 1:6], kv.kv[:, :, :5]) is not fails
                assert tier.count("host_load_failures_total") == int(fails)
                assert tier.count("host_loads_total") == int(not fails)
                client.release(lease)
                assert isinstance(await kv.next(), HostRelease)
            finally:
                server.cancel()
                await asyncio.gather(server, return_exceptions=True)

    asyncio.run(scenario())


def test_a_lookup_waits_longer_only_for_a_disk_tier_and_never_past_computing():
    """Without a disk tier (or a measured rate) the wait is ``host_lookup_timeout_s``;
    with one, what computing the tokens takes when that is longer, capped by
    ``host_load_timeout_s``."""
    s = WorkerSettings(host_lookup_timeout_s=0.2, host_load_timeout_s=30.0)
    assert lookup_wait_s(s, 4000, 400.0, disk_tier=False) == 0.2
    assert lookup_wait_s(s, 4000, 0.0, disk_tier=True) == 0.2  # no prefill measured yet
    assert lookup_wait_s(s, 4000, 400.0, disk_tier=True) == 10.0
    assert lookup_wait_s(s, 40, 400.0, disk_tier=True) == 0.2  # computing is quicker
    assert lookup_wait_s(s, 400_000, 400.0, disk_tier=True) == 30.0


def test_leased_pages_whose_stored_tokens_differ_from_the_prompt_are_not_used(engine):
    """A lease whose third page holds other tokens than the prompt's (under the
    prompt's hash): the plan keeps the two pages before it, the others are counted in
    ``kv_identity_mismatch_total``; a lease whose first page differs, or that carries no
    tokens, is released and the prompt computed."""

    async def scenario() -> None:
        async with linked_tier(engine) as tier:
            client, kv = tier.client, tier.kvstore
            stored = list(PROMPT[: 5 * PAGE])
            stored[2 * PAGE + 1] += 1
            planning = asyncio.ensure_future(client.plan("r", PROMPT, tier.hashes))
            assert isinstance(await kv.next(), HostLookup)
            await kv.send(HostLease("r", 4, (0, 1, 2, 3, 4), token_ids=tuple(stored)))
            plan, lease = await asyncio.wait_for(planning, 5.0)
            assert plan == HostPlan(0, 2)
            assert tier.count("kv_identity_mismatch_total") == 3
            client.release(lease)
            assert await kv.next() == HostRelease(4)
            for query, tokens in (("first", [PROMPT[0] + 1, *PROMPT[1 : 5 * PAGE]]), ("bare", [])):
                planning = asyncio.ensure_future(client.plan(query, PROMPT, tier.hashes))
                assert isinstance(await kv.next(), HostLookup)
                await kv.send(HostLease(query, 5, (0, 1, 2, 3, 4), token_ids=tuple(tokens)))
                assert await asyncio.wait_for(planning, 5.0) is None
                assert await kv.next() == HostRelease(5)
            assert tier.count("kv_identity_mismatch_total") == 3 + 5 + 5

    asyncio.run(scenario())


def test_the_kvstore_reads_only_the_buffer_pages_on_offer(engine):
    """The spill buffer's agent grants each offer's pages to the kvstore's agent until its
    `SpillDone`: the kvstore reads them, but not another buffer page, nor the offered
    ones once they are back (a read of those is refused and counted)."""

    async def scenario() -> None:
        async with linked_tier(engine, host_write_through_uses=1) as tier:
            client, kv = tier.client, tier.kvstore
            buffer = client.buffer_agent
            kv.agent.add_peer(buffer.name, 1, buffer.metadata())

            async def read(pages: list[int]) -> str:
                handle = kv.agent.read_pages(buffer.name, pages, list(range(len(pages))))
                return await kv.agent.wait_async(handle)

            await compute(engine, list(range(1, 14)))
            offer = await kv.next()
            assert isinstance(offer, SpillOffer) and offer.buffer_page_ids == (0, 1, 2)
            assert await read([0, 1, 2]) == "done"
            assert await read([3]) == "failed" and buffer.refused_reads == 1
            await kv.send(SpillDone(offer.spill_id, 3))
            await until(lambda: buffer.grants.num_pages() == 0, 5.0, "the grants revoked")
            assert await read([0]) == "failed" and buffer.refused_reads == 2

    asyncio.run(scenario())
